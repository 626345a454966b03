"""ReasonMaxxer (Akgül et al. 2026, "Rethinking RL for LLM Reasoning: It's Sparse Policy Selection, Not Capability
Learning", arXiv 2605.06241): the entropy gate and the labels by hand, the loss and its gradient by hand, gradient
only at gated tokens, one step's direction, the reference entropies against a direct forward, refusals, and a
short run on the tiny model."""

import dataclasses
import math
from functools import partial

import pytest
import torch

from anabranch import load_config, train
from anabranch.algorithms import resolve_algorithm
from anabranch.algorithms.aggregation import aggregate
from anabranch.algorithms.reasonmaxxer import contrast_labels, decision_gate, reasonmaxxer_loss
from anabranch.config import AlgorithmConfig, ConfigError
from anabranch.trainer.step import LossContext
from test_train_e2e import digit_task, tiny_overrides


def cfg(**kw):
    return dataclasses.replace(AlgorithmConfig(), **{**dict(name="reasonmaxxer", advantage="grpo",
                                                           loss="reasonmaxxer"), **kw})


def ctx(c, rewards, groups, gate):
    return LossContext(cfg=c, aggregate=partial(aggregate, mode="token-mean"), rewards=rewards, group_index=groups,
                       extras={"reasonmaxxer_gate": gate})


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
    adv = compute_advantages(resolve_algorithm(c), model, ro, rewards, micro_batch_size=4, temperature=1.0,
                             ref_model=ref)
    assert torch.equal(adv.precomputed["reasonmaxxer_gate"], decision_gate(direct, mask, 0.3))
    # The default path computes no entropy and no gate.
    base = compute_advantages(resolve_algorithm(AlgorithmConfig()), model, ro, rewards, micro_batch_size=4,
                              temperature=1.0)
    assert "reasonmaxxer_gate" not in base.precomputed and "ref_log_prob" not in base.precomputed
    # With a KL reference, the reference pass still computes no entropy (its output holds no gate).
    kl = compute_advantages(resolve_algorithm(AlgorithmConfig(kl_coef=0.1)), model, ro, rewards, micro_batch_size=4,
                            temperature=1.0, ref_model=ref)
    assert "ref_log_prob" in kl.precomputed and "reasonmaxxer_gate" not in kl.precomputed


def test_recipe_and_needs():
    algo = resolve_algorithm(load_config(None, ["algorithm.name=reasonmaxxer"]).algorithm)
    assert algo.cfg.loss == "reasonmaxxer" and algo.cfg.advantage == "grpo"
    assert {"ref_log_prob", "ref_entropy", "whole_groups"} <= algo.needs
    assert "ref_entropy" not in resolve_algorithm(AlgorithmConfig()).needs


@pytest.mark.parametrize("kw, match", [
    ({"reasonmaxxer_top_frac": 0.0}, "reasonmaxxer_top_frac"),
    ({"reasonmaxxer_top_frac": 1.5}, "reasonmaxxer_top_frac"),
    ({"reasonmaxxer_entropy_threshold": -1.0}, "reasonmaxxer_entropy_threshold"),
    ({"reasonmaxxer_entropy_threshold": float("nan")}, "reasonmaxxer_entropy_threshold"),
    ({"reasonmaxxer_neg_weight": -0.1}, "reasonmaxxer_neg_weight"),
    ({"reasonmaxxer_entropy_threshold": 1.0, "reasonmaxxer_top_frac": 0.1}, "set only one"),
    ({"advantage": "reinforce_pp"}, "group advantage estimator"),
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
    with pytest.raises(ConfigError, match="reasonmaxxer_neg_weight"):
        load_config(None, ["algorithm.reasonmaxxer_neg_weight=2.0"])
    assert load_config(None, ["algorithm.name=reasonmaxxer", "algorithm.reasonmaxxer_entropy_threshold=1.0"])


def test_objective_without_its_gate_is_refused():
    with pytest.raises(RuntimeError, match="entropy gate"):
        reasonmaxxer_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2),
                          LossContext(cfg=cfg(), aggregate=aggregate, rewards=torch.ones(1),
                                      group_index=torch.zeros(1, dtype=torch.long)))


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
