import os
import sys
import time
import types

import pytest

from anabranch.config import RewardConfig, RewardFunctionConfig
from anabranch.rewards import RewardError, RewardOutput, build_rewards, score_detailed


def _install(monkeypatch, **fns):
    mod = types.ModuleType("guard_test_rewards")
    for name, fn in fns.items():
        setattr(mod, name, fn)
    monkeypatch.setitem(sys.modules, "guard_test_rewards", mod)


def _ok(prompts, completions, **_):
    return [1.0] * len(completions)


def _raises(prompts, completions, **_):
    raise ZeroDivisionError("boom")


def _hangs(prompts, completions, pid_file=None, **_):
    import subprocess

    # Start a grandchild too: it must die with the hung function.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(pid_file, "w") as f:
        f.write(str(child.pid))
    while True:
        time.sleep(0.05)


def _wrong_len(prompts, completions, **_):
    return [1.0]


def _with_metrics(prompts, completions, **_):
    return RewardOutput([0.5] * len(completions), {"custom": 3.0})


def _cfg(*names, timeout=2.0, isolation="process", strict=False, params=None):
    return RewardConfig(functions=[RewardFunctionConfig(f"guard_test_rewards:{n}", 1.0, dict(params or {}))
                                   for n in names], timeout_s=timeout, isolation=isolation, strict=strict)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie counts as gone
        return f.read().split()[2] != "Z"


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_raising_and_malformed_rewards_give_zero_and_are_counted(monkeypatch, isolation):
    _install(monkeypatch, ok=_ok, raises=_raises, wrong_len=_wrong_len, with_metrics=_with_metrics)
    sources = build_rewards(_cfg("ok", "raises", "wrong_len", "with_metrics", isolation=isolation))
    out = score_detailed(sources, ["p", "p"], ["a", "b"], [{}, {}])
    assert out.total == [1.5, 1.5]
    assert out.per_source["guard_test_rewards:raises"] == [0.0, 0.0]
    assert out.metrics["reward/guard_test_rewards:raises/failures"] == 1.0
    assert out.metrics["reward/guard_test_rewards:wrong_len/failures"] == 1.0
    assert out.metrics["reward/guard_test_rewards:ok/failures"] == 0.0
    assert out.metrics["reward/guard_test_rewards:with_metrics/custom"] == 3.0


def test_hanging_reward_is_killed_with_its_children(monkeypatch, tmp_path):
    _install(monkeypatch, hangs=_hangs, ok=_ok)
    pid_file = tmp_path / "pid"
    sources = build_rewards(_cfg("hangs", "ok", timeout=1.5, params={"pid_file": str(pid_file)}))
    sources[1].params = {}
    t = time.perf_counter()
    out = score_detailed(sources, ["p"], ["a"], [{}])
    assert time.perf_counter() - t < 6
    assert out.total == [1.0]
    assert out.metrics["reward/guard_test_rewards:hangs/failures"] == 1.0
    grandchild = int(pid_file.read_text())
    deadline = time.time() + 3
    while _alive(grandchild) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild), "a process started by the hung reward was left behind"


def test_strict_mode_stops_the_run(monkeypatch):
    _install(monkeypatch, raises=_raises)
    sources = build_rewards(_cfg("raises", strict=True))
    with pytest.raises(RewardError, match="boom"):
        score_detailed(sources, ["p"], ["a"], [{}])


def test_thread_isolation_times_out(monkeypatch):
    _install(monkeypatch, slow=lambda p, c, **_: time.sleep(5) or [1.0])
    sources = build_rewards(_cfg("slow", timeout=0.3, isolation="thread"))
    t = time.perf_counter()
    out = score_detailed(sources, ["p"], ["a"], [{}])
    assert time.perf_counter() - t < 2 and out.total == [0.0]
    assert out.metrics["reward/guard_test_rewards:slow/failures"] == 1.0


# ---------------------------------------------------------------- failures are said on the console
def _warnings(capsys, name):
    """The console lines (stdout, where tqdm.write puts the trainer's warnings, and stderr) naming ``name``."""
    out = capsys.readouterr()
    return [line for line in (out.out + out.err).splitlines() if name in line]


def _raises_value(prompts, completions, **_):
    raise ValueError(f"cannot score {len(completions)} completions")


@pytest.mark.parametrize("isolation", ["process", "thread", "none"])
def test_failing_reward_is_warned_once_with_its_exception(monkeypatch, capsys, isolation):
    _install(monkeypatch, ok=_ok, raises=_raises, wrong_len=_wrong_len)
    sources = build_rewards(_cfg("ok", "raises", "wrong_len", isolation=isolation))
    for _ in range(4):
        out = score_detailed(sources, ["p", "p"], ["a", "b"], [{}, {}])
        assert out.total == [1.0, 1.0]
    captured = capsys.readouterr()
    lines = (captured.out + captured.err).splitlines()
    raised = [line for line in lines if "guard_test_rewards:raises" in line]
    assert len(raised) == 1, raised  # four identical failures, one line
    assert raised[0].startswith("anabranch: warning: reward 'guard_test_rewards:raises' failed (raised): ")
    assert "ZeroDivisionError: boom" in raised[0] and "in _raises" in raised[0]
    assert "1 failure in 1 call so far" in raised[0]
    wrong = [line for line in lines if "guard_test_rewards:wrong_len" in line]
    assert len(wrong) == 1, wrong
    assert "failed (bad return value): returned 1 values for 2 completions" in wrong[0]
    assert not [line for line in lines if "guard_test_rewards:ok" in line]  # a working reward is silent


def test_repeated_failures_are_reminded_every_n_with_the_count(monkeypatch, capsys):
    import anabranch.rewards.guard as guard

    monkeypatch.setattr(guard, "WARN_EVERY", 4)
    _install(monkeypatch, ok=_ok, raises=_raises)
    sources = build_rewards(_cfg("raises", "ok", isolation="thread"))
    for _ in range(9):
        score_detailed(sources, ["p"], ["a"], [{}])
    lines = _warnings(capsys, "guard_test_rewards:raises")
    assert len(lines) == 3, lines  # failures 1, 4 and 8
    assert "1 failure in 1 call so far" in lines[0] and "every 4th" in lines[0]
    assert "4 failures in 4 calls so far" in lines[1]
    assert "8 failures in 8 calls so far" in lines[2] and "ZeroDivisionError: boom" in lines[2]


def test_a_different_failure_is_warned_and_distinct_ones_are_capped(monkeypatch, capsys):
    _install(monkeypatch, raises_value=_raises_value)
    sources = build_rewards(_cfg("raises_value", isolation="none"))
    for n in (1, 1, 2, 2, 1):
        score_detailed(sources, ["p"] * n, ["a"] * n, [{}] * n)
    lines = _warnings(capsys, "guard_test_rewards:raises_value")
    assert len(lines) == 2, lines  # the first failure, then the first with another message
    assert "ValueError: cannot score 1 completions" in lines[0]
    assert "ValueError: cannot score 2 completions" in lines[1] and "3 failures in 3 calls" in lines[1]

    from anabranch.rewards.guard import MAX_DISTINCT, FailureLog

    written = []
    log = FailureLog("r", every=1000, write=written.append)
    for i in range(50):  # a message that changes every call does not flood either
        log.failed("raised", f"KeyError: {i}")
    assert len(written) == MAX_DISTINCT


def test_timeout_and_missing_fields_are_warned(monkeypatch, capsys):
    from anabranch.rewards import RewardSource

    _install(monkeypatch, slow=lambda p, c, **_: time.sleep(5) or [1.0])
    sources = build_rewards(_cfg("slow", timeout=0.3, isolation="thread"))
    score_detailed(sources, ["p"], ["a"], [{}])
    lines = _warnings(capsys, "guard_test_rewards:slow")
    assert len(lines) == 1 and "failed (timed out): no result after 0.3 s" in lines[0]

    needs = RewardSource("needs_answer", 1.0, _ok, {}, {"needs_fields": ("answer",)})
    for _ in range(2):
        out = score_detailed([needs], ["p"], ["a"], [{}])
    assert out.metrics["reward/needs_answer/failures"] == 1.0
    lines = _warnings(capsys, "needs_answer")
    assert len(lines) == 1 and "failed (missing fields)" in lines[0] and "'answer'" in lines[0]


def test_strict_mode_names_the_kind_and_exception(monkeypatch, capsys):
    _install(monkeypatch, wrong_len=_wrong_len)
    sources = build_rewards(_cfg("wrong_len", strict=True))
    with pytest.raises(RewardError, match=r"bad return value\): returned 1 values for 2"):
        score_detailed(sources, ["p", "p"], ["a", "b"], [{}, {}])
