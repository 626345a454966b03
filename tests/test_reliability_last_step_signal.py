"""A SIGINT/SIGTERM during the run's last step: the run still stops promptly (the step, its
checkpoint, exit 128+signal), says that every step is trained, and resuming that checkpoint runs
only the end-of-run work (eval_after, final/, summary.json) without training a step again."""

import json
import shlex
import signal

import torch
from safetensors.torch import load_file

from anabranch import load_config, train
from anabranch.trainer.checkpoint import list_checkpoints, load_state

from test_interruption import overrides, start, steps_logged, wait_for


def _weights(folder):
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_signal_in_the_last_step_then_resume_finishes_the_run(tiny_model_dir, write_jsonl, tmp_path, capsys):
    data = write_jsonl([{"prompt": f"Q{i}: say seven", "answer": "7"} for i in range(16)])
    args = overrides(tiny_model_dir, data, tmp_path, **{"trainer.steps": 2, "trainer.eval_after": True,
                                                         "trainer.save_final": True})
    run = tmp_path / "tiny"
    proc = start(args, "slow_update:1.5")
    wait_for(proc, "UPDATE 2")
    proc.send_signal(signal.SIGTERM)  # arrives while the last step is updating
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.SIGTERM, err
    ckpts = list_checkpoints(run / "checkpoints")
    assert [p.name for p in ckpts] == ["step-000002"] and load_state(ckpts[0])["step"] == 2
    # Stopping promptly means the end-of-run work has not run; the message says all steps are done
    # and what resuming will do.
    assert not (run / "final").exists() and not (run / "summary.json").exists()
    assert not (run / "eval_after.json").exists()
    assert "all 2 steps are trained" in err and "eval_after, final/, summary.json" in err, err
    command = err.split("resume with:\n", 1)[1].strip().splitlines()[0]
    metrics_before = (run / "metrics.jsonl").read_text()

    argv = shlex.split(command)
    capsys.readouterr()
    result = train(load_config(argv[3], argv[4:]))
    assert "no step left to train, running only the end-of-run work (eval_after, final/, summary.json" in (
        capsys.readouterr().out)
    # No step trained again: the history is the checkpoint's, the log keeps steps 1 and 2 once.
    assert len(result.history) == 2 and steps_logged(run) == [1, 2]
    assert (run / "metrics.jsonl").read_text().startswith(metrics_before)
    assert (run / "eval_after.json").is_file() and result.accuracy_after is not None
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["accuracy_after"] == result.accuracy_after
    # final/ holds the weights of the checkpointed last step, bit for bit.
    assert result.final_model_dir == run / "final"
    final, ckpt = _weights(run / "final"), _weights(ckpts[0] / "model")
    assert final.keys() == ckpt.keys() and all(torch.equal(final[k], ckpt[k]) for k in final)
