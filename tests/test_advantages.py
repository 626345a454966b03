"""Advantage estimators, GAE and the critic loss, the exploration controls and the KL controller
against hand-computed values on small tensors."""

import math
from functools import partial

import pytest
import torch

from anabranch.algorithms.advantages import (discounted_returns, psr_nsr_advantage, reinforce_pp_advantage,
                                             reinforce_pp_baseline_advantage, rloo_advantage, token_level_rewards)
from anabranch.algorithms.aggregation import aggregate
from anabranch.algorithms.exploration import entropy_shaped_advantage, forking_token_mask, shape_advantages
from anabranch.algorithms.kl_control import KLController
from anabranch.algorithms.ppo_value import ValueHead, gae, gae_advantage, value_loss
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.config import AlgorithmConfig, ConfigError
from anabranch.trainer.step import LossContext

CFG = AlgorithmConfig()


def test_rloo_leave_one_out():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0])
    groups = torch.tensor([0, 0, 0, 0, 1])  # the second group has one sample: no baseline, no signal
    adv = rloo_advantage(rewards, groups, torch.ones(5, 2), CFG)
    # r_i − mean of the other three: 1 − 1/3, 0 − 2/3
    assert torch.allclose(adv[:, 0], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0]))
    assert torch.equal(adv[:, 0], adv[:, 1])


def test_token_rewards_and_discounted_returns():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    tr = token_level_rewards(torch.tensor([1.0, 2.0]), mask)
    assert tr.tolist() == [[0, 0, 1], [0, 2, 0]]
    tr = tr - 0.1 * mask  # a per-token KL penalty of 0.1
    ret = discounted_returns(tr, mask, gamma=0.5)
    # row 0: G2 = .9, G1 = −.1 + .45, G0 = −.1 + .5·.35 ; row 1: G1 = 1.9, G0 = −.1 + .95
    assert torch.allclose(ret, torch.tensor([[0.075, 0.35, 0.9], [0.85, 1.9, 0.0]]))


def test_reinforce_pp_batch_normalizes_returns():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    adv = reinforce_pp_advantage(torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), mask, CFG)
    # returns 1,1,1 | 0,0: mean .6, unbiased var (3·.16 + 2·.36)/4 = .3
    sd = math.sqrt(0.3)
    expected = torch.tensor([[0.4 / sd] * 3, [-0.6 / sd, -0.6 / sd, 0.0]])
    assert torch.allclose(adv, expected, atol=1e-5)


def test_reinforce_pp_with_group_baseline():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    adv = reinforce_pp_baseline_advantage(rewards, torch.tensor([0, 0, 1, 1]), torch.ones(4, 1), CFG)
    # centred by group: .5, −.5, 0, 0; batch std sqrt(.5/3)
    assert torch.allclose(adv[:, 0], torch.tensor([0.5, -0.5, 0, 0]) / math.sqrt(0.5 / 3), atol=1e-5)


def test_psr_nsr_weights():
    cfg = AlgorithmConfig(psr_weight=0.1, nsr_weight=1.0)
    adv = psr_nsr_advantage(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.ones(2, 1), cfg)
    assert torch.allclose(adv[:, 0], torch.tensor([0.1, -1.0]))
    nsr = resolve_algorithm(AlgorithmConfig(name="nsr")).cfg
    adv = psr_nsr_advantage(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.ones(2, 1), nsr)
    assert adv[:, 0].tolist() == [0.0, -1.0]


def test_gae_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 9.0]])  # 9.0 sits on padding: ignored
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # row 0: δ = (.1, .1, .3) -> A2 = .3, A1 = .1 + .5·.3, A0 = .1 + .5·.25
    # row 1: δ1 = 1 − .4 (no value after the end), δ0 = .4 − .2 -> A = (.2 + .5·.6, .6)
    assert torch.allclose(adv, torch.tensor([[0.225, 0.25, 0.3], [0.5, 0.6, 0.0]]))
    assert torch.allclose(ret, torch.tensor([[0.725, 0.85, 1.0], [0.7, 1.0, 0.0]]))
    white, extra = gae_advantage(torch.tensor([1.0, 1.0]), None, mask, AlgorithmConfig(lam=0.5),
                                 values=values, token_rewards=rewards)
    assert torch.allclose(extra["returns"], ret)
    assert abs((white * mask).sum().item()) < 1e-5  # whitened over the batch


def test_value_loss_clips_the_value_update():
    head = ValueHead(1)
    with torch.no_grad():
        head.proj.weight.fill_(1.0)  # V = h
    hidden = torch.tensor([[[1.0], [0.0], [7.0]]], requires_grad=True)  # prompt of 1, response of 2
    cfg = AlgorithmConfig(vf_clip=0.2, vf_coef=0.5)
    ctx = LossContext(cfg=cfg, aggregate=partial(aggregate, mode="token-mean"), hidden=hidden,
                      modules={"value": head},
                      extras={"values": torch.tensor([[0.0, 0.0]]), "returns": torch.tensor([[1.0, 1.0]])})
    loss, m = value_loss(ctx, torch.ones(1, 2))
    # token 0: V=1 moved past the clip: max(0, (0.2 − 1)²) = .64; token 1: V=0: (0 − 1)² = 1
    assert loss.item() == pytest.approx(0.5 * (0.5 * 0.64 + 0.5 * 1.0) / 2)
    assert m["critic/vf_clip_frac"] == pytest.approx(0.5)
    loss.backward()
    # clipped token: no gradient; token 1: vf_coef · (V − R) / 2 tokens
    assert hidden.grad[0, 0, 0].item() == 0.0
    assert hidden.grad[0, 1, 0].item() == pytest.approx(0.5 * -1.0 / 2)
    assert hidden.grad[0, 2, 0].item() == 0.0  # the last position predicts nothing


def test_gae_recipe_declares_value_head_and_critic():
    algo = resolve_algorithm(AlgorithmConfig(name="ppo"))
    assert algo.cfg.advantage == "gae" and "value" in algo.module_factories
    assert {"values", "hidden", "old_log_prob", "ref_log_prob"} <= algo.needs
    assert value_loss in algo.aux_losses


def test_entropy_shaped_advantage():
    adv = torch.tensor([[1.0, -1.0, 0.0, 0.1]])
    ent = torch.tensor([[0.5, 2.0, 1.0, 1.0]], requires_grad=True)
    out = entropy_shaped_advantage(adv, ent, alpha=0.4, kappa=2.0)
    # + min(.4·H, |A|/2) = .2, .5, 0, .05
    assert torch.allclose(out, torch.tensor([[1.2, -0.5, 0.0, 0.15]]))
    assert not out.requires_grad  # the entropy term is detached


def test_forking_token_mask_keeps_top_entropy_tokens():
    ent = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.float32)
    keep = forking_token_mask(ent, mask, rho=0.5)  # median of 1..7 is 4
    assert keep.tolist() == [[0, 0, 0, 1], [1, 1, 1, 0]]
    adv, m = shape_advantages(torch.ones(2, 4) * mask, ent, mask, AlgorithmConfig(entropy_top_rho=0.5))
    assert torch.equal(adv, keep) and m["forking/kept_frac"] == pytest.approx(4 / 7)
    same, _ = shape_advantages(mask, ent, mask, AlgorithmConfig())  # both controls off by default
    assert torch.equal(same, mask)


def test_adaptive_kl_controller():
    ctl = KLController(0.1, target=1.0, horizon=100)
    ctl.update(current_kl=2.0, n_steps=10)  # error clipped to +.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    ctl.update(current_kl=0.9, n_steps=10)  # error −.1
    assert ctl.value == pytest.approx(0.1 * 1.02 * (1 - 0.1 * 10 / 100))
    fixed = KLController(0.1)
    fixed.update(5.0, 10)
    assert fixed.value == 0.1


@pytest.mark.parametrize("key,value", [("kl_in", "both"), ("entropy_top_rho", 0.0), ("clip_ratio_c", 0.5),
                                       ("kl_target", -1.0)])
def test_bad_algorithm_values_name_the_key(key, value):
    with pytest.raises(ConfigError, match=f"algorithm.{key}"):
        resolve_algorithm(AlgorithmConfig(**{key: value}))
