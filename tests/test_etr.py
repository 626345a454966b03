"""ETR (Zhang et al. 2026, "ETR: Outcome-Guided Elastic Trust Regions", arXiv 2601.03723): the group
variance and the per-sample clip bounds by hand, the loss and its gradient where GRPO's fixed region
would clip but ETR's wider one does not, the config refusals, and short runs on the tiny model."""

import dataclasses
import math
from functools import partial

import pytest
import torch

from anabranch import load_config, train
from anabranch.algorithms import resolve_algorithm
from anabranch.algorithms.aggregation import aggregate
from anabranch.algorithms.etr import elastic_scale, etr_loss, group_variance
from anabranch.algorithms.grpo import ppo_clip_loss
from anabranch.config import AlgorithmConfig, ConfigError
from anabranch.trainer.step import LossContext
from test_pacs import DENSE
from test_train_e2e import digit_task, tiny_overrides

# One group of four, one success: p = 1/4, population variance p(1−p) = 3/16, v = 4σ² = 3/4.
# GRPO's advantages (unbiased std 0.5): [1.5, −0.5, −0.5, −0.5].
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0])
GROUPS = torch.tensor([3, 3, 3, 3])
ADV = torch.tensor([[1.5], [-0.5], [-0.5], [-0.5]])


def cfg(**kw):
    base = dict(advantage="grpo", loss="etr", ppo_epochs=2, clip_ratio_low=0.2, clip_ratio_high=0.2)
    return dataclasses.replace(AlgorithmConfig(), **{**base, **kw})


def ctx(c, rewards=REWARDS, groups=GROUPS):
    return LossContext(cfg=c, aggregate=partial(aggregate, mode="token-mean"), rewards=rewards, group_index=groups)


def test_group_variance_is_the_population_variance_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.5])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    # Group 0: 3/16; group 1 (p = 1/2): 1/4; a group of one: 0.
    expected = torch.tensor([3 / 16] * 4 + [0.25, 0.25, 0.0])
    assert torch.allclose(group_variance(rewards, groups), expected)


def test_clip_bounds_per_sample_by_hand():
    # α = 0.5, β = 1: s = (1 + 0.5·|Â|)·(1 + 1·3/4); the success: 1.75·1.75 = 3.0625, the failures 1.25·1.75.
    scale = elastic_scale(ADV, group_variance(REWARDS, GROUPS), alpha=0.5, beta=1.0)
    assert torch.allclose(scale[:, 0], torch.tensor([3.0625, 2.1875, 2.1875, 2.1875]))
    # ε = 0.2: the success may rise to ρ = 1 + 0.6125, a failure fall to ρ = 1 − 0.4375.
    assert (0.2 * scale[0, 0]).item() == pytest.approx(0.6125)
    # A group at p = 1/2 (v = 1) gets a wider region than one at p = 1/4 (v = 3/4), same |Â|.
    half = elastic_scale(torch.ones(2, 1), torch.tensor([0.25, 3 / 16]), alpha=0.0, beta=1.0)
    assert half[0, 0] == pytest.approx(2.0) and half[1, 0] == pytest.approx(1.75)
    assert torch.equal(elastic_scale(ADV, None, alpha=0.0, beta=0.0), torch.ones_like(ADV))


def test_loss_and_gradient_by_hand_where_grpo_would_clip():
    # ratios ρ = [2.0, 0.5, 0.6, 1.0]; bounds: success [., 1.6125], failures [0.5625, .].
    old = torch.zeros(4, 1)
    logp = torch.log(torch.tensor([[2.0], [0.5], [0.6], [1.0]])).requires_grad_(True)
    loss, metrics = etr_loss(logp, old, ADV, torch.ones(4, 1), ctx(cfg(etr_adv_coef=0.5, etr_var_coef=1.0)))
    # Row 0: −1.5·1.6125 (clipped); row 1: −(−0.5)·0.5625 (clipped); row 2: 0.5·0.6; row 3: 0.5·1.
    expected = (-1.5 * 1.6125 + 0.5 * 0.5625 + 0.5 * 0.6 + 0.5 * 1.0) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    # ∂L/∂log π = −Â·ρ/N where the ratio is inside the region, 0 where it was clipped.
    assert torch.allclose(logp.grad[:, 0], torch.tensor([0.0, 0.0, 0.5 * 0.6 / 4, 0.5 / 4]), atol=1e-7)
    assert metrics["clip_frac"] == pytest.approx(0.5)
    assert metrics["etr/scale_mean"] == pytest.approx((3.0625 + 3 * 2.1875) / 4)
    assert metrics["etr/group_var_mean"] == pytest.approx(3 / 16)

    # GRPO's fixed [0.8, 1.2] clips row 2 (ρ = 0.6) too: its gradient is gone there.
    logp2 = logp.detach().clone().requires_grad_(True)
    grpo, _ = ppo_clip_loss(logp2, old, ADV, torch.ones(4, 1), ctx(cfg(loss="ppo_clip")))
    grpo.backward()
    assert logp2.grad[2, 0] == 0.0 and logp.grad[2, 0] > 0


def test_zero_coefficients_give_ppo_clip_and_the_floor_stays_at_zero():
    torch.manual_seed(0)
    logp, old = torch.randn(4, 3) * 0.5, torch.randn(4, 3) * 0.5
    adv, mask = ADV.expand(4, 3), torch.ones(4, 3)
    c = cfg(etr_adv_coef=0.0, etr_var_coef=0.0, clip_ratio_low=0.2, clip_ratio_high=0.28)
    a, _ = etr_loss(logp, old, adv, mask, ctx(c))
    b, _ = ppo_clip_loss(logp, old, adv, mask, ctx(c))
    assert a.item() == pytest.approx(b.item(), rel=1e-6)
    # A huge scale: ε_low·s is capped at 1, so a ratio near 0 on a bad token is left unclipped (floor 0).
    logp0 = torch.full((4, 1), -5.0, requires_grad=True)
    loss, _ = etr_loss(logp0, torch.zeros(4, 1), ADV, torch.ones(4, 1), ctx(cfg(etr_adv_coef=100.0, clip_ratio_low=0.9)))
    loss.backward()
    assert torch.all(logp0.grad[1:, 0] > 0)


def test_needs_whole_groups_only_with_the_variance_term():
    assert "whole_groups" in resolve_algorithm(AlgorithmConfig(name="etr")).needs
    algo = resolve_algorithm(AlgorithmConfig(name="etr", etr_var_coef=0.0))
    assert "whole_groups" not in algo.needs and "ref_log_prob" not in algo.needs
    assert algo.cfg.ppo_epochs == 2 and algo.cfg.loss == "etr"
    assert not algo.inert_at_zero_advantage  # a row with Â = 0 still counts in its group's variance
    with pytest.raises(RuntimeError, match="reward"):
        etr_loss(torch.zeros(4, 1), torch.zeros(4, 1), ADV, torch.ones(4, 1), ctx(cfg(), rewards=None))


@pytest.mark.parametrize("kw, match", [
    ({"etr_adv_coef": -0.1}, "etr_adv_coef must be a finite number >= 0"),
    ({"etr_var_coef": math.nan}, "etr_var_coef must be a finite number >= 0"),
    ({"etr_adv_coef": math.inf}, "etr_adv_coef must be a finite number >= 0"),
    ({"ppo_epochs": 1}, "ppo_epochs=1"),
    ({"clip_ratio_c": 3.0}, "clip_ratio_c"),
    # One refusal, config_checks._GATED's (resolve.check_algorithm runs it for an AlgorithmConfig on its own).
    ({"loss": "ppo_clip", "etr_var_coef": 1.0}, r"'algorithm\.etr_var_coef' has no effect unless algorithm\.loss=etr"),
])
def test_bad_settings_are_refused_at_resolution(kw, match):
    with pytest.raises(ConfigError, match=match):
        resolve_algorithm(cfg(**kw))


def test_etr_keys_without_etr_are_refused_when_the_config_loads(tiny_model_dir, write_jsonl, tmp_path):
    args = tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path, **{"algorithm.etr_adv_coef": 0.4})
    with pytest.raises(ConfigError, match=r"algorithm\.etr_adv_coef.*algorithm\.loss=etr"):
        load_config(None, args)
    # An explicit ppo_epochs=1 with the etr recipe is refused, not overridden.
    args = tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path,
                          **{"algorithm.name": "etr", "algorithm.ppo_epochs": 1})
    with pytest.raises(ConfigError, match="ppo_epochs"):
        resolve_algorithm(load_config(None, args).algorithm)


def etr_run(tiny_model_dir, write_jsonl, tmp_path, **extra):
    overrides = {"algorithm.name": "etr", "trainer.steps": 2, "trainer.eval_before": False,
                 "trainer.eval_after": False, "rollout.n": 4, "trainer.micro_batch_size": 6, **extra}
    return train(load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path, **overrides)))


def test_short_run_logs_etr_metrics(tiny_model_dir, write_jsonl, tmp_path):
    result = etr_run(tiny_model_dir, write_jsonl, tmp_path, **DENSE)  # a 0/1 reward right about half the time
    for key in ("loss", "clip_frac", "etr/scale_mean", "etr/eps_high_max", "etr/group_var_mean", "grad_norm"):
        assert all(math.isfinite(m[key]) for m in result.history), key
    assert all(m["skipped_updates"] == 0 for m in result.history)
    # Mixed groups: a non-zero variance and |Â| widen every region beyond GRPO's (s > 1).
    assert all(m["etr/scale_mean"] > 1.0 and m["etr/group_var_mean"] > 0 for m in result.history)
    assert all(m["etr/eps_high_max"] > 0.2 for m in result.history)


@pytest.mark.slow
def test_etr_reward_rises_on_tiny_model(tiny_model_dir, write_jsonl, tmp_path):
    result = etr_run(tiny_model_dir, write_jsonl, tmp_path, **{"trainer.steps": 12, "rollout.n": 8,
                                                               "trainer.micro_batch_size": 32, **DENSE})
    rewards = [m["reward/mean"] for m in result.history]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.15, rewards
