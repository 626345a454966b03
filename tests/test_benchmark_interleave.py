"""benchmarks/interleave.py: two live workers run their steps in turns, one step at a time."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import interleave  # noqa: E402

# A worker in the protocol's shape: it logs each step's start and end to a shared file, then prints
# its result. It chatters on stdout (as vLLM and TRL do), which the parent must skip, and a thread of
# it spins all the time (as vLLM's gloo threads wake), which only stopping the worker keeps off the
# CPU while the other worker's step runs (0.3 s each).
WORKER = """
import json, sys, threading, time
sys.path.insert(0, {bench!r})
from interleave import wait_for_turn
name, log, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
def spin():
    while True:
        time.perf_counter()
threading.Thread(target=spin, daemon=True).start()
print("loading", name, flush=True)
for i in range(steps):
    wait_for_turn()
    with open(log, "a") as f:
        f.write(f"{{name}}{{i}}+ ")
    print("working on step", i, flush=True)
    time.sleep(0.3)
    with open(log, "a") as f:
        f.write(f"{{name}}{{i}}- ")
print("RESULT " + json.dumps({{"name": name, "steps": steps}}), flush=True)
"""


def _worker(tmp_path, name, steps, code=None):
    script = tmp_path / "worker.py"
    script.write_text(code or WORKER.format(bench=str(Path(interleave.__file__).parent)))
    return interleave.GatedWorker(name, [sys.executable, str(script), name, str(tmp_path / "log"), str(steps)])


def test_steps_run_in_turns_one_at_a_time_the_order_reversed_each_round(tmp_path):
    a, b = _worker(tmp_path, "A", 3), _worker(tmp_path, "B", 3)
    results, idle = interleave.run_in_turns([a, b], 3)

    assert results == [{"name": "A", "steps": 3}, {"name": "B", "steps": 3}]
    # Each step ends before the next one starts: no two steps overlap.
    assert (tmp_path / "log").read_text().split() == [
        "A0+", "A0-", "B0+", "B0-", "B1+", "B1-", "A1+", "A1-", "A2+", "A2-", "B2+", "B2-"]
    # A waiting worker is stopped: its spinning thread took no CPU during the other's steps (it
    # would take about 0.3 s of each if the worker were only blocked on its pipe; a tick or two
    # may pass before the stop lands).
    assert set(idle) == {"A", "B"} and all(v <= 0.05 for v in idle.values()), idle
    assert a.proc.returncode == 0 and b.proc.returncode == 0


def test_a_worker_that_dies_is_reported_and_the_started_ones_are_ended(tmp_path, capsys, monkeypatch):
    ok = tmp_path / "ok.py"
    ok.write_text(WORKER.format(bench=str(Path(interleave.__file__).parent)))
    crash = tmp_path / "crash.py"
    crash.write_text("import sys\nprint('loading', flush=True)\nsys.exit('no model here')\n")
    log = str(tmp_path / "log")
    started = []

    class Recorded(interleave.GatedWorker):
        def __init__(self, *a):
            started.append(self)
            super().__init__(*a)

    monkeypatch.setattr(interleave, "GatedWorker", Recorded)
    with pytest.raises(SystemExit, match="B worker ended before its first step"):
        interleave.start_in_turn({"A": [sys.executable, str(ok), "A", log, "1"],
                                  "B": [sys.executable, str(crash), "B", log, "1"]})
    assert "no model here" in capsys.readouterr().err
    assert started[0].proc.poll() is not None  # A, stopped and waiting, was killed, not left behind


def test_a_worker_asked_for_a_step_it_does_not_have_is_refused(tmp_path):
    a = _worker(tmp_path, "A", 1)
    a.step()
    with pytest.raises(RuntimeError, match="no steps left"):
        a.step()
    assert a.finish() == {"name": "A", "steps": 1}
