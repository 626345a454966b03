"""f-DPG (Go et al. 2023): pseudo-rewards against hand computations, reverse KL = KL-regularized
policy gradient, finiteness at extreme sequence log-probs, config refusals, distribution matching on
the enumerable toy problem, and a short run of the `fdpg` recipe on the tiny model."""

import math
from functools import partial

import pytest
import torch

from anabranch.algorithms.aggregation import BatchScale, aggregate
from anabranch.algorithms.fdpg import fdpg_loss
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.config import AlgorithmConfig, ConfigError, FDPGConfig, load_config
from anabranch.eval.toy_matching import target_distribution, train_tabular
from anabranch.trainer.step import LossContext

# Five sequences, two prompts (3 + 2 samples), lengths 2, 1, 2, 2, 1 (padding gets no gradient).
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
LOG_PROB = torch.tensor([[-1.0, -2.0], [-0.5, 0.0], [-0.2, -0.3], [-1.5, -0.5], [-2.5, 0.0]])
REF = torch.tensor([[-1.5, -1.0], [-1.0, 0.0], [-0.4, -0.4], [-1.0, -1.0], [-2.0, 0.0]])
R_HAT = [0.8, -0.3, -0.5, 1.0, -1.0]
GROUPS = torch.tensor([0, 0, 0, 1, 1])
BETA = 2.0


def run(fdpg: FDPGConfig, log_prob=LOG_PROB, old=None, ref=REF, r_hat=R_HAT, groups=GROUPS, mask=MASK):
    cfg = resolve_algorithm(AlgorithmConfig(name="fdpg", fdpg=fdpg)).cfg
    lp = log_prob.clone().requires_grad_()
    adv = torch.tensor(r_hat)[:, None] * mask  # the recipe's advantage: r̂ on every response token
    ctx = LossContext(cfg=cfg, aggregate=partial(aggregate, mode="token-mean", scale=BatchScale()),
                      ref_log_prob=ref, group_index=groups, rewards=torch.zeros(len(groups)))
    loss, metrics = fdpg_loss(lp, log_prob if old is None else old, adv, mask, ctx)
    loss.backward()
    return loss, metrics, lp.grad


def hand_pseudo_rewards(divergence, log_pi, log_q, log_ref, r_hat, groups, beta=BETA):
    """R_i = −f′(t_i), t_i = π_θ(y_i)·Ẑ/a(y_i), Ẑ = mean over the group of a/q, in plain floats."""
    rewards = []
    for i in range(len(log_pi)):
        members = [j for j in range(len(log_pi)) if groups[j] == groups[i]]
        z = sum(math.exp(log_ref[j] + beta * r_hat[j] - log_q[j]) for j in members) / len(members)
        t = math.exp(log_pi[i]) * z / math.exp(log_ref[i] + beta * r_hat[i])
        rewards.append({"rkl": -math.log(t) - 1, "kl": 1 / t, "js": math.log((1 + t) / (2 * t)),
                        "tv": -0.5 * (1 if t > 1 else -1)}[divergence])
    return rewards


def seq(x, mask=MASK):
    return (x * mask).sum(-1).tolist()


@pytest.mark.parametrize("divergence", ["rkl", "kl", "js", "tv"])
def test_pseudo_rewards_and_gradient_hand_computed(divergence):
    # Off-policy (a second epoch): q = π_old differs from π_θ, so Ẑ uses q and w = π_θ/q ≠ 1.
    old = LOG_PROB + torch.tensor([[0.1, 0.2], [-0.3, 0.0], [0.05, 0.0], [0.0, -0.2], [0.4, 0.0]])
    loss, metrics, grad = run(FDPGConfig(divergence=divergence, beta=BETA, is_max=0.0), old=old)
    log_pi, log_q, log_ref = seq(LOG_PROB), seq(old), seq(REF)
    r = hand_pseudo_rewards(divergence, log_pi, log_q, log_ref, R_HAT, GROUPS.tolist())
    if divergence == "tv":
        assert sorted(set(r)) == [-0.5, 0.5]  # both signs occur: the test covers sign(t − 1)
    w = [math.exp(a - b) for a, b in zip(log_pi, log_q)]
    # Baseline: E_{π_θ}[R] of each prompt, self-normalized over q's samples.
    wr = [wi * ri for wi, ri in zip(w, r)]
    base = [sum(wr[:3]) / sum(w[:3])] * 3 + [sum(wr[3:]) / sum(w[3:])] * 2
    # L = −(1/B) Σ w·(R − b)·log π_θ(y): every response token of sequence i gets −w_i·A_i/B.
    expected_loss = -sum(wi * (ri - bi) * li for wi, ri, bi, li in zip(w, r, base, log_pi)) / 5
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5, abs=1e-6)
    for i in range(5):
        for t in range(2):
            want = -w[i] * (r[i] - base[i]) / 5 if MASK[i, t] else 0.0
            assert grad[i, t].item() == pytest.approx(want, rel=1e-5, abs=1e-7), (i, t)
    assert metrics["fdpg/pseudo_reward_mean"] == pytest.approx(sum(wr) / sum(w), rel=1e-5, abs=1e-7)
    assert metrics["fdpg/is_weight_mean"] == pytest.approx(sum(w) / 5, rel=1e-5)


def test_baseline_none_and_importance_cap():
    old = LOG_PROB - torch.tensor([[1.5, 1.5], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])  # w_0 = e^3
    _, metrics, grad = run(FDPGConfig(divergence="kl", beta=BETA, baseline="none", is_max=2.0), old=old)
    r = hand_pseudo_rewards("kl", seq(LOG_PROB), seq(old), seq(REF), R_HAT, GROUPS.tolist())
    assert grad[0, 0].item() == pytest.approx(-2.0 * r[0] / 5, rel=1e-5)  # w capped at is_max, no baseline
    assert grad[3, 1].item() == pytest.approx(-r[3] / 5, rel=1e-5)
    assert metrics["fdpg/is_clip_frac"] == pytest.approx(0.2)


def test_forward_kl_on_policy_is_n_softmax_minus_one():
    # On-policy with the self-normalized Ẑ: R_i = p/π_θ = n·softmax_i(log a − log π), group mean 1.
    _, _, grad = run(FDPGConfig(divergence="kl", beta=BETA))
    log_w = torch.tensor([ref + BETA * rh - lp for ref, rh, lp in zip(seq(REF), R_HAT, seq(LOG_PROB))])
    adv = torch.cat([3 * torch.softmax(log_w[:3], 0) - 1, 2 * torch.softmax(log_w[3:], 0) - 1])
    assert torch.allclose(grad[:, 0], -adv / 5, atol=1e-6)


def test_reverse_kl_equals_kl_regularized_policy_gradient():
    """∇ of f-DPG(rkl) = −∇ of E[β·r̂] − KL(π_θ||π_ref) estimated with a group-mean baseline: the
    −log Ẑ − 1 in R is a per-prompt constant that the baseline removes."""
    gen = torch.Generator().manual_seed(0)
    b, t = 8, 5
    mask = (torch.rand(b, t, generator=gen) > 0.2).float()
    mask[:, 0] = 1.0
    log_prob = -torch.rand(b, t, generator=gen) * 3
    ref = -torch.rand(b, t, generator=gen) * 3
    r_hat = torch.randn(b, generator=gen).tolist()
    groups = torch.arange(2).repeat_interleave(4)
    beta = 1.5
    _, _, grad = run(FDPGConfig(divergence="rkl", beta=beta), log_prob=log_prob, ref=ref, r_hat=r_hat,
                     groups=groups, mask=mask)
    lp = log_prob.clone().requires_grad_()
    seq_lp, seq_ref = (lp * mask).sum(-1), (ref * mask).sum(-1)
    reward = (beta * torch.tensor(r_hat) - (seq_lp - seq_ref)).detach()  # KL-regularized reward (k1)
    adv = reward - torch.cat([reward[:4].mean().repeat(4), reward[4:].mean().repeat(4)])
    objective = (adv * seq_lp).sum() / b  # score-function estimate of ∇(E[β r̂] − KL)
    objective.backward()
    assert torch.allclose(grad, -lp.grad, atol=1e-6)


@pytest.mark.parametrize("divergence", ["rkl", "kl", "js", "tv"])
def test_finite_with_extreme_sequence_log_probs(divergence):
    # Sequence log-probs of ±500 (64 tokens of about −8 each): exp of any of them overflows/underflows.
    log_prob = torch.tensor([[-250.0, -250.0], [-1.0, -1.0], [-0.1, -0.1], [-300.0, -200.0], [-1.0, 0.0]])
    ref = torch.tensor([[-1.0, -1.0], [-250.0, -250.0], [-0.1, -0.1], [-0.5, -0.5], [-500.0, 0.0]])
    old = log_prob + torch.tensor([[250.0, 250.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    loss, metrics, grad = run(FDPGConfig(divergence=divergence, beta=BETA), log_prob=log_prob, old=old, ref=ref)
    assert math.isfinite(loss.item()) and torch.isfinite(grad).all()
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    if divergence == "kl":
        # R = p/π_θ is at most n per group on-policy; here the off-policy sample 0 only lowers the others.
        _, _, grad_on = run(FDPGConfig(divergence="kl", beta=BETA), log_prob=log_prob, ref=ref)
        assert (grad_on[:, 0].abs() <= 3 / 5 + 1e-6).all()


def test_emptied_sequence_stays_out_of_z_and_baseline():
    # A response the overlong filter left out (no token in the loss) must not move Ẑ or b of its group.
    mask = MASK.clone()
    mask[2] = 0.0
    _, _, grad = run(FDPGConfig(divergence="js", beta=BETA), mask=mask)
    r = hand_pseudo_rewards("js", seq(LOG_PROB, mask), seq(LOG_PROB, mask), seq(REF, mask), R_HAT, [0, 0, 9, 1, 1])
    base = [sum(r[:2]) / 2] * 2 + [0.0] + [sum(r[3:]) / 2] * 2
    assert grad[2].abs().sum().item() == 0.0
    for i in (0, 1, 3, 4):
        assert grad[i, 0].item() == pytest.approx(-(r[i] - base[i]) / 5, rel=1e-5, abs=1e-7), i


def test_groups_in_separate_micro_batches_add_up_to_the_full_batch():
    full = run(FDPGConfig(divergence="js", beta=BETA))[2]
    parts = []
    for rows in (slice(0, 3), slice(3, 5)):  # whole groups, as the "whole_groups" need guarantees
        cfg = resolve_algorithm(AlgorithmConfig(name="fdpg", fdpg=FDPGConfig(divergence="js", beta=BETA))).cfg
        lp = LOG_PROB[rows].clone().requires_grad_()
        ctx = LossContext(cfg=cfg, aggregate=partial(aggregate, mode="token-mean", scale=BatchScale(total_seqs=5.0)),
                          ref_log_prob=REF[rows], group_index=GROUPS[rows])
        adv = torch.tensor(R_HAT)[rows, None] * MASK[rows]
        fdpg_loss(lp, LOG_PROB[rows], adv, MASK[rows], ctx)[0].backward()
        parts.append(lp.grad)
    assert torch.allclose(torch.cat(parts), full, atol=1e-7)


def test_recipe_needs_and_config_errors():
    algo = resolve_algorithm(load_config(None, ["algorithm.name=fdpg"]).algorithm)
    assert (algo.cfg.advantage, algo.cfg.loss, algo.cfg.fdpg.divergence) == ("grpo", "fdpg", "js")
    assert algo.needs == {"ref_log_prob", "whole_groups"}
    bad = [
        (["algorithm.fdpg.divergence=chi2"], r"algorithm\.fdpg\.divergence 'chi2' is not one of rkl, kl, js, tv"),
        (["algorithm.fdpg.baseline=ema"], r"algorithm\.fdpg\.baseline 'ema'"),
        (["algorithm.fdpg.beta=0"], r"algorithm\.fdpg\.beta must be positive"),
        (["algorithm.fdpg.is_max=-1"], r"algorithm\.fdpg\.is_max must be >= 0"),
        (["algorithm.kl_coef=0.05", "algorithm.kl_in=reward"], r"algorithm\.kl_coef=0\.05 \(kl_in='reward'\).*second time"),
        (["algorithm.kl_coef=0.05"], r"algorithm\.kl_coef=0\.05 \(kl_in='loss'\).*algorithm\.fdpg\.beta"),
        (["algorithm.tis_cap=2"], r"algorithm\.tis_cap"),
    ]
    for overrides, message in bad:
        with pytest.raises(ConfigError, match=message):  # refused at load now
            resolve_algorithm(load_config(None, ["algorithm.name=fdpg", *overrides]).algorithm)


REF_PROBS = [0.2, 0.1, 0.05, 0.15, 0.15, 0.15, 0.1, 0.1]
EQUAL = [1, 1, 1, 0, 0, 0, 0, 0]
UNEQUAL = [1.0, 0.8, 0.6, 0.4, 0.2, 0.0, 0.0, 0.0]


def tv_distance(p, q):
    return 0.5 * float((p.double() - q.double()).abs().sum())


@pytest.mark.parametrize("divergence", ["rkl", "js"])
def test_moves_to_the_flowrl_target_on_the_toy_problem(divergence):
    """Graded rewards, uniform π_ref, β = 3, centered r̂: the target π_ref·exp(β·r)/Z is reached (the
    group mean of r̂ cancels in the self-normalized Ẑ). TV to the target falls from 0.45 by a factor
    > 100 in 300 steps (measured ~1e-7 for both). Equal rewards with the default β = 15 and
    std-normalized r̂: π_ref restricted to the correct answers (4:2:1) is matched within TV 0.03
    (measured 0.013 rkl, 0.005 js; π_ref is at 0.65), where GRPO piles up on one answer (0.23)."""
    uniform = [1 / 8] * 8
    target = target_distribution(uniform, UNEQUAL, 3.0)
    cfg = AlgorithmConfig(name="fdpg", norm_adv_by_std=False, fdpg=FDPGConfig(divergence=divergence, beta=3.0))
    start = tv_distance(torch.tensor(uniform), target)
    end = tv_distance(train_tabular(cfg, UNEQUAL, uniform, steps=300).probs, target)
    assert start > 0.4 and end < start / 100, (start, end)

    target = target_distribution(REF_PROBS, EQUAL, 15.0)
    probs = train_tabular(AlgorithmConfig(name="fdpg", fdpg=FDPGConfig(divergence=divergence)), EQUAL, REF_PROBS,
                          steps=300).probs
    assert tv_distance(torch.tensor(REF_PROBS), target) > 0.6
    assert tv_distance(probs, target) < 0.03, probs
    grpo = train_tabular(AlgorithmConfig(name="grpo"), EQUAL, REF_PROBS, steps=300).probs
    assert tv_distance(grpo, target) > 0.15, grpo


FDPG_METRICS = ("fdpg/pseudo_reward_mean", "fdpg/advantage_absmax", "fdpg/advantage_absmean", "fdpg/log_z_mean",
                "fdpg/log_ratio_mean", "fdpg/divergence", "fdpg/is_weight_mean", "loss", "grad_norm", "reward/mean")


@pytest.mark.parametrize("extra", [
    {},
    # Second epoch (w ≠ 1) and micro-batches smaller than a group (the trainer keeps groups whole).
    {"algorithm.fdpg.divergence": "rkl", "algorithm.ppo_epochs": 2, "trainer.micro_batch_size": 3},
])
def test_fdpg_recipe_trains_on_tiny_model(tiny_model_dir, write_jsonl, tmp_path, extra):
    from anabranch import train
    from test_train_e2e import digit_task, tiny_overrides

    # A graded reward: with the digit task's all-zero rewards at the start, r̂ = 0, the target is π_ref
    # itself and f-DPG rightly has nothing to do (every pseudo-reward of a group is equal).
    overrides = {"algorithm.name": "fdpg", "trainer.steps": 2, "trainer.eval_before": False,
                 "trainer.eval_after": False, "rollout.n": 4, "trainer.micro_batch_size": 8,
                 "reward.functions": "[{name: target_length, params: {target: 2}}]", "reward.isolation": "none", **extra}
    result = train(load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path, **overrides)))
    assert len(result.history) == 2
    for key in FDPG_METRICS:
        assert all(math.isfinite(m[key]) for m in result.history), key
    assert all(m["skipped_updates"] == 0 for m in result.history)
    assert any(m["grad_norm"] > 0 and m["fdpg/advantage_absmean"] > 0 for m in result.history)
    if extra:
        assert any(m["fdpg/is_weight_mean"] != 1.0 for m in result.history)
    else:
        assert all(m["fdpg/is_weight_mean"] == pytest.approx(1.0) for m in result.history)
