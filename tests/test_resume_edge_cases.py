"""Resume paths beyond the plain full-weight run: LoRA runs, the adaptive KL coefficient, rewinding
a run to an earlier checkpoint, damaged checkpoints, and the config keys a resume warns about."""

import shutil
from pathlib import Path

import pytest
import torch

from anabranch import train
from anabranch.config import ConfigError
from anabranch.trainer.checkpoint import list_checkpoints, load_state

from test_resume import final_weights, metric_rows, run_cfg, without_timings


@pytest.fixture
def data(write_jsonl):
    return write_jsonl([{"prompt": f"Q{i}: say seven", "answer": "7" if i % 2 else "3"} for i in range(16)])


def full_and_resumed(model_dir, data, out, **extra):
    """4 steps in one go, and 2 + resume from the step-2 checkpoint + 2 in another run directory."""
    full = train(run_cfg(model_dir, data, out, **{"trainer.steps": 4, "trainer.save_every": 2,
                                                   "trainer.run_name": "full"}, **extra))
    half = Path(full.run_dir) / "checkpoints" / "step-000002"
    resumed = train(run_cfg(model_dir, data, out, **{"trainer.steps": 4, "trainer.resume": str(half),
                                                      "trainer.run_name": "resumed"}, **extra))
    assert without_timings(resumed.history) == without_timings(full.history)
    assert metric_rows(resumed.run_dir) == metric_rows(full.run_dir)[2:]
    a, b = final_weights(full), final_weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return full, resumed, half


def test_lora_run_resumes_exactly(tiny_model_dir, data, tmp_path):
    # The checkpoint's model/ holds the adapters merged into the base weights (for plain
    # transformers); resuming needs the adapters themselves. An entropy bonus and a KL to the
    # adapter-free reference give the adapters a gradient at every step of the random tiny model.
    full, _, half = full_and_resumed(tiny_model_dir, data, tmp_path, **{
        "model.lora.r": 4, "trainer.lr": 3e-2, "algorithm.entropy_coef": 0.5, "algorithm.kl_coef": 0.1,
        "reward.functions": "[{name: target_length, params: {target: 3}}]", "reward.isolation": "none"})
    assert all(m["grad_norm"] > 0 for m in full.history[2:])  # the adapters trained after the checkpoint

    from transformers import AutoModelForCausalLM, AutoTokenizer

    at_half = AutoModelForCausalLM.from_pretrained(str(half / "model")).state_dict()
    assert not any("lora" in k for k in at_half)  # plain, merged weights
    end = final_weights(full)
    assert any(not torch.equal(end[k], at_half[k]) for k in end)
    assert AutoTokenizer.from_pretrained(str(half / "model")).chat_template


def test_adaptive_kl_coefficient_resumes(tiny_model_dir, data, tmp_path):
    full, _, _ = full_and_resumed(tiny_model_dir, data, tmp_path, **{
        "algorithm.kl_coef": 0.1, "algorithm.kl_target": 0.01, "algorithm.kl_horizon": 10, "trainer.lr": 3e-2})
    coefs = [m["kl/coef"] for m in full.history]
    assert coefs[2] != coefs[0]  # the controller's value at the checkpoint is not the configured one


def test_rewinding_a_run_sets_aside_its_later_checkpoints(tiny_model_dir, data, tmp_path, capsys):
    """Resuming a run from an earlier checkpoint replaces what came after it: the later checkpoints
    must neither push out the new ones (keep_last) nor be taken by trainer.resume=auto."""
    common = {"trainer.run_name": "rw", "trainer.save_every": 1, "rollout.max_new_tokens": 4}
    first = train(run_cfg(tiny_model_dir, data, tmp_path, **common, **{"trainer.steps": 4}))
    folder = Path(first.run_dir) / "checkpoints"
    # Back to step 1, now keeping 2 checkpoints; this run stops after step 2 (as if it crashed).
    train(run_cfg(tiny_model_dir, data, tmp_path, **common, **{
        "trainer.steps": 2, "trainer.keep_last": 2, "trainer.resume": str(folder / "step-000001")}))
    assert [p.name for p in list_checkpoints(folder)] == ["step-000001", "step-000002"]
    assert load_state(folder / "step-000002")["config"]["trainer"]["keep_last"] == 2  # the new one
    assert sorted(p.name for p in folder.glob("*.discarded")) == [f"step-00000{i}.discarded" for i in (2, 3, 4)]
    capsys.readouterr()
    again = train(run_cfg(tiny_model_dir, data, tmp_path, **common, **{
        "trainer.steps": 3, "trainer.keep_last": 2, "trainer.resume": "auto"}))
    assert "continuing at step 3 of 3" in capsys.readouterr().out
    rows = [r for r in metric_rows(first.run_dir) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows == [{"step": i + 1, **m} for i, m in enumerate(without_timings(again.history))]


def test_damaged_or_incomplete_checkpoints_are_named(tiny_model_dir, data, tmp_path):
    common = {"trainer.run_name": "dmg", "rollout.max_new_tokens": 2}
    first = train(run_cfg(tiny_model_dir, data, tmp_path, **common, **{"trainer.steps": 2, "trainer.save_every": 1}))
    folder = Path(first.run_dir) / "checkpoints"

    def resume(path, name, steps=3):
        return train(run_cfg(tiny_model_dir, data, tmp_path, **{**common, "trainer.run_name": name,
                                                                 "trainer.steps": steps, "trainer.resume": path}))

    # Weights cut short (a copy that did not finish): named, with no misleading "does not fit" blame.
    cut = tmp_path / "copies" / "step-000002"
    shutil.copytree(folder / "step-000002", cut)
    weights = cut / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ConfigError, match=r"step-000002 is damaged or incomplete: .*model cannot be loaded"):
        resume(str(cut), "w")
    # No model/ at all.
    shutil.rmtree(cut / "model")
    with pytest.raises(ConfigError, match=r"incomplete checkpoint: it has trainer_state.pt but no model/config.json"):
        resume(str(cut), "m")
    # The newest checkpoint's trainer_state.pt damaged in place: resume=auto names it and the one before.
    state = folder / "step-000002" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(ConfigError, match=r"step-000002 is damaged or incomplete: .*trainer_state\.pt cannot be read"
                                          r".*trainer\.resume=.*step-000001"):
        resume("auto", "dmg")
    # ... and resuming from that one works.
    assert len(resume(str(folder / "step-000001"), "dmg", steps=2).history) == 2


def test_longer_run_under_a_decaying_lr_schedule_is_warned():
    from anabranch import load_config
    from anabranch.trainer.resume import changed_keys

    def cfg(*args):
        return load_config(None, list(args)).to_dict()

    # trainer.steps is the length of a cosine or linear schedule: every later step's LR changes.
    assert changed_keys(cfg("trainer.steps=4", "trainer.lr_schedule=cosine"),
                        cfg("trainer.steps=8", "trainer.lr_schedule=cosine")) == ["trainer.steps"]
    assert changed_keys(cfg("trainer.steps=4", "trainer.lr_schedule=linear"),
                        cfg("trainer.steps=8", "trainer.lr_schedule=linear")) == ["trainer.steps"]
    assert changed_keys(cfg("trainer.steps=4"), cfg("trainer.steps=8")) == []  # constant LR: same trajectory
    assert changed_keys(cfg("trainer.steps=4", "trainer.lr_schedule=cosine"),
                        cfg("trainer.steps=4", "trainer.lr_schedule=cosine")) == []
