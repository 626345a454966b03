"""PACS (Li et al. 2025, "Implicit Actor Critic Coupling via a Supervised Learning Framework for RLVR",
arXiv 2509.02522): the score ψ, the class weights, the cross-entropy and its gradient by hand, the sign of
the on-policy gradient (correct samples pushed up), the config refusals, and short runs on the tiny model."""

import dataclasses
import math
from functools import partial

import pytest
import torch

from anabranch import load_config, train
from anabranch.algorithms import resolve_algorithm
from anabranch.algorithms.aggregation import aggregate
from anabranch.algorithms.pacs import class_weights, pacs_loss, rloo_score
from anabranch.config import AlgorithmConfig, ConfigError
from anabranch.trainer.step import LossContext
from test_train_e2e import digit_task, tiny_overrides


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def softplus(x):
    return math.log1p(math.exp(x))


def cfg(**kw):
    return dataclasses.replace(AlgorithmConfig(), **{**dict(advantage="rloo", loss="pacs"), **kw})


def ctx(c, rewards, groups):
    # token-mean on purpose: PACS averages over sequences whatever loss_agg_mode says.
    return LossContext(cfg=c, aggregate=partial(aggregate, mode="token-mean"), rewards=rewards, group_index=groups)


def test_rloo_score_and_class_weights_by_hand():
    x = torch.tensor([1.0, -0.5, 0.0, 2.0, 4.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    # ψ_i = x_i − mean of the others in its group.
    assert torch.allclose(rloo_score(x, groups), torch.tensor([1.25, -1.0, -0.25, -2.0, 2.0]))
    # Group 0: two 1s and one 0 of G = 3 → 3/(2·2) and 3/(2·1); group 1 all equal → 1.
    w = class_weights(torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0]), groups)
    assert torch.allclose(w, torch.tensor([0.75, 1.5, 0.75, 1.0, 1.0]))
    with pytest.raises(RuntimeError, match="rollout.n >= 2"):
        rloo_score(x, torch.tensor([0, 0, 0, 1, 2]))


def test_loss_and_gradient_by_hand():
    # Per-token log-ratios (the last token of row 1 is padding: left out); sequence sums 0.5, −0.25, 0.
    old = torch.zeros(3, 2)
    logp = torch.tensor([[0.25, 0.25], [-0.25, 9.0], [0.1, -0.1]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    rewards, groups = torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 0])
    beta = 2.0
    loss, metrics = pacs_loss(logp, old, torch.zeros(3, 2), mask, ctx(cfg(pacs_beta=beta), rewards, groups))
    # r̂ = 2·[0.5, −0.25, 0] = [1, −0.5, 0]; ψ = [1.25, −1.0, −0.25]; w = [0.75, 1.5, 0.75].
    psi, w, r = [1.25, -1.0, -0.25], [0.75, 1.5, 0.75], [1.0, 0.0, 1.0]
    # BCE: −log σ(ψ) = softplus(−ψ) for r = 1, −log(1 − σ(ψ)) = softplus(ψ) for r = 0; mean over 3 sequences.
    bce = [softplus(-p) if y == 1 else softplus(p) for p, y in zip(psi, r)]
    assert loss.item() == pytest.approx(sum(wi * b for wi, b in zip(w, bce)) / 3, rel=1e-6)
    assert metrics["pacs/score_mean"] == pytest.approx(sum(psi) / 3, abs=1e-6)
    loss.backward()
    # ∂L/∂ψ_i = w_i(σ(ψ_i) − r_i)/3; ∂ψ_i/∂(log π of a token of k) = β (i = k), −β/2 (i ≠ k).
    g = [wi * (sigmoid(p) - y) / 3 for wi, p, y in zip(w, psi, r)]
    expected = [beta * (g[k] - sum(g[i] for i in range(3) if i != k) / 2) for k in range(3)]
    for k in range(3):
        assert logp.grad[k, 0].item() == pytest.approx(expected[k], rel=1e-5)
    assert logp.grad[0, 1].item() == pytest.approx(expected[0], rel=1e-5)
    assert logp.grad[1, 1].item() == 0.0  # padding has no gradient


def test_on_policy_gradient_pushes_correct_samples_up():
    # π_old = π_θ: ψ = 0, σ = 1/2, and ∂L/∂log π_k = β·(mean_{j≠k} r_j − r_k)/N (w = 1).
    logp = torch.full((4, 2), -1.0, requires_grad=True)
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.long)
    loss, m = pacs_loss(logp, logp.detach(), torch.zeros(4, 2), torch.ones(4, 2),
                        ctx(cfg(pacs_beta=1.5, pacs_class_balance=False), rewards, groups))
    assert loss.item() == pytest.approx(math.log(2.0), rel=1e-6)  # BCE at σ = 1/2
    loss.backward()
    assert logp.grad[0, 0].item() == pytest.approx(1.5 * (0 - 1) / 4)  # descent raises the correct sample
    assert logp.grad[1, 0].item() == pytest.approx(1.5 * (1 / 3) / 4)  # and lowers the wrong ones
    # One descent step on the log-probs raises the correct sample's share.
    assert (logp - logp.grad)[0, 0] > (logp - logp.grad)[1, 0]


def test_rewards_outside_unit_interval_are_refused():
    logp = torch.zeros(2, 1)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        pacs_loss(logp, logp, logp, torch.ones(2, 1), ctx(cfg(), torch.tensor([1.2, 0.0]), torch.tensor([0, 0])))
    with pytest.raises(RuntimeError, match="reward"):
        pacs_loss(logp, logp, logp, torch.ones(2, 1), ctx(cfg(), None, None))


def test_recipe_and_needs():
    algo = resolve_algorithm(AlgorithmConfig(name="pacs"))
    assert algo.cfg.loss == "pacs" and algo.cfg.advantage == "rloo"
    # No reference model (the ratio is to π_old); whole groups for the leave-one-out score.
    assert "whole_groups" in algo.needs and "ref_log_prob" not in algo.needs
    assert "old_log_prob" in resolve_algorithm(AlgorithmConfig(name="pacs", ppo_epochs=2)).needs


@pytest.mark.parametrize("kw, match", [
    ({"pacs_beta": 0.0}, "pacs_beta must be a positive finite number"),
    ({"pacs_beta": math.nan}, "pacs_beta must be a positive finite number"),
    ({"pacs_class_balance": "yes"}, "pacs_class_balance must be true or false"),
    ({"tis_cap": 2.0}, r"algorithm\.tis_cap=2\.0 with algorithm\.loss=pacs"),
    ({"overlong_buffer": 2}, r"algorithm\.overlong_buffer"),
    ({"ucas": True}, r"algorithm\.ucas"),
    # One refusal, config_checks._GATED's (resolve.check_algorithm runs it for an AlgorithmConfig on its own).
    ({"loss": "ppo_clip", "advantage": "grpo", "pacs_beta": 2.0},
     r"'algorithm\.pacs_beta' has no effect unless algorithm\.loss=pacs"),
])
def test_bad_settings_are_refused_at_resolution(kw, match):
    with pytest.raises(ConfigError, match=match):
        resolve_algorithm(cfg(**kw))


def test_pacs_keys_without_pacs_are_refused_when_the_config_loads(tiny_model_dir, write_jsonl, tmp_path):
    args = tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path, **{"algorithm.pacs_beta": 2.0})
    with pytest.raises(ConfigError, match=r"algorithm\.pacs_beta.*algorithm\.loss=pacs"):
        load_config(None, args)


def even_first_char(prompts, completions, **_):
    """About half of a random model's replies start with a character of even code point: a dense 0/1 label."""
    return [float(len(str(c)) > 0 and ord(str(c)[0]) % 2 == 0) for c in completions]


DENSE = {"reward.functions": "[test_pacs:even_first_char]", "reward.isolation": "none"}


def pacs_run(tiny_model_dir, write_jsonl, tmp_path, **extra):
    overrides = {"algorithm.name": "pacs", "trainer.steps": 2, "trainer.eval_before": False,
                 "trainer.eval_after": False, "rollout.n": 4, "trainer.micro_batch_size": 6, **extra}
    return train(load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path, **overrides)))


def test_short_run_with_two_passes_scores_the_moved_policy(tiny_model_dir, write_jsonl, tmp_path):
    result = pacs_run(tiny_model_dir, write_jsonl, tmp_path, **{"algorithm.ppo_epochs": 2, **DENSE})
    for key in ("loss", "pacs/score_mean", "pacs/critic_acc", "pacs/critic_err", "pacs/weight_max", "grad_norm"):
        assert all(math.isfinite(m[key]) for m in result.history), key
    assert all(m["skipped_updates"] == 0 for m in result.history)
    # The second pass scores the moved policy: ψ ≠ 0 (the first alone would give ψ = 0).
    assert all(m["pacs/score_abs_mean"] > 0 for m in result.history)


def test_reward_rises_with_one_pass(tiny_model_dir, write_jsonl, tmp_path):
    # One pass per batch: π_old = π_θ, ψ = 0 exactly (BCE = ln 2 per weighted sample), yet the gradient
    # is RLOO's on the labels, and the dense reward rises within a few steps.
    result = pacs_run(tiny_model_dir, write_jsonl, tmp_path, **{"trainer.steps": 12, "rollout.n": 8,
                                                                "trainer.micro_batch_size": 32, **DENSE})
    assert all(m["pacs/score_mean"] == 0.0 and m["pacs/score_abs_mean"] == 0.0 for m in result.history)
    assert all(m["loss"] == pytest.approx(math.log(2.0), rel=1e-4) for m in result.history)
    rewards = [m["reward/mean"] for m in result.history]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.15, rewards


@pytest.mark.slow
def test_pacs_reward_rises_on_the_digit_task(tiny_model_dir, write_jsonl, tmp_path):
    result = pacs_run(tiny_model_dir, write_jsonl, tmp_path, **{"trainer.steps": 30, "rollout.n": 8,
                                                                "trainer.micro_batch_size": 32})
    rewards = [m["reward/mean"] for m in result.history]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.3, rewards


@pytest.mark.parametrize("functions,ok", [
    (["math_verify"], True),
    (["math_verify", "format*0"], True),          # weight-0 entries only log
    (["math_verify*0.5"], True),
    (["math_verify", "format"], False),           # a sum of rewards can reach 2
    (["math_verify*2"], False),
    (["laser"], False),                           # a bonus on top of 1
    (["overlong_penalty"], False),
    (["trajectory_log_prob"], False),             # a log-probability, <= 0
])
def test_reward_outside_the_unit_interval_is_refused_when_the_config_loads(functions, ok):
    overrides = ["algorithm.name=pacs", f"reward.functions=[{', '.join(functions)}]"]
    if ok:
        assert load_config(None, overrides).algorithm.loss == "pacs"
    else:
        with pytest.raises(ConfigError, match=r"algorithm.loss=pacs .*reward.functions must hold exactly one verifier"):
            load_config(None, overrides)
