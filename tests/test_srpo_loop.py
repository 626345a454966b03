"""SRPO in the training loop (trainer/loop.py): the routed advantages and the distillation inputs reach
``policy_update``, and the whole-config refusal runs before any model loads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from anabranch.config import ConfigError, load_config

from test_train_e2e import digit_task, tiny_overrides


def test_loop_routes_distilled_rows_out_of_the_grpo_term(tiny_model_dir, write_jsonl, tmp_path, monkeypatch):
    from anabranch.trainer import loop

    seen, real_adv, real_update = [], loop.compute_advantages, loop.policy_update

    def spy_adv(*args, **kwargs):
        out = real_adv(*args, **kwargs)
        seen.append({"before": out.advantages.clone()})
        return out

    def spy_update(model, optimizer, rollout, advantages, *args, **kwargs):
        seen[-1].update(after=advantages.clone(), pre=dict(kwargs["precomputed"]), mask=rollout.trained_mask)
        return real_update(model, optimizer, rollout, advantages, *args, **kwargs)

    monkeypatch.setattr(loop, "compute_advantages", spy_adv)
    monkeypatch.setattr(loop, "policy_update", spy_update)
    # math_verify decides correct/failed (the random model fails nearly all); the random reward gives the
    # failed rows non-zero GRPO advantages, so routing them out is visible.
    loop.train(load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path, **{
        "algorithm.name": "srpo", "trainer.steps": 2, "rollout.n": 4, "rollout.prompts_per_step": 2,
        "reward.functions": "[math_verify, random]", "trainer.eval_before": False, "trainer.eval_after": False,
        "trainer.save_final": False, "trainer.tensorboard": False, "trainer.log_samples": 0})))
    assert len(seen) == 2
    moved = 0
    for s in seen:
        pre = s["pre"]
        assert {"srpo_teacher_log_prob", "srpo_weight"} <= set(pre)
        distilled = pre["srpo_weight"].abs().sum(-1) > 0
        assert distilled.any()
        assert s["after"][distilled].abs().sum() == 0  # the distilled rows left the GRPO term
        assert torch.equal(s["after"][~distilled], s["before"][~distilled])  # the others keep theirs
        moved += int((s["before"][distilled] * s["mask"][distilled]).abs().sum() > 0)
    assert moved > 0  # their GRPO advantages were not 0 to start with: the routing did zero them


def test_train_refuses_retry_turns_before_loading_a_model(tmp_path):
    from anabranch.trainer.loop import train

    cfg = load_config(None, ["algorithm.name=srpo", f"model.path={tmp_path / 'missing'}"])
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, retry_turns=3))
    with pytest.raises(ConfigError, match="rollout.retry_turns does not combine with algorithm.srpo_coef > 0"):
        train(cfg)
