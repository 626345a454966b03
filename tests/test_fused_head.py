"""The whole-micro-batch LM head + log-prob/entropy node (models/fused_head.py) against float64
autograd through ``linear`` and ``log_softmax``: values and the gradients of h, W and b."""

import pytest
import torch

from anabranch.models.fused_head import fused_head_log_prob


def reference(h, w, b, targets, temperature, entropy_grad, w_lp, w_ent):
    h, w = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b = b.detach().double().requires_grad_() if b is not None else None
    logp = torch.log_softmax(torch.nn.functional.linear(h, w, b) / temperature, -1)
    lp = logp.gather(-1, targets[..., None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if entropy_grad else 0)
    grads = torch.autograd.grad(loss, [t for t in (h, w, b) if t is not None])
    return lp, ent, grads


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature,entropy_grad", [(1.0, False), (0.7, False), (1.0, True), (0.7, True)])
def test_values_and_gradients_match_float64(temperature, entropy_grad, bias):
    g = torch.Generator().manual_seed(0)
    B, R, H, V = 3, 5, 16, 300
    h = torch.randn(B, R, H, generator=g).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.5).requires_grad_()
    b = torch.randn(V, generator=g).requires_grad_() if bias else None
    targets = torch.randint(0, V, (B, R), generator=g)
    w_lp, w_ent = torch.randn(B, R, generator=g), torch.randn(B, R, generator=g)
    # chunk_tokens=4 does not divide B*R = 15: the last chunk is short.
    lp, ent = fused_head_log_prob(h, w, b, targets, 1.0 / temperature, True, entropy_grad, chunk_tokens=4)
    assert lp.shape == ent.shape == (B, R)
    assert ent.requires_grad == entropy_grad  # a metric unless asked for with grad
    loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if entropy_grad else 0)
    inputs = [t for t in (h, w, b) if t is not None]
    grads = torch.autograd.grad(loss, inputs)
    ref_lp, ref_ent, ref_grads = reference(h, w, b, targets, temperature, entropy_grad, w_lp, w_ent)
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5)
    assert torch.allclose(ent.double(), ref_ent, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        assert want.abs().max() > 0.1
        assert torch.allclose(got.double(), want, atol=1e-5), float((got.double() - want).abs().max())


def test_without_entropy_and_with_a_frozen_head():
    """LoRA-style: the head is frozen, only the hidden states get a gradient; no entropy asked."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 4, 8, generator=g).requires_grad_()
    w = torch.randn(50, 8, generator=g)
    targets = torch.randint(0, 50, (2, 4), generator=g)
    lp, ent = fused_head_log_prob(h, w, None, targets, 1.0, False, False, chunk_tokens=3)
    assert ent.dim() == 0
    (grad,) = torch.autograd.grad(lp.sum(), h)
    ref_lp, _, (ref_grad, _) = reference(h, w, None, targets, 1.0, False, torch.ones(2, 4), None)
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5)
    assert torch.allclose(grad.double(), ref_grad, atol=1e-5)


def test_a_second_backward_is_refused():
    h = torch.randn(1, 3, 4, requires_grad=True)
    lp, _ = fused_head_log_prob(h, torch.randn(9, 4), None, torch.tensor([[1, 2, 3]]))
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lp.sum().backward()


def test_the_trainer_uses_it_when_logits_are_kept_and_gets_the_same_update(monkeypatch):
    """chunked_response_stats with kept logits (fused) and with recomputation (per-chunk autograd)
    give the same log-probs and head/hidden gradients."""
    from anabranch.models import fused_head
    from anabranch.models.chunked_logprobs import chunked_response_stats

    calls = []
    real = fused_head._FusedHeadLogProb.apply
    monkeypatch.setattr(fused_head._FusedHeadLogProb, "apply", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(2)
    head = torch.nn.Linear(12, 70, bias=False)
    h = torch.randn(5, 6, 12, generator=g).requires_grad_()
    targets = torch.randint(0, 70, (5, 6), generator=g)
    out = {}
    for recompute in (False, True):
        head.zero_grad()
        h.grad = None
        lp, ent = chunked_response_stats(h, head, targets, 0.8, True, True, chunk_rows=2, recompute=recompute)
        (lp.sum() + 0.3 * ent.sum()).backward()
        out[recompute] = (lp.detach(), ent.detach(), h.grad.clone(), head.weight.grad.clone())
    assert calls == [1]  # only the kept-logits path went through the fused node
    for a, b in zip(out[False], out[True]):
        assert torch.allclose(a, b, atol=1e-5)


def test_under_bf16_autocast_the_matmuls_are_bf16_and_the_statistics_fp32():
    """Mixed precision: the head's matmul runs in bf16 (as F.linear would under autocast), log-probs
    stay fp32 and close to the fp32 reference, and the gradients come back in the inputs' dtypes."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 6, 32, generator=g).requires_grad_()
    w = (torch.randn(400, 32, generator=g) * 0.3).requires_grad_()
    targets = torch.randint(0, 400, (2, 6), generator=g)
    seen = []
    real_linear = torch.nn.functional.linear

    def spy(x, weight, bias=None):
        seen.append((x.dtype, weight.dtype))
        return real_linear(x, weight, bias)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.nn.functional.linear = spy
        try:
            lp, ent = fused_head_log_prob(h, w, None, targets, 1.0, True, False, chunk_tokens=5)
        finally:
            torch.nn.functional.linear = real_linear
        lp.sum().backward()
    assert seen and all(s == (torch.bfloat16, torch.bfloat16) for s in seen)
    assert lp.dtype == ent.dtype == torch.float32
    assert h.grad.dtype == w.grad.dtype == torch.float32
    ref_lp, ref_ent, (ref_gh, ref_gw) = reference(h, w, None, targets, 1.0, False, torch.ones(2, 6), None)
    # bf16 logits: about 3 significant digits; far from fp32 exactness, far closer than chance.
    assert torch.allclose(lp.double(), ref_lp, atol=0.05) and not torch.equal(lp.double(), ref_lp)
    assert torch.allclose(ent.double(), ref_ent, atol=0.05)
    assert torch.allclose(h.grad.double(), ref_gh, atol=0.05) and torch.allclose(w.grad.double(), ref_gw, atol=0.05)


def test_scratch_buffers_are_reused_and_never_shared_by_live_graphs():
    """The [N, V] buffer goes back to SCRATCH after the backward pass (or at once without grad) and
    the next call reuses its memory; graphs still waiting for their backward pass keep their own."""
    from anabranch.models.fused_head import SCRATCH

    SCRATCH.clear()
    g = torch.Generator().manual_seed(4)
    B, R, H, V = 2, 4, 8, 60
    w = (torch.randn(V, H, generator=g) * 0.5).requires_grad_()
    hs = [torch.randn(B, R, H, generator=g).requires_grad_() for _ in range(3)]
    targets = torch.randint(0, V, (B, R), generator=g)
    weights = torch.randn(B, R, generator=g)

    def grads(i):  # float64 reference gradients of (lp · weights).sum() for hs[i]
        return reference(hs[i], w, None, targets, 1.0, True, weights, torch.zeros(B, R))[2]

    # Two graphs alive at once, with a no-grad pass between them, backward in reverse order.
    lp0, _ = fused_head_log_prob(hs[0], w, None, targets, 1.0, True, True, chunk_tokens=3)
    with torch.no_grad():
        lp_ng, _ = fused_head_log_prob(hs[2], w, None, targets, 1.0, True, False, chunk_tokens=3)
    lp1, _ = fused_head_log_prob(hs[1], w, None, targets, 1.0, True, True, chunk_tokens=3)
    assert torch.allclose(lp_ng.double(), reference(hs[2], w, None, targets, 1.0, False, weights, None)[0], atol=1e-5)
    for i, lp in ((1, lp1), (0, lp0)):
        got = torch.autograd.grad((lp * weights).sum(), [hs[i], w])
        for a, b in zip(got, grads(i)):
            assert torch.allclose(a.double(), b, atol=1e-5)
    kept = SCRATCH._free["logits"]
    # The next call of the same size computes into the kept memory and is still right.
    lp2, _ = fused_head_log_prob(hs[2], w, None, targets, 1.0, True, True, chunk_tokens=3)
    assert SCRATCH._free.get("logits") is None  # handed out to the pending graph
    got = torch.autograd.grad((lp2 * weights).sum(), [hs[2], w])
    for a, b in zip(got, grads(2)):
        assert torch.allclose(a.double(), b, atol=1e-5)
    assert SCRATCH._free["logits"].data_ptr() == kept.data_ptr()
