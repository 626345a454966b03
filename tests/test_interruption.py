"""Runs that are killed or interrupted lose nothing: a SIGKILL in the middle of writing a
checkpoint leaves the previous one whole and resumable; SIGINT/SIGTERM finish the step, write a
checkpoint and print the command that resumes; a second SIGINT stops at once."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from anabranch import load_config, train
from anabranch.trainer.checkpoint import list_checkpoints, load_state

from test_train_e2e import tiny_overrides

HERE = Path(__file__).parent


def overrides(model_dir, data, out, **extra):
    base = {"trainer.eval_before": False, "trainer.eval_after": False, "task.eval_size": 4,
            "rollout.n": 4, "trainer.steps": 3, "trainer.save_final": False, "trainer.tensorboard": False}
    base.update(extra)
    return tiny_overrides(model_dir, data, out, **base)


def start(args, hook):
    env = {**os.environ, "HOOK": hook, "PYTHONPATH": str(HERE.parent / "src") + os.pathsep + str(HERE)}
    return subprocess.Popen([sys.executable, str(HERE / "train_with_hooks.py"), "train", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_for(proc, marker, timeout=240):
    """Read the child's stdout until a line equal to ``marker``."""
    deadline = time.time() + timeout
    for line in proc.stdout:
        if line.strip() == marker:
            return
        assert time.time() < deadline, f"no {marker!r} in time"
    raise AssertionError(f"process ended (rc={proc.wait()}) before {marker!r}: {proc.stderr.read()}")


def steps_logged(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "loss" in r]


@pytest.fixture
def data(write_jsonl):
    return write_jsonl([{"prompt": f"Q{i}: say seven", "answer": "7"} for i in range(16)])


def test_sigkill_while_writing_checkpoint_keeps_previous_one(tiny_model_dir, data, tmp_path):
    args = overrides(tiny_model_dir, data, tmp_path, **{"trainer.save_every": 1})
    proc = start(args, "hang_in_second_checkpoint")
    try:
        wait_for(proc, "WRITING-CHECKPOINT")
    finally:
        proc.kill()  # SIGKILL: no handler, no cleanup
        proc.wait(timeout=60)
    folder = tmp_path / "tiny" / "checkpoints"
    assert (folder / "step-000002.tmp" / "model").is_dir()  # the write really was cut short
    assert [p.name for p in list_checkpoints(folder)] == ["step-000001"]
    assert load_state(folder / "step-000001")["step"] == 1

    result = train(load_config(None, args + ["trainer.resume=auto"]))
    assert len(result.history) == 3
    assert steps_logged(tmp_path / "tiny") == [1, 2, 3]  # the killed run's step-2 row was replaced
    assert [p.name for p in folder.iterdir()] and not list(folder.glob("*.tmp"))  # leftover cleaned
    assert [p.name for p in list_checkpoints(folder)] == ["step-000001", "step-000002", "step-000003"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_finishes_step_checkpoints_and_prints_resume_command(tiny_model_dir, data, tmp_path, sig):
    args = overrides(tiny_model_dir, data, tmp_path, **{"trainer.steps": 4})
    proc = start(args, "slow_update:1.5")
    wait_for(proc, "UPDATE 2")
    proc.send_signal(sig)  # arrives while step 2 is updating
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + sig, err
    assert f"stopped by {sig.name} after step 2" in err
    ckpts = list_checkpoints(tmp_path / "tiny" / "checkpoints")
    assert [p.name for p in ckpts] == ["step-000002"] and load_state(ckpts[0])["step"] == 2
    assert steps_logged(tmp_path / "tiny") == [1, 2]
    command = err.split("resume with:\n", 1)[1].strip().splitlines()[0]
    assert command.startswith("anabranch train --config ") and command.endswith("trainer.resume=auto")
    if sig == signal.SIGINT:  # the printed command really resumes (SIGTERM prints the same)
        argv = shlex.split(command)
        assert argv[:3] == ["anabranch", "train", "--config"]
        result = train(load_config(argv[3], argv[4:]))  # what `anabranch train` does with them
        assert len(result.history) == 4
        assert steps_logged(tmp_path / "tiny") == [1, 2, 3, 4]


def test_second_sigint_stops_at_once(tiny_model_dir, data, tmp_path):
    proc = start(overrides(tiny_model_dir, data, tmp_path), "slow_update:300")
    wait_for(proc, "UPDATE 1")
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert time.time() - t0 < 30  # not the 300 s the step would take
    assert proc.returncode == 130 and "interrupted at once" in err
    assert list_checkpoints(tmp_path / "tiny" / "checkpoints") == []


def test_signal_handler_states():
    # Before training starts a signal stops at once; during training the first one only asks to
    # stop after the step, the second stops at once; the old handlers come back afterwards.
    from anabranch.trainer.signals import GracefulStop

    before = signal.getsignal(signal.SIGINT)
    with GracefulStop() as stop:
        with pytest.raises(KeyboardInterrupt, match="before training started"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        stop.training = True
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.requested and stop.signum == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt, match="second SIGINT"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is before
