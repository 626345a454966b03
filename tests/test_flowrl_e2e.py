"""FlowRL through the real trainer on a tiny model: it runs with every log Z source, logs its
metrics, keeps the log Z head in checkpoints (restorable) and out of the Hugging Face export."""

import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from anabranch import load_config, train
from anabranch.models.log_z import LogZHead
from anabranch.trainer.checkpoint import load_module_states
from test_train_e2e import digit_task, tiny_overrides

FLOWRL_METRICS = ("flowrl/log_z_mean", "flowrl/log_z_std", "flowrl/residual_mean", "flowrl/residual_std",
                  "flowrl/is_weight_mean", "flowrl/is_clip_frac", "entropy", "reward/mean", "loss", "grad_norm")


def flowrl_run(tiny_model_dir, write_jsonl, tmp_path, **extra):
    overrides = {"algorithm.name": "flowrl", "trainer.steps": 4, "trainer.eval_before": False,
                 "trainer.eval_after": False, "rollout.n": 4, "trainer.micro_batch_size": 6, **extra}
    return train(load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path, **overrides)))


def test_flowrl_head_trains_checkpoints_and_exports_clean(tiny_model_dir, write_jsonl, tmp_path):
    result = flowrl_run(tiny_model_dir, write_jsonl, tmp_path, **{"trainer.save_every": 2})
    for key in FLOWRL_METRICS:
        assert all(math.isfinite(m[key]) for m in result.history), key
    assert all(m["skipped_updates"] == 0 for m in result.history)
    # With one pass per batch π_old = π_θ: every importance weight is 1.
    assert all(m["flowrl/is_weight_mean"] == pytest.approx(1.0) for m in result.history)

    ckpts = Path(result.run_dir) / "checkpoints"
    states = [torch.load(ckpts / f"step-{s:06d}" / "trainer_state.pt", weights_only=False, map_location="cpu") for s in (2, 4)]
    heads = [s["modules"]["log_z"] for s in states]
    assert heads[0]["net.0.weight"].shape == (64, 64)
    assert not torch.equal(heads[0]["net.8.weight"], heads[1]["net.8.weight"])  # the head is trained
    # The optimizer holds the policy and the head (its own group), so resuming restores both.
    head = LogZHead(64)
    assert len(states[1]["optimizer"]["param_groups"]) == 2
    assert len(states[1]["optimizer"]["param_groups"][1]["params"]) == len(list(head.parameters()))
    load_module_states({"log_z": head}, states[1])
    assert torch.equal(head.state_dict()["net.8.weight"], heads[1]["net.8.weight"])
    with pytest.raises(ValueError, match="same algorithm settings"):
        load_module_states({}, states[1])

    # Exports (final and checkpoint model folders) hold only the policy and load with no
    # unexpected or missing weights.
    from transformers import AutoModelForCausalLM

    for folder in (Path(result.final_model_dir), ckpts / "step-000004" / "model"):
        names = []
        for f in folder.glob("*.safetensors"):
            with safe_open(str(f), "pt") as st:
                names += list(st.keys())
        assert names and not [n for n in names if "log_z" in n or n.startswith("net.")]
        _, info = AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True)
        assert not info["unexpected_keys"] and not info["missing_keys"], info


@pytest.mark.parametrize("extra", [
    {"algorithm.flowrl.log_z": "vargrad", "algorithm.flowrl.reference": "old"},
    # reference=none: with π_θ = π_ref, equal rewards and log Z = 0 the loss would be exactly 0.
    {"algorithm.flowrl.log_z": "scalar", "algorithm.flowrl.length_norm": False, "algorithm.ppo_epochs": 2,
     "algorithm.flowrl.is_mode": "clip", "algorithm.flowrl.reference": "none"},
])
def test_flowrl_variants_run(tiny_model_dir, write_jsonl, tmp_path, extra):
    result = flowrl_run(tiny_model_dir, write_jsonl, tmp_path, **{"trainer.steps": 2, **extra})
    assert all(math.isfinite(m["loss"]) and m["skipped_updates"] == 0 for m in result.history)
    config = (Path(result.run_dir) / "config.yaml").read_text()
    assert "log_z: " + extra["algorithm.flowrl.log_z"] in config
    if extra.get("algorithm.ppo_epochs") == 2:
        # Second pass: the policy moved, so some weights differ from 1 and clip is reported.
        assert any(m["flowrl/is_weight_mean"] != 1.0 for m in result.history)
        assert all(m["loss"] > 0 for m in result.history)


@pytest.mark.slow
def test_flowrl_reward_rises_on_tiny_model(tiny_model_dir, write_jsonl, tmp_path):
    result = flowrl_run(tiny_model_dir, write_jsonl, tmp_path, **{"trainer.steps": 30, "rollout.n": 8,
                                                                  "trainer.micro_batch_size": 32})
    rewards = [m["reward/mean"] for m in result.history]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.3, rewards
