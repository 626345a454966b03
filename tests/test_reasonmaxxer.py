"""ReasonMaxxer (Akgül et al. 2026, "Rethinking RL for LLM Reasoning: It's Sparse Policy Selection, Not Capability
Learning", arXiv 2605.06241): the entropy gate and the labels by hand, the loss and its gradient by hand, gradient
only at gated tokens, one step's direction, the reference entropies against a direct forward, refusals, and a
short run on the tiny model; the gate and labels over the whole batch (micro-batch splits give the same
gradient; the overlong filter's rows are left out of the gate), the unlikelihood's gradient at π ≈ 1."""

import dataclasses
import math
from functools import partial

import pytest
import torch

from anabranch import load_config, train
from anabranch.algorithms import resolve_algorithm
from anabranch.algorithms.aggregation import aggregate
from anabranch.algorithms.overlong import filter_overlong
from anabranch.algorithms.reasonmaxxer import (contrast_labels, decision_gate, reasonmaxxer_loss,
                                              reasonmaxxer_precompute)
from anabranch.config import AlgorithmConfig, ConfigError
from anabranch.trainer.step import LossContext, policy_update
from test_train_e2e import digit_task, tiny_overrides


def cfg(**kw):
    return dataclasses.replace(AlgorithmConfig(), **{**dict(name="reasonmaxxer", advantage="grpo",
                                                           loss="reasonmaxxer"), **kw})


def ctx(c, rewards, groups, gate):
    return LossContext(cfg=c, aggregate=partial(aggregate, mode="token-mean"), rewards=rewards, group_index=groups,
                       extras={"reasonmaxxer_gate": gate, "reasonmaxxer_label": contrast_labels(rewards, groups)})


# Seven response tokens (one masked, whose entropy 9 must never be picked).
ENT = torch.tensor([[0.1, 2.0, 0.5, 3.0], [1.5, 0.2, 9.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 1.0]])


def test_gate_top_fraction_and_threshold_by_hand():
    # top 1/2 of 7 tokens: k = ceil(3.5) = 4; valid entropies sorted 3, 2, 1.5, 0.5 → cutoff 0.5.
    expected = torch.tensor([[0.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    assert torch.equal(decision_gate(ENT, MASK, 0.5), expected)
    # top 1/7: only the 3.0 (the masked 9.0 is not a response token).
    assert torch.equal(decision_gate(ENT, MASK, 1 / 7), torch.tensor([[0.0, 0, 0, 1], [0, 0, 0, 0]]))
    # an absolute threshold of 1 nat: 2.0, 3.0, 1.5.
    assert torch.equal(decision_gate(ENT, MASK, 0.5, threshold=1.0),
                       torch.tensor([[0.0, 1, 0, 1], [1, 0, 0, 0]]))


def test_one_top_fraction_helper_for_the_gate_and_the_forking_tokens():
    from anabranch.algorithms.exploration import forking_token_mask

    # 0.07·100 is 7.000000000000001 in floating point: still the top 7, not 8.
    ent = torch.arange(100.0).reshape(10, 10)
    gate = decision_gate(ent, torch.ones(10, 10), 0.07)
    assert gate.sum() == 7 and torch.all(gate.flatten()[-7:] == 1)
    assert torch.equal(forking_token_mask(ent, torch.ones(10, 10), 0.07), gate)
    # ties with the k-th are kept: top 1 of [2, 2, 1] keeps both 2s
    assert decision_gate(torch.tensor([[2.0, 2.0, 1.0]]), torch.ones(1, 3), 0.3).tolist() == [[1.0, 1.0, 0.0]]


def test_labels_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.2, 0.2])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 2])
    assert contrast_labels(rewards, groups).tolist() == [1, -1, -1, 1, 0, 0, 1, -1, -1]


def test_loss_and_gradient_by_hand():
    # One group: row 0 correct, row 1 wrong; λ = 0.5; token-mean over the 6 response tokens.
    lam = 0.5
    lp = torch.tensor([[-0.5, -1.0, -2.0], [-0.3, -1.5, -0.7]], requires_grad=True)
    gate = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
    m = torch.ones(2, 3)
    loss, metrics = reasonmaxxer_loss(lp, lp.detach(), torch.zeros(2, 3), m,
                                      ctx(cfg(reasonmaxxer_neg_weight=lam), torch.tensor([1.0, 0.0]),
                                          torch.tensor([0, 0]), gate))
    p = lambda x: math.exp(x)  # noqa: E731
    want = -((-0.5) + (-2.0) + lam * (math.log(1 - p(-1.5)) + math.log(1 - p(-0.7)))) / 6
    assert loss.item() == pytest.approx(want, rel=1e-6)
    loss.backward()
    # d/dlp of −log π is −1; of −λ·log(1 − e^lp) it is λ·p/(1 − p); ungated tokens get nothing.
    g_neg = lambda x: lam * p(x) / (1 - p(x)) / 6  # noqa: E731
    expected = torch.tensor([[-1 / 6, 0.0, -1 / 6], [0.0, g_neg(-1.5), g_neg(-0.7)]])
    assert torch.allclose(lp.grad, expected, atol=1e-6)
    assert metrics["reasonmaxxer/gate_frac"] == pytest.approx(4 / 6)
    assert metrics["reasonmaxxer/pos_log_prob"] == pytest.approx(-1.25)


def test_all_equal_groups_and_ungated_tokens_get_no_gradient():
    lp = torch.full((4, 3), -1.0, requires_grad=True)
    gate = torch.tensor([[1.0, 1, 1], [1, 1, 1], [1, 0, 1], [0, 1, 0]])
    loss, _ = reasonmaxxer_loss(lp, lp.detach(), torch.zeros(4, 3), torch.ones(4, 3),
                                ctx(cfg(), torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1]), gate))
    loss.backward()
    assert torch.all(lp.grad[:2] == 0)            # group 0: both correct, nothing to contrast
    assert torch.all((lp.grad[2:] != 0) == (gate[2:] > 0))  # group 1: exactly the gated tokens


def test_one_step_raises_correct_and_lowers_wrong_gated_log_probs():
    # Free logits per position: a step moves only the positions whose loss term is non-zero.
    torch.manual_seed(0)
    logits = torch.randn(4, 5, 7, requires_grad=True)
    tokens = torch.randint(0, 7, (4, 5))
    gate = (torch.rand(4, 5) < 0.4).float()
    gate[:, 0] = 1.0
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 0, 0])

    def log_probs():
        return torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]

    before = log_probs().detach()
    loss, _ = reasonmaxxer_loss(log_probs(), before, torch.zeros(4, 5), torch.ones(4, 5),
                                ctx(cfg(), rewards, groups, gate))
    loss.backward()
    with torch.no_grad():
        logits -= 1.0 * logits.grad
    delta = log_probs().detach() - before
    on = gate > 0
    assert torch.all(delta[[0, 3]][on[[0, 3]]] > 0)
    assert torch.all(delta[[1, 2]][on[[1, 2]]] < 0)
    assert torch.all(delta[~on] == 0)


def test_reference_entropies_and_gate_match_a_direct_forward(tiny_model_dir):
    from anabranch.config import ModelConfig
    from anabranch.models.loading import load_model
    from anabranch.trainer.advantage_pass import compute_advantages, rollout_forward
    from test_progrpo import two_group_rollout

    model, ro, mask = two_group_rollout(tiny_model_dir)
    ref = load_model(ModelConfig(path=tiny_model_dir), torch.device("cpu"), trainable=False)
    with torch.no_grad():  # the policy moves away from the reference: the gate must read the reference
        for p_ in model.parameters():
            p_.add_(0.05 * torch.randn_like(p_))
        logits = ref(input_ids=ro.input_ids, attention_mask=ro.attention_mask).logits
    width = ro.response_ids.shape[1]
    logp = torch.log_softmax(logits[:, -width - 1:-1].float(), -1)
    direct = -(logp.exp() * logp).sum(-1)
    out = {}
    rollout_forward(ref, ro, 4, 1.0, entropy_out=out)
    assert torch.allclose(out["entropy"] * mask, direct * mask, atol=1e-4)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    c = cfg(reasonmaxxer_top_frac=0.3)
    algo = resolve_algorithm(c)
    adv = compute_advantages(algo, model, ro, rewards, micro_batch_size=4, temperature=1.0, ref_model=ref)
    assert torch.allclose(adv.precomputed["ref_entropy"] * mask, direct * mask, atol=1e-4)
    hooked = algo.precompute(algo.cfg, adv.precomputed, mask, rewards, ro.group_index)
    assert torch.equal(hooked["reasonmaxxer_gate"], decision_gate(adv.precomputed["ref_entropy"], mask, 0.3))
    assert hooked["reasonmaxxer_label"].tolist() == [1, -1, 1, -1, 1, -1]
    # The default path computes no entropy.
    base = compute_advantages(resolve_algorithm(AlgorithmConfig()), model, ro, rewards, micro_batch_size=4,
                              temperature=1.0)
    assert "ref_entropy" not in base.precomputed and "ref_log_prob" not in base.precomputed
    # With a KL reference, the reference pass still computes no entropy.
    kl = compute_advantages(resolve_algorithm(AlgorithmConfig(kl_coef=0.1)), model, ro, rewards, micro_batch_size=4,
                            temperature=1.0, ref_model=ref)
    assert "ref_log_prob" in kl.precomputed and "ref_entropy" not in kl.precomputed


def test_recipe_and_needs():
    algo = resolve_algorithm(load_config(None, ["algorithm.name=reasonmaxxer"]).algorithm)
    assert algo.cfg.loss == "reasonmaxxer" and algo.cfg.advantage == "grpo"
    assert {"ref_log_prob", "ref_entropy"} <= algo.needs and "whole_groups" not in algo.needs
    assert algo.precompute is reasonmaxxer_precompute
    default = resolve_algorithm(AlgorithmConfig())
    assert "ref_entropy" not in default.needs and default.precompute is None


@pytest.mark.parametrize("kw, match", [
    ({"reasonmaxxer_top_frac": 0.0}, "reasonmaxxer_top_frac"),
    ({"reasonmaxxer_top_frac": 1.5}, "reasonmaxxer_top_frac"),
    ({"reasonmaxxer_entropy_threshold": -1.0}, "reasonmaxxer_entropy_threshold"),
    ({"reasonmaxxer_entropy_threshold": float("nan")}, "reasonmaxxer_entropy_threshold"),
    ({"reasonmaxxer_neg_weight": -0.1}, "reasonmaxxer_neg_weight"),
    ({"reasonmaxxer_entropy_threshold": 1.0, "reasonmaxxer_top_frac": 0.1}, "set only one"),
    ({"advantage": "reinforce_pp"}, "algorithm.advantage='reinforce_pp'"),
    ({"advantage": "rloo"}, "use algorithm.advantage=grpo"),
    ({"ppo_epochs": 2}, "ppo_epochs=2"),
    ({"clip_ratio_low": 0.1}, "clip_ratio_low"),
    ({"clip_ratio_high": 0.3}, "clip_ratio_high"),
    ({"clip_ratio_c": 3.0}, "clip_ratio_c"),
    ({"norm_adv_by_std": False}, "norm_adv_by_std"),
    ({"adv_epsilon": 1e-3}, "adv_epsilon"),
    ({"ngrpo_max_reward": 2.0}, "ngrpo_max_reward"),
    ({"ace_alpha": 0.5}, "ace_alpha"),
    ({"gamma": 0.9}, "gamma"),
    ({"ref_reset_every": 5, "kl_coef": 0.1}, "ref_reset_every"),
    ({"kl_coef": 0.1, "kl_in": "reward"}, "kl_in"),
    ({"entropy_top_rho": 0.2}, "entropy_top_rho"),
    ({"tis_cap": 2.0}, "tis_cap"),
    ({"ppl_shaping_coef": 0.1}, "ppl_shaping_coef"),
])
def test_bad_settings_are_refused_at_resolution(kw, match):
    with pytest.raises(ConfigError, match=match):
        resolve_algorithm(cfg(**kw))


def test_keys_without_reasonmaxxer_are_refused_when_the_config_loads():
    # One refusal, config_checks._GATED (not a second one at resolution with another message).
    with pytest.raises(ConfigError, match="'algorithm.reasonmaxxer_neg_weight' has no effect unless algorithm.loss="):
        load_config(None, ["algorithm.reasonmaxxer_neg_weight=2.0"])
    assert load_config(None, ["algorithm.name=reasonmaxxer", "algorithm.reasonmaxxer_entropy_threshold=1.0"])


@pytest.mark.parametrize("key,value", [("reasonmaxxer_neg_weight", 2.0), ("reasonmaxxer_top_frac", 0.3),
                                       ("reasonmaxxer_entropy_threshold", 1.0)])
def test_keys_without_reasonmaxxer_are_refused_in_code_built_configs(key, value):
    # A Config built in code never passes load_config: train()'s check_whole_config refuses it the same way.
    from anabranch.algorithms.resolve import check_ranges
    from anabranch.config import Config
    from anabranch.config_checks import check_whole_config

    msg = (f"config key 'algorithm.{key}' has no effect unless algorithm.loss=reasonmaxxer "
           f"\\(algorithm.name=reasonmaxxer\\) \\(got {value}\\)")
    with pytest.raises(ConfigError, match=msg):
        check_whole_config(Config(algorithm=AlgorithmConfig(name="grpo", advantage="grpo", loss="ppo_clip",
                                                            **{key: value})))
    with pytest.raises(ConfigError, match=msg):
        load_config(None, ["algorithm.name=grpo", f"algorithm.{key}={value}"])
    check_ranges(cfg(**{key: value}))  # with the loss, accepted


def test_objective_without_its_gate_is_refused():
    with pytest.raises(RuntimeError, match="precompute"):
        reasonmaxxer_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2),
                          LossContext(cfg=cfg(), aggregate=aggregate, rewards=torch.ones(1),
                                      group_index=torch.zeros(1, dtype=torch.long)))


def test_unlikelihood_keeps_its_gradient_for_a_token_the_policy_is_sure_of():
    # A wrong token at π = e^{-1e-9} ≈ 1: the loss is capped at −log(1e-6) nats, its gradient is the cap's,
    # λ·π/(1 − π) ≈ 1e6 (token-mean over one token), not zero.
    lp = torch.tensor([[-1e-9], [-1e-9]], requires_grad=True)
    loss, _ = reasonmaxxer_loss(lp, lp.detach(), torch.zeros(2, 1), torch.tensor([[0.0], [1.0]]),
                                ctx(cfg(), torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.ones(2, 1)))
    assert loss.item() == pytest.approx(-math.log(1e-6), rel=1e-3)
    loss.backward()
    assert lp.grad[1, 0].item() == pytest.approx((1 - 1e-6) / 1e-6, rel=1e-2)
    assert lp.grad[0, 0].item() == 0.0  # masked row


def group_rollout(tiny_model_dir):
    """The tiny model and a rollout of two prompts × 4 samples of unequal lengths (policy_update tests)."""
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
    # Group 1's mean is 0.625: its rows are +, +, −, −; a split into pairs would see (1, 1): all equal.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5])
    return model, ro, rewards, torch.rand(b, w) * response_mask


def update_grads(model, ro, rewards, ent, c, **kw):
    """Run one update with a zero learning rate; return (its metrics, the gradient it left)."""
    metrics = policy_update(model, torch.optim.SGD(model.parameters(), lr=0.0), ro, torch.zeros(ro.response_ids.shape),
                            rewards, resolve_algorithm(c), grad_clip=0.0, temperature=1.0,
                            max_response_len=ro.response_ids.shape[1], **kw,
                            # the reference pass's outputs (its log-probs are not read: no KL here)
                            precomputed={"ref_entropy": ent, "ref_log_prob": torch.zeros(ent.shape)})
    return metrics, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_micro_batch_splits_give_the_single_pass_gradient(tiny_model_dir):
    model, ro, rewards, ent = group_rollout(tiny_model_dir)
    c = cfg(reasonmaxxer_top_frac=0.3, reasonmaxxer_neg_weight=0.7)
    whole, g_whole = update_grads(model, ro, rewards, ent, c, micro_batch_size=8)
    assert whole["micro_batches"] == 1 and whole["reasonmaxxer/pos_frac"] > 0 and whole["reasonmaxxer/neg_frac"] > 0
    for kw in ({"micro_batch_size": 2}, {"micro_batch_size": 4}, {"micro_batch_size": 8, "micro_batch_tokens": 20}):
        split, g = update_grads(model, ro, rewards, ent, c, **kw)
        assert split["micro_batches"] > 1 or kw["micro_batch_size"] == 8 and "micro_batch_tokens" not in kw
        assert torch.allclose(g, g_whole, rtol=1e-4, atol=1e-7), kw
        for key in ("reasonmaxxer/gate_frac", "reasonmaxxer/pos_frac", "reasonmaxxer/neg_frac", "loss"):
            assert split[key] == pytest.approx(whole[key], rel=1e-5), (kw, key)


def test_gate_is_over_the_tokens_left_after_the_overlong_filter(tiny_model_dir):
    model, ro, rewards, ent = group_rollout(tiny_model_dir)
    ent[0] = 10.0  # the truncated row's entropies are the batch's highest, but it is not trained
    ro.truncated[0] = True
    trained = filter_overlong(ro, True)
    mask = trained.trained_mask.float()
    assert mask[0].sum() == 0
    metrics, _ = update_grads(model, trained, rewards, ent, cfg(reasonmaxxer_top_frac=0.25), micro_batch_size=8)
    # 22 trained tokens: ⌈0.25·22⌉ = 6 gated among them (random entropies, no ties).
    want = decision_gate(ent, mask, 0.25)
    assert want.sum() == 6 and (want * mask).sum() == 6
    assert metrics["reasonmaxxer/gate_frac"] == pytest.approx(6 / 22)


def even_first_char(prompts, completions, **_):
    """About half of a random model's replies start with a character of even code point: a dense 0/1 label."""
    return [float(len(str(c)) > 0 and ord(str(c)[0]) % 2 == 0) for c in completions]


def test_two_step_run_on_the_tiny_model(tiny_model_dir, write_jsonl, tmp_path):
    overrides = {"algorithm.name": "reasonmaxxer", "trainer.steps": 2, "trainer.eval_before": False,
                 "trainer.eval_after": False, "rollout.n": 4, "trainer.micro_batch_size": 6,
                 "reward.functions": "[test_reasonmaxxer:even_first_char]", "reward.isolation": "none"}
    result = train(load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path, **overrides)))
    assert len(result.history) == 2
    for m in result.history:
        assert math.isfinite(m["loss"]) and m["skipped_updates"] == 0
        # about 20% of the tokens gated (ties may add a few); some of them in contrasted groups
        assert 0.15 <= m["reasonmaxxer/gate_frac"] <= 0.5
    assert any(m["reasonmaxxer/pos_frac"] > 0 and m["grad_norm"] > 0 for m in result.history)
