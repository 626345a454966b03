"""GRPO's advantage, the PPO clipped objective and loss aggregation against hand-computed values."""

import math
from functools import partial

import pytest
import torch

from anabranch.algorithms.aggregation import BatchScale, aggregate
from anabranch.algorithms.grpo import grpo_advantage, ppo_clip_loss
from anabranch.algorithms.kl import kl_penalty
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.config import AlgorithmConfig, ConfigError
from anabranch.trainer.step import LossContext


def test_grpo_advantage_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    mask = torch.tensor([[1, 1, 0]] * 6, dtype=torch.float32)
    adv = grpo_advantage(rewards, groups, mask, AlgorithmConfig(adv_epsilon=0.0 + 1e-6))
    # group 0: mean 1/3, unbiased std sqrt(((2/3)^2 + 2*(1/3)^2)/2) = sqrt(1/3)
    std = math.sqrt(1 / 3)
    expected0 = torch.tensor([2 / 3, -1 / 3, -1 / 3]) / (std + 1e-6)
    assert torch.allclose(adv[:3, 0], expected0, atol=1e-5)
    assert torch.all(adv[:, 2] == 0)  # padding gets no advantage
    assert torch.all(adv[3:] == 0)  # all-equal group: no signal


def test_dr_grpo_advantage_drops_std():
    rewards = torch.tensor([3.0, 1.0])
    adv = grpo_advantage(rewards, torch.tensor([0, 0]), torch.ones(2, 1), AlgorithmConfig(norm_adv_by_std=False))
    assert adv[:, 0].tolist() == [1.0, -1.0]


def ctx(cfg, mode="token-mean", scale=None):
    return LossContext(cfg=cfg, aggregate=partial(aggregate, mode=mode, scale=scale))


def test_ppo_clip_hand_computed():
    cfg = AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.28)
    old = torch.zeros(1, 4)
    ratios = torch.tensor([[1.5, 0.5, 1.1, 0.7]])
    adv = torch.tensor([[1.0, 1.0, -2.0, -1.0]])
    logp = torch.log(ratios).requires_grad_()
    loss, m = ppo_clip_loss(logp, old, adv, torch.ones(1, 4), ctx(cfg))
    # token 0: A>0, ratio 1.5 -> clipped at 1.28: -1.28; token 1: A>0 ratio .5: min(.5, .8)= .5 -> -0.5
    # token 2: A<0 ratio 1.1 (inside) -> 2.2; token 3: A<0 ratio .7 -> max(0.7, 0.8)*1 -> 0.8
    expected = (-1.28 - 0.5 + 2.2 + 0.8) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(2 / 4)
    loss.backward()
    # Clipped tokens carry no gradient; unclipped ones get -A*ratio/4 wrt log-prob.
    assert logp.grad[0, 0] == 0 and logp.grad[0, 3] == 0
    assert logp.grad[0, 1].item() == pytest.approx(-1.0 * 0.5 / 4)
    assert logp.grad[0, 2].item() == pytest.approx(2.0 * 1.1 / 4)


def test_on_policy_ppo_gradient_is_policy_gradient():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    adv = torch.tensor([[0.5, 0.5]])
    loss, _ = ppo_clip_loss(logp, logp.detach(), adv, torch.ones(1, 2), ctx(AlgorithmConfig()))
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.25, -0.25]]))


LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float32)


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", (1 + 2 + 3 + 4 + 5 + 6) / 6),
    ("seq-mean-token-sum", ((1 + 2 + 3 + 4) + (5 + 6)) / 2),
    ("seq-mean-token-mean", ((1 + 2 + 3 + 4) / 4 + (5 + 6) / 2) / 2),
    ("seq-mean-token-sum-norm", (1 + 2 + 3 + 4 + 5 + 6) / (2 * 4)),
])
def test_aggregation_modes(mode, expected):
    assert aggregate(LOSS, MASK, mode).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_micro_batches_add_up_to_the_full_batch(mode):
    torch.manual_seed(0)
    w = torch.randn(6, requires_grad=True)
    x = torch.randn(4, 5, 6)  # [batch, tokens, features]
    mask = (torch.rand(4, 5) > 0.3).float()
    mask[:, 0] = 1

    def per_token(xb):
        return (xb * w).sum(-1) ** 2

    full = aggregate(per_token(x), mask, mode, BatchScale(max_response_len=5))
    g_full, = torch.autograd.grad(full, w)
    scale = BatchScale(total_tokens=mask.sum().item(), total_seqs=4.0, max_response_len=5)
    total = 0.0
    for sl in (slice(0, 1), slice(1, 3), slice(3, 4)):  # uneven micro-batches
        part = aggregate(per_token(x[sl]), mask[sl], mode, scale)
        part.backward()
        total += part.item()
    assert total == pytest.approx(full.item(), rel=1e-5)
    assert torch.allclose(w.grad, g_full, atol=1e-5)


def test_kl_estimators_hand_computed():
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])  # log ratio = log 2
    r = math.log(2)
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(r)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * r * r)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + r)
    assert kl_penalty(logp, logp, "k3").item() == 0.0


def test_recipe_resolution_and_needs():
    algo = resolve_algorithm(AlgorithmConfig())
    assert algo.cfg.advantage == "grpo" and algo.cfg.loss == "ppo_clip"
    assert algo.needs == frozenset()  # no reference, no old-log-prob pass
    algo = resolve_algorithm(AlgorithmConfig(kl_coef=0.05, ppo_epochs=2))
    assert algo.needs == {"ref_log_prob", "old_log_prob"}
    with pytest.raises(ConfigError, match="algorithm.name"):
        resolve_algorithm(AlgorithmConfig(name="grop"))
    with pytest.raises(ConfigError, match="loss_agg_mode"):
        resolve_algorithm(AlgorithmConfig(loss_agg_mode="mean"))
