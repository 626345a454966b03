"""SIREN (Jiang et al. 2025): the top-p entropy and its gradient against hand computations, the peak-entropy
mask, the self-anchored loss and the direction it moves the entropy, the anchor's state, nothing changes
when it is off, its config errors, the chunked head against a full softmax, and a short training run."""

import math

import pytest
import torch

from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.algorithms.siren import SirenAnchor, peak_entropy_mask
from anabranch.config import AlgorithmConfig, ConfigError
from anabranch.models.chunked_logprobs import nucleus_mask, top_p_entropy
from test_lp_reg import _batch as lp_reg_batch
from test_lp_reg import model  # noqa: F401  (the tiny model fixture, shared)

PROBS = [0.5, 0.3, 0.15, 0.05]


def _h(ps):
    """Entropy of ``ps`` renormalized, by hand."""
    s = sum(ps)
    return -sum(p / s * math.log(p / s) for p in ps)


@pytest.mark.parametrize("top_p,nucleus", [(0.4, [0.5]), (0.7, [0.5, 0.3]), (0.85, [0.5, 0.3, 0.15]),
                                           (0.97, PROBS), (1.0, PROBS)])
def test_top_p_entropy_of_hand_made_logits(top_p, nucleus):
    # Shuffled vocabulary order, logits scaled by 2 and a temperature of 2: the same distribution.
    order = [2, 0, 3, 1]
    logits = 2 * torch.log(torch.tensor([[PROBS[i] for i in order]], dtype=torch.float64))
    keep = nucleus_mask(logits * 0.5, top_p)
    assert keep[0].tolist() == [PROBS[i] in nucleus for i in order]
    assert top_p_entropy(logits, top_p, inv_temp=0.5).item() == pytest.approx(_h(nucleus), abs=1e-6)


def test_top_p_entropy_gradient_matches_the_renormalized_softmax_and_is_zero_outside():
    torch.manual_seed(0)
    z = torch.randn(3, 4, 11, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 4, dtype=torch.float64)
    (top_p_entropy(z, 0.6) * g).sum().backward()
    keep = nucleus_mask(z.detach(), 0.6)
    # Reference: autograd through a softmax over the kept logits only (the mask held constant).
    zr = z.detach().clone().requires_grad_(True)
    q = torch.softmax(zr.masked_fill(~keep, float("-inf")), -1)
    ref = -(torch.where(keep, q * torch.log(q.clamp_min(1e-300)), torch.zeros_like(q))).sum(-1)
    (ref * g).sum().backward()
    assert torch.allclose(top_p_entropy(z.detach(), 0.6), ref.detach(), atol=1e-10)
    assert torch.allclose(z.grad, zr.grad, atol=1e-10)
    assert (z.grad[~keep] == 0).all() and (z.grad[keep] != 0).any()
    assert (keep.sum(-1) < 11).all()  # the nucleus really cut tokens here


def test_peak_entropy_mask_on_a_hand_made_matrix():
    ent = torch.tensor([[0.1, 0.5, 0.9, 0.3, 0.7],
                        [2.0, 1.0, 3.0, 9.0, 9.0],
                        [4.0, 4.0, 4.0, 4.0, 4.0],
                        [1.0, 2.0, 3.0, 4.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.float)
    # Row 0: the 0.8-quantile of {.1,.3,.5,.7,.9} is .7 + .2·.2 = .74 → only .9; row 1 over its three
    # response tokens {1,2,3}: 2 + .6·1 = 2.6 → only 3 (the padded 9s never count); row 2 all tied: none
    # is strictly above; row 3 has no response token.
    assert peak_entropy_mask(ent, mask, 0.2).tolist() == [
        [False, False, True, False, False], [False, False, True, False, False], [False] * 5, [False] * 5]
    # ρ = 0.5: the median .5 of row 0 → .7 and .9; row 1: median 2 → 3.
    assert peak_entropy_mask(ent, mask, 0.5)[:2].tolist() == [
        [False, False, True, False, True], [False, False, True, False, False]]


def _pass(anchor, coef=0.5, peak_frac=0.5, total=4.0):
    state = SirenAnchor(coef, peak_frac=peak_frac)
    state.value = anchor
    return state, state.begin(total)


def test_loss_value_by_hand_and_gradient_sign_wrt_the_entropy():
    ent = torch.tensor([[0.1, 0.5, 0.9, 0.3, 0.7], [2.0, 1.0, 3.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.float)
    # ρ = 0.5 keeps {.7,.9} (mean .8) and {3} (mean 3): H̄ = 1.9. Two of the batch's 4 responses.
    _, p = _pass(anchor=1.0)
    loss, metrics = p.loss(ent, mask, torch.tensor([0, 1]))
    assert loss.item() == pytest.approx(0.5 * (2 / 4) * (1.9 - 1.0) ** 2)
    assert metrics["siren/masked_frac"] == pytest.approx(3 / 8)
    assert metrics["siren/entropy_top_p"] == pytest.approx((2.5 + 6.0) / 8)
    loss.backward()
    # ∂/∂H_t = coef·(n_b/n)·2(H̄ − a)·(1/2)·(1/|kept_i|) on kept tokens, 0 elsewhere.
    expect = torch.zeros(2, 5)
    expect[0, 2] = expect[0, 4] = 0.5 * 0.5 * 2 * 0.9 * 0.5 * 0.5
    expect[1, 2] = 0.5 * 0.5 * 2 * 0.9 * 0.5
    assert torch.allclose(ent.grad, expect)
    # Below the anchor the gradient changes sign: descent raises the entropy.
    ent.grad = None
    _pass(anchor=5.0)[1].loss(ent, mask, torch.tensor([0, 1]))[0].backward()
    assert (ent.grad[expect > 0] < 0).all() and (ent.grad[expect == 0] == 0).all()


@pytest.mark.parametrize("anchor_shift,direction", [(-0.3, -1), (0.3, 1)])
def test_a_descent_step_on_the_logits_moves_the_selected_top_p_entropy_toward_the_anchor(anchor_shift, direction):
    torch.manual_seed(1)
    logits = (3 * torch.randn(2, 6, 16)).requires_grad_(True)
    mask = torch.ones(2, 6)
    ent = top_p_entropy(logits, 0.8)
    sel = peak_entropy_mask(ent, mask, 0.5)
    h_bar = ((ent * sel).sum(-1) / sel.sum(-1)).mean().item()
    _, p = _pass(anchor=h_bar + anchor_shift, total=2.0)
    p.loss(ent, mask, torch.tensor([0, 1]))[0].backward()
    with torch.no_grad():
        after = top_p_entropy(logits - 1.0 * logits.grad, 0.8)
    h_after = ((after * sel).sum(-1) / sel.sum(-1)).mean().item()
    assert direction * (h_after - h_bar) > 1e-4


def test_anchor_is_set_from_the_first_step_then_fixed_or_an_ema():
    ent = torch.tensor([[0.1, 0.5, 0.9, 0.3, 0.7], [2.0, 1.0, 3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.float)
    state = SirenAnchor(0.5, peak_frac=0.5)
    p = state.begin(2.0)
    loss, _ = p.loss(ent, mask, torch.tensor([0, 1]))
    assert loss.item() == 0.0  # no anchor yet: no term on the first step
    p.loss(ent + 10, mask, torch.tensor([1, 0]))  # a second epoch: the rows' first forward counts
    out = p.finish()
    assert state.value == pytest.approx(1.9) and out["siren/anchor"] == pytest.approx(1.9)
    assert out["siren/active"] == 0.0
    p = state.begin(2.0)
    p.loss(ent + 1, mask, torch.tensor([0, 1]))
    assert p.finish()["siren/batch_entropy"] == pytest.approx(2.9) and state.value == pytest.approx(1.9)
    ema = SirenAnchor(0.5, peak_frac=0.5, anchor="ema", decay=0.75)
    ema.load_state_dict({"value": 1.9, "steps": 1})
    p = ema.begin(2.0)
    p.loss(ent + 1, mask, torch.tensor([0, 1]))
    p.finish()
    assert ema.value == pytest.approx(0.75 * 1.9 + 0.25 * 2.9)
    assert ema.state_dict() == {"value": pytest.approx(2.15), "steps": 2}


def _batch(vocab):
    return lp_reg_batch(vocab, response_len=6)


def test_chunked_head_equals_an_unchunked_reference_with_gradients(model):
    from anabranch.models.logprobs import position_ids_from_mask, response_forward

    ro, _, _ = _batch(model.config.vocab_size)
    ids, mask = ro.input_ids, ro.attention_mask
    grads, outs = [], []
    for lean in (True, False):  # lean: hidden states, head applied 1 row at a time under checkpointing
        model.zero_grad()
        fo = response_forward(model, ids, mask, 6, 0.8, lean=lean, chunk_rows=1, siren_top_p=0.7)
        fo.top_p_entropy.sum().backward()
        outs.append(fo.top_p_entropy.detach())
        grads.append(model.model.layers[0].mlp.up_proj.weight.grad.clone())
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
        probs = torch.softmax(logits[:, -7:-1].double() / 0.8, -1)
    # Reference: sort the full distribution of each position, cut the nucleus, renormalize.
    ref = torch.zeros(4, 6, dtype=torch.float64)
    for i in range(4):
        for t in range(6):
            srt = torch.sort(probs[i, t], descending=True).values.tolist()
            kept, mass = [], 0.0
            for p in srt:
                if mass >= 0.7:
                    break
                kept.append(p)
                mass += p
            ref[i, t] = _h(kept)
    assert torch.allclose(outs[0].double(), ref, atol=1e-5) and torch.allclose(outs[1].double(), ref, atol=1e-5)
    assert torch.allclose(grads[0], grads[1], atol=1e-6) and grads[0].abs().sum() > 0
    model.zero_grad()
    assert response_forward(model, ids, mask, 6, 0.8).top_p_entropy is None


def _update(model, cfg, algo=None):
    from anabranch.trainer.step import policy_update

    ro, adv, rewards = _batch(model.config.vocab_size)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    algo = algo or resolve_algorithm(cfg)
    metrics = policy_update(model, opt, ro, adv[:, None].expand(4, 6).clone(), rewards, algo,
                            micro_batch_size=2, grad_clip=0.0, temperature=1.0, max_response_len=6)
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    return metrics, after


def test_off_by_default_is_bit_identical_and_on_acts_once_anchored(model, monkeypatch):
    import anabranch.models.logprobs as logprobs

    assert AlgorithmConfig().siren_coef == 0 and resolve_algorithm(AlgorithmConfig(name="grpo")).siren is None
    off_metrics, off_weights = _update(model, AlgorithmConfig(name="grpo"))
    assert not any(k.startswith("siren/") for k in off_metrics)
    algo = resolve_algorithm(AlgorithmConfig(name="grpo", siren_coef=50.0, siren_peak_frac=0.5))
    # First step: the anchor is measured, no term: the same loss and weights, bit for bit.
    first, first_weights = _update(model, None, algo)
    assert first["loss"] == off_metrics["loss"]
    assert all(torch.equal(off_weights[n], first_weights[n]) for n in off_weights)
    assert first["siren/active"] == 0.0 and 0 < first["siren/masked_frac"] < 1
    assert algo.siren.value == pytest.approx(first["siren/anchor"]) and first["siren/entropy_top_p"] > 0
    # Anchored below the current value: the term is positive and the weights move differently.
    algo.siren.value = first["siren/anchor"] - 1.0
    second, second_weights = _update(model, None, algo)
    assert second["siren/active"] == 1.0 and second["loss"] > off_metrics["loss"]
    assert any(not torch.equal(off_weights[n], second_weights[n]) for n in off_weights)
    # Off never runs the extra head pass.
    monkeypatch.setattr(logprobs, "chunked_top_p_entropy", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    assert _update(model, AlgorithmConfig(name="grpo"))[0]["loss"] == off_metrics["loss"]


@pytest.mark.parametrize("key,value", [("siren_coef", -1.0), ("siren_coef", float("nan")), ("siren_top_p", 0.0),
                                       ("siren_top_p", 1.5), ("siren_peak_frac", 0.0), ("siren_peak_frac", 1.2),
                                       ("siren_anchor", "running"), ("siren_anchor_decay", 1.0),
                                       ("siren_anchor_decay", -0.1)])
def test_bad_values_are_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=f"algorithm.{key}"):
        resolve_algorithm(AlgorithmConfig(name="grpo", **{"siren_coef": 0.005, key: value}))


def test_knobs_without_siren_are_refused_and_zero_advantage_rows_kept_when_on(tiny_model_dir):
    from anabranch import load_config

    base = [f"model.path={tiny_model_dir}"]
    with pytest.raises(ConfigError, match="algorithm.siren_top_p"):
        load_config(None, base + ["algorithm.siren_top_p=0.9"])
    with pytest.raises(ConfigError, match="algorithm.siren_anchor_decay"):
        load_config(None, base + ["algorithm.siren_coef=0.01", "algorithm.siren_anchor_decay=0.5"])
    load_config(None, base + ["algorithm.siren_coef=0.01", "algorithm.siren_anchor=ema",
                              "algorithm.siren_anchor_decay=0.5"])
    assert not resolve_algorithm(AlgorithmConfig(name="grpo", siren_coef=0.01)).inert_at_zero_advantage


def test_short_training_run_logs_siren_and_checkpoints_the_anchor(tiny_model_dir, write_jsonl, tmp_path):
    from pathlib import Path

    from anabranch import load_config, train

    data = write_jsonl([{"prompt": f"Q{i}: say seven", "answer": "7"} for i in range(16)])
    over = {"model.path": tiny_model_dir, "task.name": "file", "task.path": data, "task.eval_size": 4,
            "rollout.n": 4, "rollout.prompts_per_step": 2, "rollout.max_new_tokens": 5, "trainer.steps": 3,
            "trainer.lr": 1e-2, "trainer.output_dir": str(tmp_path), "trainer.run_name": "siren",
            "trainer.progress": False, "trainer.save_every": 3,
            "trainer.micro_batch_size": 8, "trainer.device": "cpu", "trainer.eval_before": False,
            "algorithm.siren_coef": 1.0, "algorithm.siren_top_p": 0.9}
    result = train(load_config(None, [f"{k}={v}" for k, v in over.items()]))
    hist = [m for m in result.history if "siren/entropy_top_p" in m]
    assert len(hist) == 3
    for key in ("siren/entropy_top_p", "siren/masked_frac", "siren/anchor", "loss"):
        assert all(math.isfinite(m[key]) for m in hist), key
    assert [m["siren/active"] for m in hist] == [0.0, 1.0, 1.0]
    assert hist[1]["siren/anchor"] == hist[2]["siren/anchor"] == hist[0]["siren/anchor"]  # fixed ("initial")
    state = torch.load(Path(result.run_dir) / "checkpoints" / "step-000003" / "trainer_state.pt",
                       weights_only=False, map_location="cpu")
    assert state["stateful"]["siren"] == {"value": pytest.approx(hist[0]["siren/anchor"]), "steps": 3}


def test_top_p_entropy_is_finite_with_masked_out_logits():
    """A −inf logit (a banned token) is outside every nucleus: value and gradient stay finite."""
    from anabranch.models.chunked_logprobs import top_p_entropy

    z = torch.tensor([[[2.0, 1.0, 0.0, float("-inf")]]], requires_grad=True)
    h = top_p_entropy(z, 0.9, 1.0)
    h.sum().backward()
    # π ≈ [0.665, 0.245, 0.090, 0]: the two first reach 0.91 ≥ 0.9, so the nucleus is {0, 1}
    q = torch.softmax(torch.tensor([2.0, 1.0]), -1)
    assert h.item() == pytest.approx(float(-(q * q.log()).sum()), rel=1e-5)
    assert torch.isfinite(z.grad).all() and z.grad[0, 0, 3] == 0


def _sorted_nucleus(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus by a full sort of every position (the definition, independent of the top-k path)."""
    p = torch.softmax(z.double(), -1)
    srt = torch.sort(p, -1, descending=True).values
    k = ((srt.cumsum(-1) - srt) < top_p).sum(-1, keepdim=True).clamp(min=1)
    return p >= srt.gather(-1, k - 1)


@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])  # flat rows need the full sort, peaked ones do not
def test_nucleus_mask_equals_a_full_sort_also_past_the_top_k(monkeypatch, scale):
    import anabranch.models.chunked_logprobs as cl
    monkeypatch.setattr(cl, "_NUCLEUS_TOPK", 8)
    torch.manual_seed(1)
    z = torch.randn(6, 5, 300, dtype=torch.float64) * scale
    z[0, 0] = 0.0  # all tied: every token is in the nucleus
    for top_p in (0.3, 0.9):
        keep = nucleus_mask(z, top_p)
        assert torch.equal(keep, _sorted_nucleus(z, top_p))
        if scale < 1:
            assert (keep.sum(-1) > 8).all()  # the fall-back sort decided these


def test_the_checkpointed_backward_reuses_the_forward_nucleus(monkeypatch):
    import anabranch.models.chunked_logprobs as cl
    calls = []
    real = cl.nucleus_threshold
    monkeypatch.setattr(cl, "nucleus_threshold", lambda p, top_p: calls.append(p.shape) or real(p, top_p))
    torch.manual_seed(2)
    head = torch.nn.Linear(8, 50)
    h = torch.randn(5, 3, 8, requires_grad=True)
    ent = cl.chunked_top_p_entropy(h, head, 0.7, chunk_rows=2)
    assert len(calls) == 3  # one search per chunk in the forward
    ent.sum().backward()
    assert len(calls) == 3  # the recomputation reused them
    h2 = h.detach().clone().requires_grad_(True)
    ref = top_p_entropy(head(h2), 0.7)
    ref.sum().backward()
    assert torch.allclose(ent, ref, atol=1e-6) and torch.allclose(h.grad, h2.grad, atol=1e-6)
