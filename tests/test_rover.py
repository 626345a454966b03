"""ROVER (He et al. 2025): the loss and its gradient against a hand computation on a 3-token
vocabulary, the vocabulary mean of log π against full logits (hand and tiny model, update and
advantage passes), the recipe and its refusals, learning on the toy problem, and a short run of the
`rover` recipe on the tiny model (on-policy and with a second pass, where the next-state term acts)."""

import math
from functools import partial

import pytest
import torch

from anabranch.algorithms.aggregation import BatchScale, aggregate
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.algorithms.rover import response_vocab_mean, rover_loss, vocab_mean_log_prob
from anabranch.config import AlgorithmConfig, ConfigError, load_config
from anabranch.eval.toy_matching import train_tabular
from anabranch.trainer.step import LossContext

from test_ucas import two_group_rollout

L = math.log
RHO = 0.5
# Row 0: a 2-token response; row 1: one token then padding.
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
LOG_PROB = torch.tensor([[L(0.5), L(0.25)], [L(0.6), 0.0]])
OLD = torch.tensor([[L(0.4), L(0.5)], [L(0.3), 0.0]])
R_TILDE = torch.tensor([[0.5, 0.5], [-0.5, 0.0]])  # the recipe's advantage: r − group mean on every token
# Full next-token distributions over the 3-token vocabulary at each state s_t (t = 0, 1).
PI = [[[0.5, 0.25, 0.25], [0.2, 0.3, 0.5]], [[0.6, 0.2, 0.2], [0.1, 0.1, 0.8]]]
PI_OLD = [[[0.3, 0.4, 0.3], [0.4, 0.5, 0.1]], [[0.3, 0.3, 0.4], [0.2, 0.2, 0.6]]]


def mean_log(p):
    return sum(L(x) for x in p) / len(p)


def run_loss(cfg, vocab=True):
    lp = LOG_PROB.clone().requires_grad_()
    extras = {}
    if vocab:
        extras = {"vocab_mean": torch.tensor([[mean_log(p) for p in row] for row in PI]),
                  "old_vocab_mean": torch.tensor([[mean_log(p) for p in row] for row in PI_OLD])}
    ctx = LossContext(cfg=cfg, aggregate=partial(aggregate, mode=cfg.loss_agg_mode, scale=BatchScale()),
                      extras=extras)
    loss, metrics = rover_loss(lp, OLD, R_TILDE, MASK, ctx)
    loss.backward()
    return loss, metrics, lp.grad


def test_loss_and_gradient_hand_computed():
    cfg = resolve_algorithm(AlgorithmConfig(name="rover", rover_rho=RHO, ppo_epochs=2)).cfg
    loss, metrics, grad = run_loss(cfg)
    # Q(s_t, a_t) = ρ·(log π_θ − log π_old); y_t = r̃ + ρ·(mean_v log π_θ(v|s_{t+1}) − mean_v log π_old(v|s_{t+1})).
    q00, q01, q10 = RHO * L(0.5 / 0.4), RHO * L(0.25 / 0.5), RHO * L(0.6 / 0.3)
    y00 = 0.5 + RHO * (mean_log(PI[0][1]) - mean_log(PI_OLD[0][1]))
    y01 = 0.5   # the last token: the reward only
    y10 = -0.5  # the next state is padding: no next-state term
    sq = [(q00 - y00) ** 2, (q01 - y01) ** 2, (q10 - y10) ** 2]
    assert loss.item() == pytest.approx(sum(sq) / 3, rel=1e-6)
    # ∂L/∂log π_θ = 2ρ(Q − y)/N: the target is detached (no gradient through the next-state term).
    expected = torch.tensor([[2 * RHO * (q00 - y00) / 3, 2 * RHO * (q01 - y01) / 3], [2 * RHO * (q10 - y10) / 3, 0.0]])
    assert torch.allclose(grad, expected, atol=1e-6)
    assert metrics["rover/next_q_mean"] == pytest.approx((y00 - 0.5) / 3, rel=1e-5)
    assert metrics["rover/td_error"] == pytest.approx(sum(sq) / 3, rel=1e-5)


def test_on_policy_is_reinforce_with_centered_reward():
    """ppo_epochs = 1: π_old = π_θ, Q = 0 and the next-state term is 0, so ∇L = −2ρ·r̃·∇log π / N."""
    cfg = resolve_algorithm(AlgorithmConfig(name="rover", rover_rho=RHO)).cfg
    lp = LOG_PROB.clone().requires_grad_()
    ctx = LossContext(cfg=cfg, aggregate=partial(aggregate, mode="token-mean", scale=BatchScale()))
    loss, metrics = rover_loss(lp, LOG_PROB, R_TILDE, MASK, ctx)
    loss.backward()
    assert loss.item() == pytest.approx((0.25 + 0.25 + 0.25) / 3)
    assert torch.allclose(lp.grad, -2 * RHO * R_TILDE * MASK / 3)
    assert metrics["rover/next_q_absmean"] == 0.0
    cfg2 = resolve_algorithm(AlgorithmConfig(name="rover", ppo_epochs=2)).cfg
    with pytest.raises(RuntimeError, match="vocab_mean"):
        run_loss(cfg2, vocab=False)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_vocab_mean_of_a_three_token_head_by_hand(temperature):
    head = torch.nn.Linear(3, 3, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(3))
    h = torch.tensor([[[L(0.5), L(0.25), L(0.25)], [0.0, 1.0, 3.0]]])
    got = vocab_mean_log_prob(h, head, temperature)
    for t, row in enumerate(h[0].tolist()):
        z = [x / temperature for x in row]
        lse = L(sum(math.exp(x) for x in z))
        assert got[0, t].item() == pytest.approx(sum(x - lse for x in z) / 3, abs=1e-6)
    if temperature == 1.0:  # h is already log π there: the plain mean of its log-probs
        assert got[0, 0].item() == pytest.approx(mean_log([0.5, 0.25, 0.25]), abs=1e-6)


def test_vocab_means_match_full_logits_on_tiny_model(tiny_model_dir):
    from anabranch.config import ModelConfig
    from anabranch.models.loading import load_model
    from anabranch.models.logprobs import position_ids_from_mask
    from anabranch.trainer.advantage_pass import compute_advantages
    from anabranch.trainer.microbatch import forward_micro_batch, plan_micro_batches

    model = load_model(ModelConfig(path=tiny_model_dir), torch.device("cpu"), trainable=True)
    ro, tau = two_group_rollout(), 0.8
    with torch.no_grad():
        ids, att = ro.input_ids, ro.attention_mask
        logits = model(input_ids=ids, attention_mask=att, position_ids=position_ids_from_mask(att)).logits
        direct = torch.log_softmax(logits[:, ro.prompt_ids.shape[1] - 1:-1].float() / tau, -1).mean(-1)
    mask = ro.response_mask.bool()
    # Advantage pass (π_old): carried as a per-token field next to the old log-probs.
    algo = resolve_algorithm(AlgorithmConfig(name="rover", ppo_epochs=2))
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    out = compute_advantages(algo, model, ro, rewards, micro_batch_size=4, temperature=tau)
    assert torch.allclose(out.precomputed["old_vocab_mean"][mask], direct[mask], atol=1e-5)
    # r̃ = r − group mean on every response token (no std normalization).
    assert torch.allclose(out.advantages[0], torch.full((5,), 1 / 3), atol=1e-6)
    # Update pass (π_θ): from the micro-batch's hidden states, the same numbers.
    mb = plan_micro_batches(ro.prompt_mask, ro.response_mask, 3)[1]
    with torch.no_grad():
        fo = forward_micro_batch(model, mb, ids, att, tau, hidden=True)
    got = response_vocab_mean(model, fo.hidden, ro.prompt_ids.shape[1], ro.response_ids.shape[1], tau)
    assert torch.allclose(got[mask[mb.rows]], direct[mb.rows][mask[mb.rows]], atol=1e-5)


def test_recipe_needs_and_config_errors():
    algo = resolve_algorithm(load_config(None, ["algorithm.name=rover"]).algorithm)
    cfg = algo.cfg
    assert (cfg.advantage, cfg.loss, cfg.norm_adv_by_std, cfg.loss_agg_mode, cfg.rover_rho) == \
        ("grpo", "rover", False, "token-mean", 1.0)
    assert algo.needs == frozenset()  # on-policy: nothing beyond the sampled tokens' log-probs
    algo = resolve_algorithm(load_config(None, ["algorithm.name=rover", "algorithm.ppo_epochs=2"]).algorithm)
    assert algo.needs == {"old_log_prob", "old_vocab_mean", "vocab_mean", "hidden"}
    # An explicit norm_adv_by_std=true (the authors' Math script) is kept.
    assert resolve_algorithm(load_config(None, ["algorithm.name=rover", "algorithm.norm_adv_by_std=true"])
                             .algorithm).cfg.norm_adv_by_std is True
    bad = [
        (["algorithm.rover_rho=0"], r"algorithm\.rover_rho must be positive and finite \(got 0"),
        (["algorithm.rover_rho=-1"], r"algorithm\.rover_rho must be positive"),
        (["algorithm.rover_rho=.nan"], r"algorithm\.rover_rho must be positive"),
        (["algorithm.rover_rho=.inf"], r"algorithm\.rover_rho must be positive and finite"),
        (["algorithm.tis_cap=2"], r"algorithm\.tis_cap.*loss='rover'"),
        (["algorithm.lp_reg_coef=1"], r"algorithm\.lp_reg_coef"),
    ]
    for overrides, message in bad:
        with pytest.raises(ConfigError, match=message):  # refused at load now
            resolve_algorithm(load_config(None, ["algorithm.name=rover", *overrides]).algorithm)


def test_moves_to_the_rewarded_answers_on_the_toy_problem():
    """Three of eight answers are correct and hold 35 % of π_ref's mass: ROVER puts > 95 % on them
    in 150 steps (measured 0.99)."""
    ref = [0.2, 0.1, 0.05, 0.15, 0.15, 0.15, 0.1, 0.1]
    correct = [1, 1, 1, 0, 0, 0, 0, 0]
    probs = train_tabular(AlgorithmConfig(name="rover"), correct, ref, steps=150).probs
    assert float(probs[:3].sum()) > 0.95, probs


ROVER_METRICS = ("rover/q_mean", "rover/next_q_mean", "rover/target_mean", "rover/td_error", "loss", "grad_norm")


@pytest.mark.parametrize("epochs", [1, 2])
def test_rover_recipe_trains_on_tiny_model(tiny_model_dir, write_jsonl, tmp_path, epochs):
    from anabranch import train
    from test_train_e2e import digit_task, tiny_overrides

    overrides = {"algorithm.name": "rover", "algorithm.ppo_epochs": epochs, "trainer.steps": 2,
                 "trainer.eval_before": False, "trainer.eval_after": False, "rollout.n": 4,
                 "trainer.micro_batch_size": 8, "reward.isolation": "none",
                 "reward.functions": "[{name: target_length, params: {target: 2}}]"}
    result = train(load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path, **overrides)))
    assert len(result.history) == 2
    for key in ROVER_METRICS:
        assert all(math.isfinite(m[key]) for m in result.history), key
    assert all(m["skipped_updates"] == 0 for m in result.history)
    assert any(m["grad_norm"] > 0 for m in result.history)
    if epochs == 1:
        assert all(m["rover/next_q_absmean"] == 0 for m in result.history)
    else:  # the second pass moves π_θ away from π_old: the next-state term acts
        assert any(m["rover/next_q_absmean"] > 1e-6 for m in result.history)
