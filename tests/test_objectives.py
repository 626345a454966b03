"""Dual-clip PPO, GSPO, CISPO, Clip-Cov, KL-Cov and the shared diagnostics against hand-computed
values on small tensors."""

import math
from functools import partial

import pytest
import torch

from anabranch.algorithms.aggregation import aggregate
from anabranch.algorithms.cov_control import clip_cov_loss, kl_cov_loss, token_covariance
from anabranch.algorithms.diagnostics import finish_diagnostics, update_diagnostics
from anabranch.algorithms.grpo import ppo_clip_loss
from anabranch.algorithms.objectives import cispo_loss, gspo_loss
from anabranch.config import AlgorithmConfig
from anabranch.trainer.step import LossContext


def ctx(mode="token-mean", **cfg):
    return LossContext(cfg=AlgorithmConfig(**cfg), aggregate=partial(aggregate, mode=mode))


def test_dual_clip_caps_negative_advantage_loss():
    ratios = torch.tensor([[5.0, 2.0, 5.0]])
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    logp = torch.log(ratios).requires_grad_()
    loss, m = ppo_clip_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), ctx(clip_ratio_c=3.0))
    # A<0, ρ=5: min(max(5, 1.2), 3) = 3 (capped); A<0, ρ=2: max(2, 1.2) = 2; A>0, ρ=5: −1.2 (clipped)
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3)
    assert m["clip_frac"] == pytest.approx(2 / 3)
    loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 2] == 0
    assert logp.grad[0, 1].item() == pytest.approx(1.0 * 2.0 / 3)
    plain, _ = ppo_clip_loss(logp.detach(), torch.zeros(1, 3), adv, torch.ones(1, 3), ctx())
    assert plain.item() == pytest.approx((5.0 + 2.0 - 1.2) / 3)  # without dual-clip


def test_gspo_sequence_ratio():
    logp = torch.log(torch.tensor([[0.5, 0.25], [0.5, 0.25]])).requires_grad_()
    old = torch.log(torch.tensor([[0.25, 0.25], [0.25, 0.25]]))
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss, m = gspo_loss(logp, old, adv, torch.ones(2, 2), ctx("seq-mean-token-mean"))
    s = math.sqrt(2.0)  # exp(mean(log 2, 0))
    # seq 0 (Â>0): clipped at 1.2 -> −1.2, no gradient; seq 1 (Â<0): max(s, 1.2) = s
    assert loss.item() == pytest.approx((-1.2 + s) / 2, rel=1e-5)
    assert m["seq_clip_frac"] == pytest.approx(0.5)
    loss.backward()
    assert torch.all(logp.grad[0] == 0)
    # d/dlog π_t of s·exp(lp_t − sg(lp_t)): s, averaged over 2 tokens and 2 sequences
    assert torch.allclose(logp.grad[1], torch.full((2,), s / 4), rtol=1e-5)


def test_gspo_on_policy_is_the_sequence_mean_policy_gradient():
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, _ = gspo_loss(logp, logp.detach(), torch.full((1, 3), 2.0), mask, ctx("seq-mean-token-mean"))
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -1.0, 0.0]]))


def test_cispo_keeps_gradient_on_clipped_tokens():
    ratios = torch.tensor([[1.5, 0.5]])
    adv = torch.tensor([[1.0, -1.0]])
    logp = torch.log(ratios).requires_grad_()
    loss, m = cispo_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2), ctx(clip_ratio_low=1.0, clip_ratio_high=0.28))
    # weights sg(clip(ρ, 0, 1.28)) = 1.28, 0.5
    assert loss.item() == pytest.approx((-1.28 * math.log(1.5) + 0.5 * math.log(0.5)) / 2)
    assert m["clip_frac"] == pytest.approx(0.5)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.28 / 2, 0.5 / 2]]))  # PPO would give 0 on token 0


LP = torch.tensor([[0.0, -2.0, -1.0]])
ADV = torch.tensor([[3.0, -1.0, -2.0]])


def test_token_covariance():
    # log π centred: 1, −1, 0; Â centred: 3, −1, −2
    assert torch.allclose(token_covariance(LP, ADV, torch.ones(1, 3)), torch.tensor([[3.0, 1.0, 0.0]]))


def test_clip_cov_detaches_high_covariance_tokens():
    logp = LP.clone().requires_grad_()
    c = ctx(cov_clip_ratio=0.5, cov_clip_low=2.0, cov_clip_high=5.0)  # only token 0 (Cov 3) is in the band
    loss, m = clip_cov_loss(logp, LP, ADV, torch.ones(1, 3), c)
    # on-policy per-token losses −Â = −3, 1, 2; token 0 dropped
    assert loss.item() == pytest.approx((1.0 + 2.0) / 3)
    assert m["cov/selected_frac"] == pytest.approx(1 / 3)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[0.0, 1 / 3, 2 / 3]]))


def test_clip_cov_never_spends_its_budget_on_tokens_the_ppo_clip_cut_off():
    # Cov 3, 1, 0: tokens 0 and 1 are in the band [0.5, 5]; token 0 has ratio e^0.5 > 1.28 with Â > 0,
    # so the PPO clip already removed its gradient. The one detach (⌊0.34·3⌋ = 1) must go to token 1.
    old = LP - torch.tensor([[0.5, 0.0, 0.0]])
    c = ctx(cov_clip_ratio=0.34, cov_clip_low=0.5, cov_clip_high=5.0, clip_ratio_high=0.28)
    for seed in range(20):  # the draw is random among the candidates
        torch.manual_seed(seed)
        logp = LP.clone().requires_grad_()
        loss, m = clip_cov_loss(logp, old, ADV, torch.ones(1, 3), c)
        # token 0 clipped: −3·1.28; token 1 detached (0); token 2 on-policy: −Â = 2
        assert loss.item() == pytest.approx((-3 * 1.28 + 0.0 + 2.0) / 3)
        assert m["cov/selected_frac"] == pytest.approx(1 / 3)
        loss.backward()
        assert torch.allclose(logp.grad, torch.tensor([[0.0, 0.0, 2 / 3]]))


def test_kl_cov_penalizes_top_covariance_tokens():
    logp = LP.clone().requires_grad_()
    old = LP - torch.tensor([[0.1, 0.0, 0.0]])
    loss, m = kl_cov_loss(logp, old, ADV, torch.ones(1, 3), ctx(cov_kl_ratio=0.34, cov_kl_coef=1.0))
    r0 = math.exp(0.1)
    # top-1 by Cov is token 0: −3·ρ0 + |0.1|; tokens 1, 2: −Â (ρ = 1)
    assert loss.item() == pytest.approx((-3 * r0 + 0.1 + 1.0 + 2.0) / 3, rel=1e-5)
    assert m["cov/selected_frac"] == pytest.approx(1 / 3)
    loss.backward()
    assert logp.grad[0, 0].item() == pytest.approx((-3 * r0 + 1.0) / 3, rel=1e-5)


def test_diagnostics_covariance_of_entropy_and_advantage():
    ent = torch.tensor([[1.0, 2.0, 3.0, 9.0]])
    adv = torch.tensor([[1.0, 0.0, -1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    logp = torch.tensor([[-1.0, -1.0, -1.0, 0.0]])
    out = finish_diagnostics(update_diagnostics(logp, logp - 0.5, adv, ent, mask))
    assert out["entropy"] == pytest.approx(2.0)
    assert out["approx_kl"] == pytest.approx(-0.5)
    # E[HA] − E[H]E[A] = (1 − 3)/3 − 2·0
    assert out["cov/entropy_adv"] == pytest.approx(-2 / 3)
    assert out["cov/logp_adv"] == pytest.approx(0.0)
    assert not any(k.startswith("_") for k in out)
