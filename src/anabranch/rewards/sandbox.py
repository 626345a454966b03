"""Running model-written Python against tests, isolated from the machine it runs on.

Each run gets:

* a fresh temporary working directory (deleted afterwards) and an environment holding only
  ``PATH``, ``HOME`` (that directory) and locale variables: no secrets from the trainer's env;
* its own session and process group, killed as a whole (SIGKILL) at the wall-clock deadline;
* resource limits set before ``exec``: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS),
  processes (RLIMIT_NPROC), size of any file it writes (RLIMIT_FSIZE), open files, no core dumps;
* where ``unshare -rmnpf`` works (Linux with user namespaces; probed once), new user, mount,
  network and PID namespaces: no network interface but a downed loopback, its own ``/proc`` (the
  trainer's processes and their environments are invisible), every mount read-only except the
  working directory, and then a second user namespace so that the program holds no capability
  that could undo this; when the namespace's init dies, the kernel kills every process in it;
* an audit hook in the child (``sandbox_harness.py``) refusing process creation, sockets,
  ctypes, gc introspection and writes/deletes outside the working directory.

Guarantee, stated honestly: with namespaces, a program cannot change files outside its directory
(the kernel refuses: read-only mounts), reach the network, see the trainer's environment or
outlive its deadline. Without namespaces (``SandboxInfo.namespaces`` is False, e.g. no
``unshare`` or user namespaces disabled) the file and network protection rests on the audit
hook, which stops Python-level calls but not native code a program might load some other way;
treat that mode as unsafe for adversarial code. RLIMIT_NPROC does not bind a process whose real
uid is 0 (the kernel exempts root), so under root the audit hook and the PID namespace (killed
whole at the deadline) are what stop a fork bomb. The harness shares its process with the
program, so a program written to attack the harness itself could forge its own pass report: the
sandbox protects the machine, it does not make the reward unhackable.
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

HARNESS = Path(__file__).with_name("sandbox_harness.py")
MB = 1024 * 1024


@dataclass
class SandboxLimits:
    wall_s: float = 10.0        # wall clock for the whole run (includes interpreter start-up)
    cpu_s: int = 5              # CPU seconds (RLIMIT_CPU)
    memory_mb: int = 1024       # address space (RLIMIT_AS)
    nproc: int = 64             # processes/threads it may add (RLIMIT_NPROC; ignored by the kernel for root)
    fsize_mb: int = 16          # largest file it may write (RLIMIT_FSIZE), its stdout included
    nofile: int = 64            # open file descriptors
    output_kb: int = 64         # stdout/stderr kept for the report


@dataclass
class SandboxResult:
    passed: int
    total: int
    timed_out: bool = False
    error: str = ""             # why the program produced no report (setup failure, exception type)
    stdout: str = ""
    stderr: str = ""
    passed_ids: list = field(default_factory=list)
    program_stdout: str = ""    # stdout without the harness's report lines: what the program printed

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total


def _user_tasks() -> int:
    """Processes and threads the calling user runs now (what RLIMIT_NPROC counts), from /proc."""
    uid, count = os.getuid(), 0
    try:
        entries = list(os.scandir("/proc"))
    except OSError:
        return 0
    for entry in entries:
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry.name}/task"))
            except OSError:  # the process ended meanwhile
                pass
    return count


def _nproc_limit(limits: SandboxLimits) -> int:
    """RLIMIT_NPROC for a run: ``limits.nproc`` more tasks than the user has now.

    The kernel counts every process and thread of the real user against it, the trainer's
    included: a trainer with torch's thread pools holds more than 64 tasks, and a bare limit of 64
    made ``unshare --fork`` fail (every program scored 0, "fork failed: Resource temporarily
    unavailable") or, when it hit the probe, silently turned the namespaces off. Root is exempt."""
    return limits.nproc + (_user_tasks() if os.getuid() != 0 else 0)


def _set_limits(limits: SandboxLimits):
    libc = _libc()
    nproc = _nproc_limit(limits)  # measured here, in the parent, before the fork

    def apply():
        if libc is not None:
            # Die with the thread that started us: a reward worker killed at its own deadline
            # takes its sandboxes down too (they are in their own sessions, out of its group).
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        os.umask(0o077)
        for res, value in ((resource.RLIMIT_CPU, limits.cpu_s), (resource.RLIMIT_AS, limits.memory_mb * MB),
                           (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_FSIZE, limits.fsize_mb * MB),
                           (resource.RLIMIT_NOFILE, limits.nofile), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(res, (value, value))
    return apply


@lru_cache(maxsize=1)
def _libc():
    try:
        import ctypes

        return ctypes.CDLL(None)
    except OSError:
        return None


def _clean_env(workdir: str) -> dict:
    return {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}


def _namespace_prefix() -> list[str]:
    exe = shutil.which("unshare")
    if exe is None:
        return []
    return [exe, "--user", "--map-root-user", "--mount", "--net", "--pid", "--fork", "--mount-proc", "--kill-child"]


@lru_cache(maxsize=1)
def namespaces_available() -> bool:
    """Whether the full namespace lockdown works here (tried once with an empty program)."""
    prefix = _namespace_prefix()
    if not prefix:
        return False
    try:
        res = _run(prefix, "pass", [], "", SandboxLimits(wall_s=20), lockdown=True)
    except OSError:
        return False
    return res.error == "" and res.total == 0 and not res.timed_out


def _run(prefix: list[str], program: str, tests: list[str], setup: str, limits: SandboxLimits,
         lockdown: bool, audit_hook: bool = True) -> SandboxResult:
    nonce = secrets.token_hex(16)
    job = {"nonce": nonce, "program": program, "setup": setup, "tests": list(tests), "lockdown": lockdown,
           "audit_hook": audit_hook}
    workdir = tempfile.mkdtemp(prefix="anabranch-sbx-")
    io_dir = tempfile.mkdtemp(prefix="anabranch-sbx-io-")  # outside the program's reach
    timed_out = False
    try:
        paths = {k: os.path.join(io_dir, k) for k in ("in", "out", "err")}
        Path(paths["in"]).write_text(json.dumps(job))
        with open(paths["in"], "rb") as fin, open(paths["out"], "wb") as fout, open(paths["err"], "wb") as ferr:
            proc = subprocess.Popen(
                [*prefix, sys.executable, "-I", str(HARNESS)], stdin=fin, stdout=fout, stderr=ferr,
                cwd=workdir, env=_clean_env(workdir), start_new_session=True, preexec_fn=_set_limits(limits),
            )
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)
        out = _tail(paths["out"], limits.output_kb)
        err = _tail(paths["err"], limits.output_kb)
        reports = _report_lines(paths["out"], nonce)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(io_dir, ignore_errors=True)
    return _parse(out, err, nonce, len(tests), timed_out, reports)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _tail(path: str, kb: int) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - kb * 1024))
        return f.read().decode("utf-8", "replace")


def _report_lines(path: str, nonce: str) -> list[str]:
    """The harness's report lines ("<nonce> KIND arg") from the whole output file, not only its
    kept tail: a program that prints more than ``output_kb`` must not hide the tests it passed.
    A report may follow the program's own text on the same line (``print(x, end="")``), so the
    nonce is looked for anywhere in the line. The file is bounded by RLIMIT_FSIZE."""
    key = nonce.encode()
    found = []
    with open(path, "rb") as f:
        for line in f:
            at = line.find(key)
            if at >= 0:
                found.append(line[at:].decode("utf-8", "replace").rstrip("\r\n"))
    return found


def _parse(out: str, err: str, nonce: str, total: int, timed_out: bool,
           reports: list[str] | None = None) -> SandboxResult:
    passed, started, done, error = set(), False, False, ""
    for line in (reports if reports is not None else out.splitlines()):
        at = line.find(nonce)
        if at < 0:
            continue
        head, _, rest = line[at:].partition(" ")
        if head != nonce:
            continue
        kind, _, arg = rest.partition(" ")
        if kind == "START":
            started = True
        elif kind == "PASS" and arg.isdigit() and int(arg) < total:
            passed.add(int(arg))
        elif kind == "ERROR":
            error = f"program raised {arg}"
        elif kind == "DONE":
            done = True
    if not started and not error:
        error = "sandbox did not start: " + (err.strip().splitlines() or ["no output"])[-1][:300]
    elif not done and not error:
        error = "timed out" if timed_out else "killed before finishing (limit reached)"
    return SandboxResult(len(passed), total, timed_out, error, out, err, sorted(passed),
                         program_stdout=_without_reports(out, nonce))


def _without_reports(out: str, nonce: str) -> str:
    """``out`` with the harness's report lines taken out; a report that follows the program's own text
    on a line (``print(x, end="")``) leaves that text."""
    kept = []
    for line in out.splitlines(keepends=True):
        at = line.find(nonce)
        if at < 0:
            kept.append(line)
        elif at > 0:
            kept.append(line[:at])
    return "".join(kept)


def run_tests(program: str, tests: list[str], setup: str = "", limits: SandboxLimits | None = None,
              require_namespaces: bool = False) -> SandboxResult:
    """Run ``program`` then each test snippet (Python source; passing = no exception) in a sandbox."""
    limits = limits or SandboxLimits()
    ns = namespaces_available()
    if require_namespaces and not ns:
        raise RuntimeError("the code sandbox needs Linux user namespaces (`unshare -rmnpf` failed here); "
                           "set require_namespaces=false to run with rlimits and the audit hook only")
    return _run(_namespace_prefix() if ns else [], program, tests, setup, limits, lockdown=ns)


def run_many(jobs: list[tuple[str, list[str], str]], limits: SandboxLimits | None = None,
             max_workers: int = 0, require_namespaces: bool = False) -> list[SandboxResult]:
    """``run_tests`` for each ``(program, tests, setup)``, at most ``max_workers`` at a time."""
    workers = max_workers or max(1, min(len(jobs), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda j: run_tests(j[0], j[1], j[2], limits, require_namespaces), jobs))
