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
