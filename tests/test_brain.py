"""BRAIn (Pandey et al. 2024): the loss and its gradient on a hand-made group, the DPO-sft special case,
α as the exact tilted posterior, the vanishing gradient at the prior, micro-batch additivity, config
refusals, distribution matching on the enumerable toy problem, and a short run on the tiny model."""

import math
from functools import partial

import pytest
import torch

from anabranch.algorithms.aggregation import BatchScale, aggregate
from anabranch.algorithms.brain import brain_loss, brain_weights
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.config import AlgorithmConfig, ConfigError, load_config
from anabranch.eval.toy_matching import target_distribution, train_tabular
from anabranch.trainer.step import LossContext

# One prompt, three samples of lengths 2, 1, 2 (padding must get no gradient); π_θ ≠ π_old (a later epoch).
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
LOG_PROB = torch.tensor([[-1.0, -2.0], [-0.5, 0.0], [-0.2, -0.3]])
OLD = torch.tensor([[-1.2, -1.5], [-0.9, 0.0], [-0.4, -0.1]])
REF = torch.tensor([[-1.5, -1.0], [-1.0, 0.0], [-0.4, -0.4]])
R = [1.0, 0.0, 0.5]
BETA = 0.5


def run(log_prob=LOG_PROB, old=OLD, ref=REF, r=R, groups=(0, 0, 0), mask=MASK, beta=BETA, total_seqs=None):
    cfg = resolve_algorithm(AlgorithmConfig(name="brain", brain_beta=beta)).cfg
    lp = log_prob.clone().requires_grad_()
    adv = torch.tensor(r)[:, None] * mask  # the recipe's advantage: r (minus a group constant) on every token
    scale = BatchScale(total_seqs=float(total_seqs if total_seqs is not None else len(r)))
    ctx = LossContext(cfg=cfg, aggregate=partial(aggregate, mode="token-mean", scale=scale), ref_log_prob=ref,
                      group_index=torch.tensor(groups), rewards=torch.zeros(len(r)))
    loss, metrics = brain_loss(lp, old, adv, mask, ctx)
    loss.backward()
    return loss, metrics, lp.grad


def seq(x, mask=MASK):
    return (x * mask).sum(-1).tolist()


def softmax(xs):
    z = sum(math.exp(x) for x in xs)
    return [math.exp(x) / z for x in xs]


def test_loss_and_gradient_hand_computed():
    pi, q, ref = seq(LOG_PROB), seq(OLD), seq(REF)  # [-3, -0.5, -0.5], [-2.7, -0.9, -0.5], [-2.5, -1, -0.8]
    alpha = softmax([ref[i] + R[i] / BETA - q[i] for i in range(3)])
    gamma = softmax([pi[i] - q[i] for i in range(3)])
    loss, metrics, grad = run()
    # L = −Σ α_i log γ_i (the mean over prompts of the cross-entropy; one prompt here).
    assert loss.item() == pytest.approx(-sum(a * math.log(g) for a, g in zip(alpha, gamma)), rel=1e-6)
    # ∂L/∂ log π_θ(token of y_i) = −(α_i − γ_i) on each of y_i's tokens, 0 on padding.
    for i in range(3):
        for t in range(2):
            want = -(alpha[i] - gamma[i]) * MASK[i, t].item()
            assert grad[i, t].item() == pytest.approx(want, abs=1e-6), (i, t)
    assert metrics["brain/self_norm_kl"] == pytest.approx(sum(a * math.log(a / g) for a, g in zip(alpha, gamma)),
                                                          rel=1e-6)
    assert metrics["brain/alpha_ess"] == pytest.approx(1 / sum(a * a for a in alpha), rel=1e-6)


def test_weights_are_the_posterior_and_the_model_distribution():
    a, log_g = brain_weights(torch.tensor(seq(LOG_PROB)), torch.tensor(seq(OLD)), torch.tensor(seq(REF)),
                             torch.tensor(R), torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.bool), BETA)
    pi, q, ref = seq(LOG_PROB), seq(OLD), seq(REF)
    assert a.tolist() == pytest.approx(softmax([ref[i] + R[i] / BETA - q[i] for i in range(3)]), rel=1e-12)
    assert log_g.exp().tolist() == pytest.approx(softmax([pi[i] - q[i] for i in range(3)]), rel=1e-12)
    # A per-prompt shift of the reward (GRPO's group mean) leaves α unchanged.
    shifted, _ = brain_weights(torch.tensor(seq(LOG_PROB)), torch.tensor(seq(OLD)), torch.tensor(seq(REF)),
                               torch.tensor(R) - 7.0, torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.bool),
                               BETA)
    assert torch.allclose(shifted, a, atol=1e-12)


def test_two_samples_with_a_sharp_posterior_is_dpo_with_the_proposal_as_reference():
    """n = 2, π_ref = q, β → 0: α is one-hot on the better sample and L = −log σ(Δ_w − Δ_l), Δ = log π_θ − log q."""
    log_prob = torch.tensor([[-1.0], [-0.4]])
    old = torch.tensor([[-0.7], [-0.9]])
    loss, _, grad = run(log_prob=log_prob, old=old, ref=old, r=[1.0, 0.0], groups=(0, 0), mask=torch.ones(2, 1),
                        beta=1e-3)
    margin = (-1.0 - -0.7) - (-0.4 - -0.9)
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-margin))), rel=1e-6)
    sig = 1 / (1 + math.exp(margin))  # 1 − σ(margin): DPO's gradient weight
    assert grad[:, 0].tolist() == pytest.approx([-sig, sig], rel=1e-6)


def test_alpha_is_the_exact_tilted_posterior_on_a_stratified_group():
    """With the group holding each answer k in proportion to q(k) (counts 4, 2, 1, 1 of 8), the α mass on k is
    exactly π_ref(k)·exp(r_k/β)/Z, whatever the proposal."""
    q = [0.5, 0.25, 0.125, 0.125]
    ref = [0.1, 0.2, 0.3, 0.4]
    r = [0.0, 1.0, 0.3, -0.5]
    beta = 0.7
    answers = [0, 0, 0, 0, 1, 1, 2, 3]
    a, _ = brain_weights(torch.zeros(8), torch.tensor([math.log(q[k]) for k in answers]),
                         torch.tensor([math.log(ref[k]) for k in answers]), torch.tensor([r[k] for k in answers]),
                         torch.zeros(8, dtype=torch.long), torch.ones(8, dtype=torch.bool), beta)
    mass = torch.zeros(4, dtype=torch.float64).index_add(0, torch.tensor(answers), a)
    assert torch.allclose(mass, target_distribution(ref, r, 1 / beta), atol=1e-12)


def test_gradient_vanishes_at_the_prior_with_a_flat_likelihood():
    """β → ∞, π_θ = π_old = π_ref: α = γ = 1/n, no gradient; a finite β or π_ref ≠ π_old gives one."""
    _, _, grad = run(old=LOG_PROB, ref=LOG_PROB, beta=1e12)
    assert grad.abs().max().item() < 1e-9
    _, _, grad = run(old=LOG_PROB, ref=LOG_PROB, beta=BETA)
    assert grad.abs().max().item() > 0.05
    _, _, grad = run(old=LOG_PROB, ref=REF, beta=1e12)
    # Toward π_ref: y_0 is more likely under π_ref than under π_θ (−2.5 vs −3), so its log-prob is pushed up.
    assert grad[0, 0].item() < -0.05


def test_emptied_sequence_and_separate_groups():
    """A sequence with no loss token (overlong filter) stays out of both softmaxes; two groups in separate
    micro-batches add up to the whole batch's gradient (the trainer keeps groups whole)."""
    mask = torch.cat([MASK, torch.tensor([[0.0, 0.0]])])
    lp, old, ref = (torch.cat([x, torch.tensor([[-3.0, -3.0]])]) for x in (LOG_PROB, OLD, REF))
    loss4, _, grad4 = run(log_prob=lp, old=old, ref=ref, r=[*R, 5.0], groups=(0, 0, 0, 0), mask=mask, total_seqs=3)
    loss3, _, grad3 = run()
    assert loss4.item() == pytest.approx(loss3.item(), rel=1e-6)
    assert torch.allclose(grad4[:3], grad3) and grad4[3].abs().sum().item() == 0.0

    groups = (0, 0, 0, 1, 1, 1)
    both = [torch.cat([x, x.flip(0)]) for x in (LOG_PROB, OLD, REF)]
    full = run(*both, r=R + R[::-1], groups=groups, mask=torch.cat([MASK, MASK.flip(0)]))[2]
    part_a = run(total_seqs=6)[2]
    part_b = run(*(x.flip(0) for x in (LOG_PROB, OLD, REF)), r=R[::-1], groups=(1, 1, 1), mask=MASK.flip(0),
                 total_seqs=6)[2]
    assert torch.allclose(torch.cat([part_a, part_b]), full, atol=1e-7)


def test_recipe_needs_and_config_errors():
    algo = resolve_algorithm(load_config(None, ["algorithm.name=brain"]).algorithm)
    assert (algo.cfg.advantage, algo.cfg.loss, algo.cfg.norm_adv_by_std) == ("grpo", "brain", False)
    assert algo.needs == {"ref_log_prob", "whole_groups"}
    bad = [
        (["algorithm.name=brain", "algorithm.brain_beta=0"], r"algorithm\.brain_beta must be positive and finite"),
        (["algorithm.name=brain", "algorithm.brain_beta=-1"], r"algorithm\.brain_beta must be positive"),
        (["algorithm.name=brain", "algorithm.brain_beta=inf"], r"algorithm\.brain_beta must be positive and finite"),
        (["algorithm.name=brain", "algorithm.kl_coef=0.05"], r"algorithm\.kl_coef=0\.05.*algorithm\.brain_beta"),
        (["algorithm.name=brain", "algorithm.advantage=rloo"], r"algorithm\.advantage='rloo' is not supported for "
                                                               r"loss='brain'"),
        (["algorithm.name=brain", "algorithm.tis_cap=2"], r"algorithm\.tis_cap"),
    ]
    for overrides, message in bad:
        with pytest.raises(ConfigError, match=message):  # refused at load now
            resolve_algorithm(load_config(None, overrides).algorithm)


def test_gated_and_refused_at_load():
    """brain_beta with another loss and CURE's branch rollouts are refused by load_config, naming the keys."""
    with pytest.raises(ConfigError, match=r"'algorithm\.brain_beta' has no effect unless algorithm\.loss=brain"):
        load_config(None, ["algorithm.name=grpo", "algorithm.brain_beta=0.5"])
    cure = ["rollout.extra_rollouts=cure", "rollout.n=8", "rollout.cure_originals=2", "rollout.cure_branches=3"]
    with pytest.raises(ConfigError, match=r"rollout\.extra_rollouts=cure is not supported for algorithm\.loss=brain"):
        load_config(None, ["algorithm.name=brain", *cure])
    load_config(None, ["algorithm.name=grpo", *cure])  # CURE itself stays available to other losses
    load_config(None, ["algorithm.name=brain", "algorithm.brain_beta=0.5", "algorithm.entropy_coef=0.01"])


def test_gated_in_code_built_configs_too():
    """A Config built in code never passes load_config: train()'s check_whole_config still refuses brain_beta
    with another loss, with _GATED's message."""
    from anabranch.config import Config
    from anabranch.config_checks import check_whole_config

    msg = r"config key 'algorithm\.brain_beta' has no effect unless algorithm\.loss=brain \(algorithm\.name=brain\)"
    with pytest.raises(ConfigError, match=msg + r" \(got 2\.0\)"):
        check_whole_config(Config(algorithm=AlgorithmConfig(name="grpo", advantage="grpo", loss="ppo_clip",
                                                            brain_beta=2.0)))
    with pytest.raises(ConfigError, match=msg):
        check_whole_config(Config(algorithm=AlgorithmConfig(name="grpo", brain_beta=2.0)))
    with pytest.raises(ConfigError, match=msg):  # the same words at load
        load_config(None, ["algorithm.name=grpo", "algorithm.brain_beta=2.0"])
    check_whole_config(Config(algorithm=AlgorithmConfig(name="grpo", advantage="grpo", loss="ppo_clip")))  # default
    resolve_algorithm(AlgorithmConfig(name="brain", brain_beta=2.0))


def cross_entropy(pi, q, ref, r, beta=BETA):
    """L_x = −Σ α log γ of one prompt, from sequence log-probs (plain Python)."""
    alpha = softmax([ref[i] + r[i] / beta - q[i] for i in range(len(r))])
    gamma = softmax([pi[i] - q[i] for i in range(len(r))])
    return -sum(a * math.log(g) for a, g in zip(alpha, gamma)), alpha


def test_unequal_groups_weight_each_prompt_by_its_size():
    """Groups of 3 and 2 in one batch: the loss is Σ_g n_g·L_g / Σ_g n_g (the sequence mean), the metrics the plain
    mean over prompts; each row's gradient is −(n_g/B)·(α_i − γ_i)."""
    lp2, old2, ref2 = torch.tensor([[-0.3], [-1.1]]), torch.tensor([[-0.6], [-0.8]]), torch.tensor([[-0.2], [-1.4]])
    r2 = [0.0, 1.0]
    pad = torch.zeros(2, 1)
    cat = [torch.cat([a, torch.cat([b, pad], -1)]) for a, b in ((LOG_PROB, lp2), (OLD, old2), (REF, ref2))]
    mask = torch.cat([MASK, torch.tensor([[1.0, 0.0], [1.0, 0.0]])])
    loss, metrics, grad = run(*cat, r=R + r2, groups=(0, 0, 0, 1, 1), mask=mask)
    l0, a0 = cross_entropy(seq(LOG_PROB), seq(OLD), seq(REF), R)
    l1, a1 = cross_entropy([-0.3, -1.1], [-0.6, -0.8], [-0.2, -1.4], r2)
    assert abs((3 * l0 + 2 * l1) / 5 - (l0 + l1) / 2) > 0.01  # the two readings differ on these numbers
    assert loss.item() == pytest.approx((3 * l0 + 2 * l1) / 5, rel=1e-6)
    assert metrics["brain/cross_entropy"] == pytest.approx((l0 + l1) / 2, rel=1e-6)
    g1 = softmax([-0.3 - -0.6, -1.1 - -0.8])
    assert grad[3, 0].item() == pytest.approx(-(2 / 5) * (a1[0] - g1[0]), abs=1e-7)
    assert grad[4, 0].item() == pytest.approx(-(2 / 5) * (a1[1] - g1[1]), abs=1e-7)


def test_a_group_with_no_loss_row_stays_out_of_the_metrics():
    """A second group whose rows are all masked out (overlong filter, HPT) leaves every per-prompt metric at the
    live group's value: no 1/0 effective sample size, no zero cross-entropy pulling the mean down."""
    _, alone, _ = run()
    dead = torch.full((2, 2), -1.0)
    cat = [torch.cat([x, dead]) for x in (LOG_PROB, OLD, REF)]
    _, metrics, grad = run(*cat, r=R + [1.0, 0.0], groups=(0, 0, 0, 1, 1), mask=torch.cat([MASK, torch.zeros(2, 2)]))
    l0, a0 = cross_entropy(seq(LOG_PROB), seq(OLD), seq(REF), R)
    assert metrics["brain/alpha_ess"] == pytest.approx(1 / sum(a * a for a in a0), rel=1e-6)
    assert metrics["brain/cross_entropy"] == pytest.approx(l0, rel=1e-6)
    assert metrics["brain/alpha_max"] == pytest.approx(max(a0), rel=1e-6)
    assert metrics["brain/self_norm_kl"] == pytest.approx(alone["brain/self_norm_kl"], rel=1e-6)
    assert grad[3:].abs().sum().item() == 0.0
    # Every group dead: finite zeros, not 1e300.
    _, metrics, _ = run(r=R, mask=torch.zeros(3, 2))
    assert all(math.isfinite(v) for v in metrics.values()) and metrics["brain/alpha_ess"] == 0.0


def tv_distance(p, q):
    return 0.5 * float((p.double() - q.double()).abs().sum())


REF_PROBS = [0.2, 0.1, 0.05, 0.15, 0.15, 0.15, 0.1, 0.1]
UNEQUAL = [1.0, 0.8, 0.6, 0.4, 0.2, 0.0, 0.0, 0.0]
EQUAL = [1, 1, 1, 0, 0, 0, 0, 0]


def test_moves_to_the_tilted_posterior_on_the_toy_problem():
    """A tabular policy trained with the registered recipe reaches π_ref·exp(r/β)/Z: graded rewards from a
    non-uniform prior (β = 1/3), and 0/1 rewards at the default β = 0.1 (π_ref restricted to the right
    answers, 4:2:1), where GRPO collapses onto fewer answers."""
    target = target_distribution(REF_PROBS, UNEQUAL, 3.0)
    start = tv_distance(torch.tensor(REF_PROBS), target)
    end = tv_distance(train_tabular(AlgorithmConfig(name="brain", brain_beta=1 / 3), UNEQUAL, REF_PROBS,
                                    steps=300).probs, target)
    assert start > 0.3 and end < start / 1000, (start, end)  # measured ~1e-7 from 0.48

    target = target_distribution(REF_PROBS, EQUAL, 10.0)
    probs = train_tabular(AlgorithmConfig(name="brain"), EQUAL, REF_PROBS, steps=300).probs
    assert tv_distance(torch.tensor(REF_PROBS), target) > 0.6
    assert tv_distance(probs, target) < 0.05, probs
    grpo = train_tabular(AlgorithmConfig(name="grpo"), EQUAL, REF_PROBS, steps=300).probs
    assert tv_distance(grpo, target) > 0.15, grpo


BRAIN_METRICS = ("brain/self_norm_kl", "brain/cross_entropy", "brain/alpha_ess", "brain/weight_absmean", "loss",
                 "grad_norm", "reward/mean")


def test_refuses_single_sample_groups(tiny_model_dir, write_jsonl, tmp_path):
    from anabranch import train
    from test_train_e2e import digit_task, tiny_overrides

    cfg = load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path,
                                           **{"algorithm.name": "brain", "rollout.n": 1}))
    with pytest.raises(ConfigError, match=r"rollout\.n must be >= 2"):
        train(cfg)


@pytest.mark.parametrize("extra", [
    {},
    # A second epoch (π_θ ≠ π_old) with micro-batches smaller than a group (the trainer keeps groups whole).
    {"algorithm.ppo_epochs": 2, "trainer.micro_batch_size": 3},
])
def test_brain_recipe_trains_on_tiny_model(tiny_model_dir, write_jsonl, tmp_path, extra):
    from anabranch import train
    from test_train_e2e import digit_task, tiny_overrides

    # A graded reward: with the digit task's all-zero rewards at the start, α = γ and there is nothing to do.
    overrides = {"algorithm.name": "brain", "trainer.steps": 2, "trainer.eval_before": False,
                 "trainer.eval_after": False, "rollout.n": 4, "trainer.micro_batch_size": 8,
                 "reward.functions": "[{name: target_length, params: {target: 2}}]", "reward.isolation": "none",
                 **extra}
    result = train(load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path, **overrides)))
    assert len(result.history) == 2
    for key in BRAIN_METRICS:
        assert all(math.isfinite(m[key]) for m in result.history), key
    assert all(m["skipped_updates"] == 0 for m in result.history)
    assert any(m["grad_norm"] > 0 and m["brain/weight_absmean"] > 0 for m in result.history)
