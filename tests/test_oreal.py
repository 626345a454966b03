"""OREAL (Lyu et al. 2025, "Exploring the Limit of Outcome Reward for Learning Mathematical Reasoning", arXiv
2502.06781): the RLOO reshaping of the ±1 outcomes and its pass-rate factor by hand, the loss and its gradient by
hand (behaviour cloning on the correct samples, the reshaped ratio term on the wrong ones, masked tokens), the
token-level reward head's weights and loss by hand, micro-batch splits, refusals, learning on the tiny model and a
short run through train()."""

import dataclasses
import math
from functools import partial

import pytest
import torch

from anabranch import load_config, train
from anabranch.algorithms import resolve_algorithm
from anabranch.algorithms.aggregation import aggregate
from anabranch.algorithms.oreal import (TOKEN_RM, TokenRewardHead, oreal_loss, oreal_precompute, reshaped_outcomes,
                                        token_rm_loss, token_weights)
from anabranch.config import AlgorithmConfig, Config, ConfigError
from anabranch.config_checks import check_whole_config
from anabranch.trainer.step import LossContext, no_grad_log_probs, policy_update
from test_train_e2e import digit_task, tiny_overrides


def cfg(**kw):
    return dataclasses.replace(AlgorithmConfig(), **{**dict(name="oreal", advantage="rloo", loss="oreal"), **kw})


def ctx(c, extras, hidden=None, modules=None):
    return LossContext(cfg=c, aggregate=partial(aggregate, mode="token-mean"), extras=extras, hidden=hidden,
                       modules=modules or {})


def test_rloo_reshaping_and_its_pass_rate_factor_by_hand():
    # Groups of 4: k = 2, k = 1, k = 0, k = 4 correct; 0.5 is not above τ = 0.5 (a wrong sample).
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    groups = torch.arange(4).repeat_interleave(4)
    o, adv = reshaped_outcomes(rewards, groups, cfg())
    assert o.tolist() == [1, 1, -1, -1, 1, -1, -1, -1, -1, -1, -1, -1, 1, 1, 1, 1]
    # A = 2(n−k)/(n−1) on a correct sample, −2k/(n−1) on a wrong one.
    want = [4 / 3, 4 / 3, -4 / 3, -4 / 3, 2, -2 / 3, -2 / 3, -2 / 3, 0, 0, 0, 0, 0, 0, 0, 0]
    assert adv.tolist() == pytest.approx(want)


def test_negative_coefficient_grows_with_the_prompts_pass_rate():
    # Two groups of 4 with equal lengths: k = 1 and k = 3. The wrong sample of the easy prompt weighs 3× more.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    pre = oreal_precompute(cfg(), {}, torch.ones(8, 2), rewards, torch.arange(2).repeat_interleave(4))
    t_neg = 2 * 4  # four wrong samples of two tokens
    assert pre["oreal_coef"][1].item() == pytest.approx(0.5 * (2 / 3) / t_neg)
    assert pre["oreal_coef"][7].item() == pytest.approx(0.5 * 2 / t_neg)
    assert (pre["oreal_coef"][7] / pre["oreal_coef"][1]).item() == pytest.approx(3.0)


class TwoRanks:
    """A stand-in for trainer/distributed.Distributed: another rank holds ``other`` (T+, T−, N)."""

    world_size = 2

    def __init__(self, other):
        self.other = torch.tensor(other, dtype=torch.float64)

    def all_reduce_sum(self, t):
        return t + self.other


def test_normalizers_are_global_under_data_parallel():
    # This rank: one group, k = 1 of 4, two tokens each (T+ = 2, T− = 6, N = 4); the other rank: T+ = 6, T− = 2, N = 4.
    # DDP averages the ranks' gradients, so each rank divides by the global count over W: (2 + 6)/2 and (6 + 2)/2.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    pre = oreal_precompute(cfg(), {}, torch.ones(4, 2), rewards, torch.zeros(4, dtype=torch.long),
                           dist=TwoRanks([6.0, 2.0, 4.0]))
    assert pre["oreal_coef"].tolist() == pytest.approx([2.0 / 4, 0.5 * (2 / 3) / 4, 0.5 * (2 / 3) / 4, 0.5 * (2 / 3) / 4])
    assert pre["oreal_rm_weight"].tolist() == pytest.approx([1 / 4] * 4)


# One group: the first sample correct (k = 1, n = 4); lengths 2, 3, 1, 2 (T+ = 2, T− = 6).
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0])
GROUPS = torch.zeros(4, dtype=torch.long)
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
LP = torch.tensor([[-0.5, -1.0, -9.0], [-2.0, -0.1, -0.3], [-1.5, -9.0, -9.0], [-0.7, -0.2, -9.0]])


@pytest.mark.parametrize("mult, pos_coef", [(True, 2.0 / 2), (False, 1.0 / 2)])
def test_loss_and_gradient_by_hand(mult, pos_coef):
    c = cfg(oreal_pos_mult_adv=mult, oreal_neg_weight=0.5)
    pre = oreal_precompute(c, {}, MASK, REWARDS, GROUPS)
    neg_coef = 0.5 * (2 / 3) / 6  # η·|A|/T−, A = −2k/(n−1) = −2/3
    assert pre["oreal_coef"].tolist() == pytest.approx([pos_coef, neg_coef, neg_coef, neg_coef])
    lp = LP.clone().requires_grad_(True)
    loss, metrics = oreal_loss(lp, LP.clone(), torch.zeros(4, 3), MASK, ctx(c, pre))
    # On-policy the ratio is 1: L = pos_coef·(0.5 + 1.0) + neg_coef·6.
    assert loss.item() == pytest.approx(pos_coef * 1.5 + neg_coef * 6)
    loss.backward()
    want = torch.zeros(4, 3)
    want[0, :2] = -pos_coef
    want[1:] = neg_coef * MASK[1:]
    assert torch.allclose(lp.grad, want)
    assert metrics["oreal/pos_nll"] == pytest.approx(0.75)
    assert metrics["oreal/pos_token_frac"] == pytest.approx(2 / 8)


def test_off_policy_ratio_on_the_wrong_samples():
    c = cfg()
    pre = oreal_precompute(c, {}, MASK, REWARDS, GROUPS)
    old = LP.clone()
    old[1, 0] = -2.5  # π/π_old = e^{0.5} on that token
    lp = LP.clone().requires_grad_(True)
    loss, _ = oreal_loss(lp, old, torch.zeros(4, 3), MASK, ctx(c, pre))
    loss.backward()
    neg_coef = 0.5 * (2 / 3) / 6
    assert lp.grad[1, 0].item() == pytest.approx(neg_coef * math.exp(0.5))
    assert loss.item() == pytest.approx(1.0 * 1.5 + neg_coef * (5 + math.exp(0.5)))


def test_groups_without_contrast_and_empty_rows_get_no_gradient():
    # All wrong (k = 0): A = 0; all correct (k = 4) with a_i = A_i: 0. An emptied row (overlong filter) is out.
    rewards = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    mask = torch.ones(6, 2)
    mask[5] = 0.0
    pre = oreal_precompute(cfg(), {}, mask, rewards, groups)
    assert pre["oreal_coef"][:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert pre["oreal_sign"][5].item() == 0.0 and pre["oreal_rm_weight"][5].item() == 0.0
    lp = torch.randn(6, 2).requires_grad_(True)
    loss, _ = oreal_loss(lp, lp.detach(), torch.zeros(6, 2), mask, ctx(cfg(), pre))
    loss.backward()
    assert torch.all(lp.grad[[0, 1, 2, 3, 5]] == 0) and torch.all(lp.grad[4] != 0)


def test_token_weights_by_hand():
    w = torch.tensor([[2.0, -2.0, 0.0], [-1.0, -3.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w_pos, w_neg = token_weights(w, mask)
    s = torch.sigmoid
    # Cumulative means: [2, 0, 0] and [−1, −2, −2] (the masked third token adds nothing).
    assert w_pos[0].tolist() == pytest.approx([2 * s(torch.tensor(2.0)).item() - 1, 0.0, 0.0])
    assert w_neg[0].tolist() == pytest.approx([0.0, 0.0, 0.0])
    assert w_pos[1].tolist() == pytest.approx([0.0, 0.0, 0.0])
    assert w_neg[1, :2].tolist() == pytest.approx([1 - 2 * s(torch.tensor(-1.0)).item(),
                                                   1 - 2 * s(torch.tensor(-2.0)).item()])


def head_with(weight):
    head = TokenRewardHead(2)
    with torch.no_grad():
        head.proj.weight.copy_(torch.tensor([weight]))
    return head


def test_token_weights_scale_the_loss_and_the_head_trains_only_itself():
    c = cfg(oreal_token_rm=True)
    pre = oreal_precompute(c, {}, MASK, REWARDS, GROUPS)
    # hidden [B, 1 + T, 2] (the prompt's last state, then the response's); w_t = h_{t−1}·u with u = (1, 0).
    hidden = torch.zeros(4, 4, 2)
    hidden[0, :, 0] = 2.0   # the correct sample: w = 2 everywhere, ω⁺ = 2σ(2) − 1
    hidden[1:, :, 0] = -1.0  # the wrong ones: w = −1, ω⁻ = 1 − 2σ(−1)
    hidden.requires_grad_(True)
    head = head_with([1.0, 0.0])
    lp = LP.clone().requires_grad_(True)
    loss, metrics = oreal_loss(lp, LP.clone(), torch.zeros(4, 3), MASK, ctx(c, pre, hidden, {TOKEN_RM: head}))
    wp, wn = 2 * torch.sigmoid(torch.tensor(2.0)).item() - 1, 1 - 2 * torch.sigmoid(torch.tensor(-1.0)).item()
    neg_coef = 0.5 * (2 / 3) / 6
    assert loss.item() == pytest.approx(1.0 * wp * 1.5 + neg_coef * wn * 6, rel=1e-5)
    assert metrics["oreal/pos_weight_mean"] == pytest.approx(wp, rel=1e-5)
    aux, aux_metrics = token_rm_loss(ctx(c, pre, hidden, {TOKEN_RM: head}), MASK)
    # Sequence logits 2, −1, −1, −1 against labels 1, 0, 0, 0; each sequence weighs 1/4.
    bce = [math.log1p(math.exp(-2.0))] + [math.log1p(math.exp(-1.0))] * 3
    assert aux.item() == pytest.approx(sum(bce) / 4, rel=1e-5)
    assert aux_metrics["oreal/rm_acc"] == 1.0
    (loss + aux).backward()
    assert hidden.grad is None or torch.all(hidden.grad == 0)  # the head never trains the policy
    assert head.proj.weight.grad is not None and bool(head.proj.weight.grad.abs().sum() > 0)


def test_the_head_runs_once_per_micro_batch_and_its_scores_still_train_it():
    # The objective's forward of the head is reused by the aux loss on the same LossContext: one call, and
    # the aux loss's gradient equals the one from a fresh forward of the head.
    c = cfg(oreal_token_rm=True)
    pre = oreal_precompute(c, {}, MASK, REWARDS, GROUPS)
    hidden = torch.randn(4, 4, 2, generator=torch.Generator().manual_seed(0))
    head = head_with([0.3, -0.2])
    calls = []
    head.register_forward_hook(lambda *_: calls.append(1))
    one = ctx(c, dict(pre), hidden, {TOKEN_RM: head})
    oreal_loss(LP.clone().requires_grad_(True), LP.clone(), torch.zeros(4, 3), MASK, one)
    aux, _ = token_rm_loss(one, MASK)
    assert len(calls) == 1
    aux.backward()
    shared = head.proj.weight.grad.clone()
    head.zero_grad()
    fresh, _ = token_rm_loss(ctx(c, dict(pre), hidden, {TOKEN_RM: head}), MASK)  # no objective before: own forward
    fresh.backward()
    assert len(calls) == 2 and fresh.item() == pytest.approx(aux.item())
    assert torch.allclose(head.proj.weight.grad, shared) and bool(shared.abs().sum() > 0)


def test_zero_initialized_head_gives_no_policy_gradient_until_it_learns():
    c = cfg(oreal_token_rm=True)
    pre = oreal_precompute(c, {}, MASK, REWARDS, GROUPS)
    head, hidden = TokenRewardHead(2), torch.randn(4, 4, 2)
    lp = LP.clone().requires_grad_(True)
    loss, _ = oreal_loss(lp, LP.clone(), torch.zeros(4, 3), MASK, ctx(c, pre, hidden, {TOKEN_RM: head}))
    loss.backward()
    assert torch.all(lp.grad == 0)
    aux, _ = token_rm_loss(ctx(c, pre, hidden, {TOKEN_RM: head}), MASK)
    assert aux.item() == pytest.approx(math.log(2.0))


def tiny_rollout(tiny_model_dir):
    """The tiny model and two prompts × 4 samples of unequal lengths: k = 2 and k = 1 correct."""
    from anabranch.config import ModelConfig
    from anabranch.models.loading import load_model
    from anabranch.rollout.base import Rollout

    model = load_model(ModelConfig(path=tiny_model_dir), torch.device("cpu"), trainable=True)
    torch.manual_seed(3)
    b, w = 8, 5
    lengths = torch.tensor([5, 2, 4, 3, 5, 1, 3, 4])
    response_mask = (torch.arange(w)[None] < lengths[:, None]).long()
    ro = Rollout(prompt_ids=torch.randint(3, 60, (2, 3)).repeat_interleave(4, 0),
                 prompt_mask=torch.ones(b, 3, dtype=torch.long),
                 response_ids=torch.randint(3, 60, (b, w)) * response_mask, response_mask=response_mask,
                 group_index=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), prompts=["a", "b"], completions=[""] * b,
                 truncated=torch.zeros(b, dtype=torch.bool))
    return model, ro, torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0])


def update(model, ro, rewards, c, lr=0.0, modules=None, **kw):
    params = list(model.parameters()) + [p for mod in (modules or {}).values() for p in mod.parameters()]
    opt = torch.optim.SGD(params, lr=lr)
    opt.zero_grad()
    metrics = policy_update(model, opt, ro, torch.zeros(ro.response_ids.shape), rewards, resolve_algorithm(c),
                            grad_clip=0.0, temperature=1.0, max_response_len=ro.response_ids.shape[1],
                            modules=modules, **{"micro_batch_size": 8, **kw})
    return metrics, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_micro_batch_splits_give_the_single_pass_gradient(tiny_model_dir):
    # With the token head on (the path without it is the same code with ω = 1): the coefficients and the head's
    # 1/N come from the whole batch, so any split sums to the single pass.
    model, ro, rewards = tiny_rollout(tiny_model_dir)
    c = cfg(kl_coef=0.0, oreal_token_rm=True)
    torch.manual_seed(0)
    modules = {TOKEN_RM: TokenRewardHead(model.config.hidden_size)}
    with torch.no_grad():  # a head that has learned something, so that the weights are not all 0
        modules[TOKEN_RM].proj.weight.normal_(0.0, 1.0)
    whole, g_whole = update(model, ro, rewards, c, modules=modules)
    assert whole["oreal/pos_token_frac"] > 0 and g_whole.abs().sum() > 0
    assert whole["oreal/pos_weight_mean"] + whole["oreal/neg_weight_mean"] > 0  # some tokens weighted
    for kw in ({"micro_batch_size": 3}, {"micro_batch_tokens": 12}):
        split, g = update(model, ro, rewards, c, modules=modules, **kw)
        assert split["micro_batches"] > 1, kw
        assert torch.allclose(g, g_whole, rtol=1e-4, atol=1e-7), kw
        assert split["loss"] == pytest.approx(whole["loss"], rel=1e-5), kw


def test_updates_clone_the_correct_samples_and_push_down_the_wrong_ones(tiny_model_dir):
    model, ro, rewards = tiny_rollout(tiny_model_dir)
    c = cfg(kl_coef=0.0)
    mask = ro.response_mask.float()

    def seq_log_probs():
        return (no_grad_log_probs(model, ro, 8, 1.0) * mask).sum(-1)

    before = seq_log_probs()
    for _ in range(5):
        update(model, ro, rewards, c, lr=0.05)
    delta = seq_log_probs() - before
    correct = rewards > 0.5
    # Both groups have a correct sample: every correct sample became likelier, every wrong one less likely.
    assert torch.all(delta[correct] > 0), delta
    assert torch.all(delta[~correct] < 0), delta


@pytest.mark.parametrize("kw, match", [
    (dict(ppo_epochs=2), "ppo_epochs"),
    (dict(loss_agg_mode="seq-mean-token-mean"), "loss_agg_mode"),
    (dict(kl_coef=0.1, kl_in="reward"), "kl_in=loss"),
    (dict(tis_cap=2.0), "never reads the advantages"),
    (dict(oreal_neg_weight=-1.0), "oreal_neg_weight"),
    (dict(oreal_neg_weight=float("inf")), "oreal_neg_weight"),
    (dict(oreal_token_rm=True, oreal_token_rm_lr_multiplier=0.0), "lr_multiplier"),
])
def test_bad_settings_are_refused_at_resolution(kw, match):
    with pytest.raises(ConfigError, match=match):
        resolve_algorithm(cfg(**kw))


def test_plain_bc_with_dynamic_sampling_is_refused_as_it_would_drop_the_groups_bc_clones():
    # Why: plain BC (a_i = 1) gives an all-correct group's rows a cloning weight; with a_i = A_i it is 0, so only
    # plain BC loses something when dynamic sampling drops that group (rewards all equal) before the loss.
    rewards, groups, mask = torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1]), torch.ones(4, 2)
    plain = oreal_precompute(cfg(oreal_pos_mult_adv=False), {}, mask, rewards, groups)["oreal_coef"]
    mult = oreal_precompute(cfg(), {}, mask, rewards, groups)["oreal_coef"]
    assert plain[:2].tolist() == pytest.approx([1 / 6, 1 / 6]) and mult[:2].tolist() == [0.0, 0.0]  # T+ = 6 tokens
    with pytest.raises(ConfigError, match="oreal_pos_mult_adv=false with algorithm.dynamic_sampling=true.*drops"):
        resolve_algorithm(cfg(oreal_pos_mult_adv=False, dynamic_sampling=True))
    with pytest.raises(ConfigError, match="oreal_pos_mult_adv=false with algorithm.dynamic_sampling=true"):
        load_config(None, ["algorithm.name=oreal", "algorithm.oreal_pos_mult_adv=false",
                           "algorithm.dynamic_sampling=true"])
    # Either alone is accepted: A-weighted cloning gives all-correct groups nothing to lose.
    resolve_algorithm(cfg(dynamic_sampling=True))
    resolve_algorithm(cfg(oreal_pos_mult_adv=False))


def test_recipe_needs_and_head():
    algo = resolve_algorithm(load_config(None, ["algorithm.name=oreal"]).algorithm)
    assert algo.cfg.advantage == "rloo" and algo.cfg.loss_agg_mode == "token-mean"
    assert algo.cfg.kl_coef == 0.01 and algo.cfg.kl_in == "loss" and algo.cfg.kl_estimator == "k3"
    assert "hidden" not in algo.needs and algo.module_factories == {}
    with_head = resolve_algorithm(load_config(None, ["algorithm.name=oreal", "algorithm.oreal_token_rm=true"]).algorithm)
    assert "hidden" in with_head.needs and TOKEN_RM in with_head.module_factories
    # Off by default: the default algorithm has no OREAL term.
    assert resolve_algorithm(AlgorithmConfig()).precompute is None


@pytest.mark.parametrize("key, value", [("oreal_neg_weight", 1.0), ("oreal_pos_mult_adv", False),
                                        ("oreal_token_rm", True)])
def test_keys_without_oreal_are_refused(key, value):
    with pytest.raises(ConfigError, match="algorithm.loss=oreal"):
        load_config(None, [f"algorithm.{key}={value}"])
    with pytest.raises(ConfigError, match="algorithm.loss=oreal"):  # built in code: train()'s check_whole_config
        check_whole_config(Config(algorithm=AlgorithmConfig(name="grpo", advantage="grpo", loss="ppo_clip",
                                                            **{key: value})))
    with pytest.raises(ConfigError, match="oreal_token_rm=true"):
        load_config(None, ["algorithm.name=oreal", "algorithm.oreal_token_rm_lr_multiplier=2.0"])
    with pytest.raises(ConfigError, match="oreal_token_rm=true"):
        check_whole_config(Config(algorithm=AlgorithmConfig(name="oreal", oreal_token_rm_lr_multiplier=2.0)))


def even_first_char(prompts, completions, **_):
    """About half of a random model's replies start with a character of even code point: a dense 0/1 label."""
    return [float(len(str(c)) > 0 and ord(str(c)[0]) % 2 == 0) for c in completions]


def test_two_step_run_with_the_token_head_on_the_tiny_model(tiny_model_dir, write_jsonl, tmp_path):
    overrides = {"algorithm.name": "oreal", "algorithm.oreal_token_rm": "true", "trainer.steps": 2,
                 "trainer.eval_before": False, "trainer.eval_after": False, "rollout.n": 4,
                 "trainer.micro_batch_size": 6, "reward.functions": "[test_oreal:even_first_char]",
                 "reward.isolation": "none"}
    result = train(load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path, **overrides)))
    assert len(result.history) == 2
    for m in result.history:
        assert math.isfinite(m["loss"]) and m["skipped_updates"] == 0
        assert math.isfinite(m["oreal/rm_bce"]) and 0 <= m["oreal/rm_acc"] <= 1
    # The zero-initialized head starts at BCE = log 2 and learns from the first step.
    assert result.history[0]["oreal/rm_bce"] == pytest.approx(math.log(2.0), rel=1e-4)
