"""Exact resume: N steps in one go and N/2 + resume + N/2 give the same per-step metrics and the
same final weights, including when the checkpoint falls on or straddles an epoch boundary of the
prompt sampler; checkpoints rotate (trainer.keep_last)."""

import json
from pathlib import Path

import pytest
import torch

from anabranch import load_config, train
from anabranch.algorithms.registries import OBJECTIVES
from anabranch.config import ConfigError
from anabranch.trainer.checkpoint import list_checkpoints, load_state

from test_train_e2e import tiny_overrides


class ScalarHead(torch.nn.Module):
    """A learned scalar, standing in for an extra trainable head (FlowRL's log Z, a value head)."""

    def __init__(self, model_config, algo_cfg):
        super().__init__()
        self.z = torch.nn.Parameter(torch.zeros(()))


if "test_with_head" not in OBJECTIVES:
    @OBJECTIVES.register("test_with_head", needs=(), modules={"head": ScalarHead})
    def loss_with_head(log_prob, old_log_prob, advantages, response_mask, ctx):
        # The head's value enters the loss, so a head not restored on resume changes the metrics.
        z = ctx.modules["head"].z
        seq = (log_prob * response_mask).sum(-1)
        loss = ((seq.detach() * 0 + z - ctx.rewards) ** 2).mean() + ctx.aggregate(-advantages * log_prob, response_mask)
        return loss, {"head_z": z.item()}


def run_cfg(model_dir, data, out, **extra):
    base = {"trainer.eval_before": False, "trainer.eval_after": False, "task.eval_size": 4,
            "rollout.n": 4, "rollout.max_new_tokens": 6, "trainer.lr": 3e-3,
            # A schedule and warmup make the scheduler state matter; sampling makes the RNG matter.
            "trainer.lr_schedule": "cosine", "trainer.warmup_steps": 2}
    base.update(extra)
    return load_config(None, tiny_overrides(model_dir, data, out, **base))


def without_timings(history):
    return [{k: v for k, v in m.items() if not k.startswith("time/")} for m in history]


def final_weights(result):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(result.final_model_dir)).state_dict()


def metric_rows(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


# 12 training rows (16 - 4 held out). 4 prompts per step: the checkpoint after step 3 ends epoch 0
# exactly; 5 prompts per step: steps 3 and 4 each straddle an epoch boundary.
# The third case adds an extra trainable head (ctx.modules), saved and restored with the policy.
@pytest.mark.parametrize("prompts_per_step,loss", [(4, "ppo_clip"), (5, "ppo_clip"), (4, "test_with_head")])
def test_resume_matches_uninterrupted_run(tiny_model_dir, write_jsonl, tmp_path, prompts_per_step, loss):
    data = write_jsonl([{"prompt": f"Q{i}: say seven", "answer": "7" if i % 2 else "3"} for i in range(16)])
    common = {"trainer.steps": 6, "rollout.prompts_per_step": prompts_per_step, "algorithm.loss": loss}
    full = train(run_cfg(tiny_model_dir, data, tmp_path, **common, **{"trainer.save_every": 3,
                                                                      "trainer.run_name": "full"}))
    half = list_checkpoints(Path(full.run_dir) / "checkpoints")[0]
    assert half.name == "step-000003"
    assert load_state(half)["sampler"]["epoch"] == (0 if prompts_per_step == 4 else 1)

    resumed = train(run_cfg(tiny_model_dir, data, tmp_path, **common, **{"trainer.resume": str(half),
                                                                         "trainer.run_name": "resumed"}))
    assert len(resumed.history) == 6
    assert without_timings(resumed.history) == without_timings(full.history)
    # The resumed run directory logged only steps 4..6, with the same values.
    assert metric_rows(resumed.run_dir) == metric_rows(full.run_dir)[3:]
    a, b = final_weights(full), final_weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # Sanity: the model did change over the second half (else equality would prove nothing).
    from transformers import AutoModelForCausalLM

    at_half = AutoModelForCausalLM.from_pretrained(str(half / "model")).state_dict()
    assert any(not torch.equal(a[k], at_half[k]) for k in a)
    if loss == "test_with_head":
        zs = [m["head_z"] for m in full.history]
        assert zs[3] != 0.0 and len(set(zs)) == 6  # the head learned, and step 4 used the restored value
        assert load_state(half)["modules"]["head"]["z"].item() != 0.0


def test_resume_auto_continues_own_run_and_keep_last_rotates(tiny_model_dir, write_jsonl, tmp_path, capsys):
    data = write_jsonl([{"prompt": f"Q{i}: say seven", "answer": "7"} for i in range(16)])
    # A constant LR: trainer.steps is then not part of the trajectory (under cosine it is, and warned).
    first = train(run_cfg(tiny_model_dir, data, tmp_path, **{"trainer.steps": 4, "trainer.save_every": 1,
                                                             "trainer.keep_last": 2, "trainer.lr_schedule": "constant"}))
    ckpts = list_checkpoints(Path(first.run_dir) / "checkpoints")
    assert [p.name for p in ckpts] == ["step-000003", "step-000004"]
    more = train(run_cfg(tiny_model_dir, data, tmp_path, **{"trainer.steps": 6, "trainer.save_every": 1,
                                                            "trainer.keep_last": 2, "trainer.resume": "auto",
                                                            "trainer.lr_schedule": "constant"}))
    assert len(more.history) == 6
    out = capsys.readouterr().out
    assert "continuing at step 5 of 6" in out and "differs" not in out  # only trainer.steps/resume changed
    assert [r["step"] for r in metric_rows(more.run_dir)] == [1, 2, 3, 4, 5, 6]
    assert [p.name for p in list_checkpoints(Path(more.run_dir) / "checkpoints")] == ["step-000005", "step-000006"]


def test_resume_auto_without_checkpoint_starts_fresh(tiny_model_dir, write_jsonl, tmp_path):
    data = write_jsonl([{"prompt": f"Q{i}: say seven", "answer": "7"} for i in range(16)])
    result = train(run_cfg(tiny_model_dir, data, tmp_path, **{"trainer.steps": 2, "trainer.resume": "auto"}))
    assert len(result.history) == 2
    # Again in the same folder, which holds a log but no checkpoint (a run stopped before its first
    # save): it starts from step 0 and its log is the new run's alone, each step once.
    again = train(run_cfg(tiny_model_dir, data, tmp_path, **{"trainer.steps": 3, "trainer.resume": "auto"}))
    assert len(again.history) == 3
    assert [r["step"] for r in metric_rows(again.run_dir) if "reward/mean" in r] == [1, 2, 3]


def test_a_named_run_directory_holding_a_run_is_refused_without_resume(tiny_model_dir, write_jsonl, tmp_path,
                                                                      monkeypatch):
    data = write_jsonl([{"prompt": f"Q{i}: say seven", "answer": "7"} for i in range(16)])
    first = train(run_cfg(tiny_model_dir, data, tmp_path, **{"trainer.steps": 1}))
    log = (Path(first.run_dir) / "metrics.jsonl").read_text()
    import anabranch.trainer.components as components

    def no_model_load(*args, **kwargs):
        raise AssertionError("the check must come before the model loads")

    monkeypatch.setattr(components, "load_model", no_model_load)
    with pytest.raises(ConfigError, match=r"trainer.run_name='tiny'.*already holds a run.*trainer.resume=auto"):
        train(run_cfg(tiny_model_dir, data, tmp_path, **{"trainer.steps": 1}))
    assert (Path(first.run_dir) / "metrics.jsonl").read_text() == log  # untouched


def test_resume_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="trainer.run_name"):
        load_config(None, ["trainer.resume=auto"])
    from anabranch.trainer.preflight import check_paths

    with pytest.raises(ConfigError, match="trainer.resume"):
        check_paths(load_config(None, [f"trainer.resume={tmp_path / 'nope'}"]))


def test_resume_with_another_model_is_a_clear_error(tiny_model_dir, write_jsonl, tmp_path):
    from anabranch.models.tiny import build_tiny_model

    data = write_jsonl([{"prompt": f"Q{i}: say seven", "answer": "7"} for i in range(16)])
    first = train(run_cfg(tiny_model_dir, data, tmp_path, **{"trainer.steps": 1, "trainer.save_every": 1}))
    other = build_tiny_model(tmp_path / "wider", hidden=32)
    ckpt = list_checkpoints(Path(first.run_dir) / "checkpoints")[0]
    with pytest.raises(ConfigError, match=r"does not fit this run's model\.path.*config\.yaml"):
        train(run_cfg(str(other), data, tmp_path, **{"trainer.steps": 2, "trainer.resume": str(ckpt),
                                                     "trainer.run_name": "other"}))


def test_changed_config_keys_are_named():
    from anabranch.trainer.resume import changed_keys

    a = load_config(None, ["trainer.steps=4"]).to_dict()
    b = load_config(None, ["trainer.steps=8", "trainer.lr=1e-3", "rollout.n=8", "task.params={x: 1}"]).to_dict()
    assert changed_keys(a, b) == ["rollout.n", "task.params", "trainer.lr"]


def test_resume_in_the_same_run_shows_each_step_once_in_tensorboard(tiny_model_dir, write_jsonl, tmp_path):
    """A run that went on past its last checkpoint (steps 3-4 after the step-2 checkpoint) and is
    resumed there: metrics.jsonl is cut, and TensorBoard hides the stale steps 3-4 (purge_step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data = write_jsonl([{"prompt": f"Q{i}: say seven", "answer": "7"} for i in range(16)])
    common = {"trainer.tensorboard": True, "trainer.run_name": "same", "trainer.save_every": 2}
    first = train(run_cfg(tiny_model_dir, data, tmp_path, **common, **{"trainer.steps": 4, "trainer.lr": 3e-2}))
    step2 = list_checkpoints(Path(first.run_dir) / "checkpoints")[0]
    assert step2.name == "step-000002"
    # Resume from step 2 at another temperature, so the new steps 3-4 differ from the stale ones.
    resumed = train(run_cfg(tiny_model_dir, data, tmp_path, **common, **{
        "trainer.steps": 4, "trainer.lr": 3e-2, "rollout.temperature": 0.5, "trainer.resume": str(step2)}))
    acc = EventAccumulator(str(Path(resumed.run_dir) / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("entropy")  # entropy at another temperature tells stale steps from new ones
    assert [e.step for e in events] == [1, 2, 3, 4]
    expected = [m["entropy"] for m in first.history[:2]] + [m["entropy"] for m in resumed.history[2:]]
    assert [e.value for e in events] == pytest.approx(expected, rel=1e-6)
    assert [m["entropy"] for m in first.history[2:]] != pytest.approx([m["entropy"] for m in resumed.history[2:]])
