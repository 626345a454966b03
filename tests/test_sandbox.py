"""Hostile programs in the code sandbox: each scores 0, within its limits, nothing outside changes."""

import os
import time

import pytest

from anabranch.rewards.sandbox import SandboxLimits, namespaces_available, run_many, run_tests

LIMITS = SandboxLimits(wall_s=3.0, cpu_s=2, memory_mb=512)
TEST = ["assert solve() == 1"]


def _run(body: str):
    program = "def solve():\n" + "".join(f"    {line}\n" for line in body.strip().splitlines())
    t = time.perf_counter()
    res = run_tests(program, TEST, limits=LIMITS)
    return res, time.perf_counter() - t


def test_passing_and_failing_tests_are_counted():
    res = run_tests("def f(x):\n    return x * 2\n", ["assert f(2) == 4", "assert f(3) == 7", "assert f(0) == 0"])
    assert (res.passed, res.total, res.passed_ids) == (2, 3, [0, 2])
    assert res.fraction == pytest.approx(2 / 3) and not res.all_passed
    assert run_tests("def f(:\n", ["assert True"]).error.startswith("program raised SyntaxError")


def test_infinite_loop_is_killed_at_the_deadline():
    res, dt = _run("while True:\n    pass")
    assert res.passed == 0 and dt < LIMITS.wall_s + 2


def test_partial_credit_survives_a_timeout():
    res = run_tests("def f():\n    return 1\n", ["assert f() == 1", "while True: pass"], limits=LIMITS)
    # Which limit stops the loop first depends on the machine's load: the CPU-time limit (2 s) on
    # an idle machine, the wall clock (3 s) on a busy one. Either way the first test's pass is kept.
    assert res.passed == 1 and res.passed_ids == [0]
    assert res.timed_out or "limit" in (res.error or "")


def test_fork_bomb():
    res, dt = _run("import os\nwhile True:\n    os.fork()\nreturn 1")
    assert res.passed == 0 and dt < LIMITS.wall_s + 2
    res, _ = _run("import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])\nreturn 1")
    assert res.passed == 0


def test_huge_allocation_fails_inside_the_limit():
    res, dt = _run("x = bytearray(8 * 1024 ** 3)\nreturn 1")
    assert res.passed == 0 and dt < LIMITS.wall_s + 2


def test_files_outside_the_directory_are_untouched(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    os.chmod(tmp_path, 0o777)  # even a world-writable directory must be protected
    escape = f"/tmp/anabranch-escape-{os.getpid()}"
    attempts = [
        f"open({str(victim)!r}, 'w').write('pwned')",
        f"import os\nos.remove({str(victim)!r})",
        f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
        f"open({escape!r}, 'w').write('x')",
        f"import os\nos.system('rm -f {victim}; touch {escape}')",
        f"import os\nfd = os.open({str(victim)!r}, os.O_WRONLY | os.O_TRUNC)\nos.write(fd, b'x')",
    ]
    for body in attempts:
        res, _ = _run("try:\n    " + body.replace("\n", "\n    ") + "\nexcept Exception:\n    return 0\nreturn 1")
        assert res.passed == 0, body
    assert victim.read_text() == "original"
    assert not os.path.exists(escape)


def test_writing_inside_its_own_directory_works():
    res, _ = _run("open('scratch.txt', 'w').write('ok')\nreturn 1 if open('scratch.txt').read() == 'ok' else 0")
    assert res.passed == 1


def test_no_network():
    res, _ = _run("import socket\ns = socket.create_connection(('127.0.0.1', 22), timeout=1)\nreturn 1")
    assert res.passed == 0
    res, _ = _run("import urllib.request\nurllib.request.urlopen('http://pypi.org', timeout=2)\nreturn 1")
    assert res.passed == 0


def test_environment_secrets_are_not_visible(monkeypatch):
    monkeypatch.setenv("ANABRANCH_TEST_SECRET", "hunter2")
    res, _ = _run("import os\nreturn 1 if os.environ.get('ANABRANCH_TEST_SECRET') else 0")
    assert res.passed == 0
    # Nor through /proc: the parent's environment file.
    body = ("import glob\nfor p in glob.glob('/proc/*/environ'):\n    try:\n"
            "        if b'hunter2' in open(p, 'rb').read():\n            return 1\n"
            "    except Exception:\n        pass\nreturn 0")
    res, _ = _run(body)
    assert res.passed == 0


def test_os_system_is_refused():
    res, _ = _run("import os\nreturn 1 if os.system('true') == 0 else 0")
    assert res.passed == 0


@pytest.mark.skipif(not namespaces_available(), reason="needs user namespaces")
def test_kernel_layer_alone_protects_files_and_network(tmp_path):
    """With the audit hook off, the namespaces alone refuse writes outside, deletes and sockets."""
    from anabranch.rewards.sandbox import _namespace_prefix, _run as raw_run

    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    os.chmod(tmp_path, 0o777)
    escape = f"/tmp/anabranch-escape-raw-{os.getpid()}"
    tests = [f"open({str(victim)!r}, 'w').write('pwned')",
             f"import os; os.remove({str(victim)!r})",
             f"open({escape!r}, 'w').write('x')",
             "import socket; socket.create_connection(('127.0.0.1', 22), timeout=1)",
             "open('inside.txt', 'w').write('fine')",
             # the program holds no capability over the read-only mounts
             "import ctypes; l = ctypes.CDLL(None); assert l.mount(None, b'/', None, 32 | 4096, None) == 0"]
    res = raw_run(_namespace_prefix(), "", tests, "", LIMITS, lockdown=True, audit_hook=False)
    assert res.passed_ids == [4], res.stdout + res.stderr
    assert victim.read_text() == "original" and not os.path.exists(escape)


def test_bounded_parallel_pool():
    jobs = [("def f():\n    return %d\n" % i, ["assert f() % 2 == 0"], "") for i in range(6)]
    jobs.append(("while True: pass", ["assert True"], ""))
    res = run_many(jobs, limits=LIMITS, max_workers=2)
    assert [r.passed for r in res] == [1, 0, 1, 0, 1, 0, 0]


def test_no_processes_left_behind(monkeypatch):
    """Only this test's sandbox is looked for (its HOME, the work folder, carries a unique token):
    other tests' sandboxes may be running at the same time (pytest-xdist)."""
    import secrets
    import tempfile

    token = f"leftover-check-{secrets.token_hex(6)}-"
    real_mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda prefix="", **kw: real_mkdtemp(prefix=token + prefix, **kw))
    before = {p for p in os.listdir("/proc") if p.isdigit()}
    res, _ = _run("import time\ntime.sleep(100)")
    assert res.passed == 0 and res.timed_out
    time.sleep(0.2)
    after = {p for p in os.listdir("/proc") if p.isdigit()}
    for pid in after - before:
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            env = open(f"/proc/{pid}/environ", "rb").read()
        except OSError:
            continue
        assert not (b"sandbox_harness" in cmd and token.encode() in env), cmd
