"""The LM head and the response log-probabilities of a whole micro-batch as one autograd node.

Used by :func:`anabranch.models.chunked_logprobs.chunked_response_stats` when the micro-batch's
fp32 logits fit the budget and are kept for the backward pass. With ordinary autograd over
chunks of rows (``linear`` then the softmax statistics, chunk by chunk) the backward pass
computes the head's weight gradient once per chunk, a ``[V, H]`` product whose inner dimension is
only that chunk's tokens, and adds the products up: on the 2-core development CPUs that ran at
about half the speed of one product over all tokens (SmolLM2's head, 2,048 tokens in chunks of
256: 65 against 119 GFLOP/s), plus one ``[V, H]`` temporary and one addition per chunk.

Here, for hidden states ``h`` [N, H], head ``W`` [V, H] (bias ``b``), targets ``y`` [N] and
temperature ``T``:

* forward: ``Z = (h Wᵀ + b) / T`` into one [N, V] buffer (one matmul); then, a chunk of rows at a
  time and in place, ``d = Z − max Z``, ``log π(y) = d_y − log Σ_v exp d_v`` and the entropy
  ``H = log Σ_v exp d_v − ⟨p, d⟩`` with ``p = softmax(d)``; the buffer keeps ``p`` (or ``d``
  when the entropy is differentiated: ``p`` is then recomputed from it chunk by chunk);
* backward: ``G = ∂L/∂Z·(1/T)`` is written over the buffer, a chunk at a time
  (``∂ log π(y)/∂Z = onehot(y) − p``, ``∂H/∂Z = −p ⊙ (d − ⟨p, d⟩)``), then
  ``∂L/∂h = G W``, ``∂L/∂W = Gᵀ h`` and ``∂L/∂b = Σ_n G_n``: two matmuls over all N tokens.

Memory is one [N, V] fp32 buffer (what the kept chunk logits cost before) plus one chunk's
temporaries. The buffer is modified in place by the backward pass, so a second backward through
the same graph fails loudly (the saved buffer's version changed).

On CPU both (the [N, V] buffer and the chunk's ``exp``) come from :data:`SCRATCH` and go back to it
when the backward pass is done (at once for a pass without gradients): the next micro-batch and the
next step reuse them. Allocated afresh, a block that large is a new mapping whose pages the kernel
faults in and zeroes one by one (SmolLM2's W1 logits: 403 MB, about 100,000 faults, every update).
What is kept is bounded: this node runs only when the logits fit ``LOGITS_BUDGET_BYTES`` (512 MiB).
"""

from __future__ import annotations

from typing import Optional

import torch


class ScratchBuffers:
    """Large fp32 CPU buffers kept for reuse, one per role; each grows to the largest request.

    ``take`` hands the role's buffer out (it is not shared while out); ``give`` returns it. A
    buffer that is never given back (a graph dropped before its backward pass) is simply freed.
    Off the CPU (CUDA has its own caching allocator) every ``take`` allocates."""

    def __init__(self):
        self._free: dict[str, torch.Tensor] = {}

    def take(self, role: str, rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(view [rows, cols], base)``; hand ``base`` back to :meth:`give`."""
        numel = rows * cols
        base = self._free.pop(role, None) if device.type == "cpu" else None
        if base is None or base.numel() < numel:
            base = torch.empty(numel, dtype=torch.float32, device=device)
        return base[:numel].view(rows, cols), base

    def give(self, role: str, base: torch.Tensor) -> None:
        if base.device.type == "cpu":
            self._free[role] = base

    def clear(self) -> None:
        self._free.clear()


SCRATCH = ScratchBuffers()

# The softmax statistics make about nine passes over each chunk of logits (forward and backward);
# a chunk that stays in the CPU's caches between passes makes them cheaper than a 50 MB one that
# streams from memory. With SmolLM2's 49,152-token vocabulary: 16 rows. The head's forward +
# backward over W1's 2,048 tokens on the 2-core EPYC (benchmarks/fused_head_chunks.py, medians of
# 6): SmolLM2 3.09 s in 256-row chunks, 2.77 s in 42, 2.48 s in 16; tiny 1.72, 1.65, 1.56 s.
CPU_CHUNK_BYTES = 3 * 2**20


class _FusedHeadLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, targets, inv_temp: float, want_entropy: bool, entropy_grad: bool,
                chunk: int):
        dev = h.device.type
        # Under autocast (bf16/fp16 mixed precision) the head's matmuls run in the autocast dtype,
        # as F.linear would; the softmax statistics always run in fp32, in an fp32 buffer.
        mm_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else torch.promote_types(
            h.dtype, weight.dtype)
        with torch.autocast(dev, enabled=False):
            lp, ent, saved, base = _forward(h, weight, bias, targets, inv_temp, want_entropy, entropy_grad, chunk,
                                            mm_dtype)
        if any(ctx.needs_input_grad[:3]):  # a graph that will call backward (False under no_grad)
            ctx.base = base  # back to SCRATCH after the backward pass
        else:
            SCRATCH.give("logits", base)
            saved = ()
        ctx.inv_temp, ctx.chunk, ctx.has_bias, ctx.mm_dtype = inv_temp, chunk, bias is not None, mm_dtype
        ctx.entropy_grad = want_entropy and entropy_grad
        ctx.save_for_backward(h, weight, targets, *saved)
        if not ctx.entropy_grad:
            if ent is None:
                ent = lp.new_zeros(())
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, weight, targets, buf, *stats = ctx.saved_tensors
        with torch.autocast(h.device.type, enabled=False):
            chunk = ctx.chunk
            if ctx.entropy_grad:  # p is recomputed into one chunk-sized scratch
                log_total, mean_d = stats
                p_all, p_base = SCRATCH.take("exp", min(chunk, buf.shape[0]), buf.shape[1], buf.device)
            for s in range(0, buf.shape[0], chunk):
                g = buf[s:s + chunk]
                gl = g_lp[s:s + chunk, None].float()
                if ctx.entropy_grad:  # g holds d: −p ⊙ (g_lp + g_ent·(d − ⟨p, d⟩))
                    p = torch.sub(g, log_total[s:s + chunk], out=p_all[:g.shape[0]]).exp_()
                    g.sub_(mean_d[s:s + chunk]).mul_(g_ent[s:s + chunk, None].float()).add_(gl).mul_(p).neg_()
                else:  # g holds p
                    g.mul_(-gl)
                g.scatter_add_(-1, targets[s:s + chunk, None], gl)
                if ctx.inv_temp != 1.0:
                    g.mul_(ctx.inv_temp)
            grad_b = buf.sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
            G = buf if ctx.mm_dtype == torch.float32 else buf.to(ctx.mm_dtype)
            grad_h = (G @ weight.to(G.dtype)).to(h.dtype) if ctx.needs_input_grad[0] else None
            grad_w = (G.t() @ h.to(G.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
            del G, buf
            SCRATCH.give("logits", ctx.base)
            if ctx.entropy_grad:
                SCRATCH.give("exp", p_base)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _forward(h, weight, bias, targets, inv_temp, want_entropy, entropy_grad, chunk, mm_dtype):
    """The forward pass without autocast: ``(log π(y), entropy or None, tensors for the backward)``."""
    n = h.shape[0]
    entropy_grad = want_entropy and entropy_grad
    buf, base = SCRATCH.take("logits", n, weight.shape[0], h.device)
    if mm_dtype == torch.float32:
        h32, w32 = h.float(), weight.float()
        if bias is None:
            torch.mm(h32, w32.t(), out=buf)
        else:
            torch.addmm(bias.float(), h32, w32.t(), out=buf)
    else:  # half-precision matmuls, a chunk at a time, into the fp32 buffer
        w = weight.to(mm_dtype)
        b = None if bias is None else bias.to(mm_dtype)
        for s in range(0, n, chunk):
            buf[s:s + chunk] = torch.nn.functional.linear(h[s:s + chunk].to(mm_dtype), w, b)
    lp = torch.empty(n, dtype=torch.float32, device=h.device)
    ent = torch.empty(n, dtype=torch.float32, device=h.device) if want_entropy else None
    log_total = torch.empty(n, 1, dtype=torch.float32, device=h.device) if entropy_grad else None
    mean_d = torch.empty(n, 1, dtype=torch.float32, device=h.device) if entropy_grad else None
    if want_entropy:  # exp(d) of one chunk at a time, in one scratch
        e_all, e_base = SCRATCH.take("exp", min(chunk, n), weight.shape[0], h.device)
    for s in range(0, n, chunk):
        z = buf[s:s + chunk]
        if inv_temp != 1.0:
            z.mul_(inv_temp)
        m = z.amax(-1, keepdim=True)
        z_y = z.gather(-1, targets[s:s + chunk, None])
        d = z.sub_(m)
        if want_entropy:
            e = torch.exp(d, out=e_all[:d.shape[0]])
            total = e.sum(-1, keepdim=True)
            md = torch.linalg.vecdot(e, d)[:, None] / total  # ⟨p, d⟩
            lt = total.log()
            ent[s:s + chunk] = (lt - md).squeeze(-1)
            if entropy_grad:  # keep d; p is recomputed in the backward pass
                log_total[s:s + chunk], mean_d[s:s + chunk] = lt, md
            else:
                torch.div(e, total, out=z)
        else:
            total = d.exp_().sum(-1, keepdim=True)
            lt = total.log()
            z.div_(total)
        lp[s:s + chunk] = (z_y - m - lt).squeeze(-1)
    if want_entropy:
        SCRATCH.give("exp", e_base)
    return lp, ent, ((buf, log_total, mean_d) if entropy_grad else (buf,)), base


def fused_head_log_prob(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        targets: torch.Tensor, inv_temp: float = 1.0, entropy: bool = False,
                        entropy_grad: bool = False, chunk_tokens: int = 256):
    """``(log π(targets), entropy or a 0-d zero)`` [..] for hidden states [..., H] through the head.

    ``hidden`` [B, R, H] and ``targets`` [B, R] give [B, R] results; the softmax statistics run
    ``chunk_tokens`` rows of the [B·R, V] logits at a time, on CPU at most :data:`CPU_CHUNK_BYTES`
    of them."""
    shape = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    if h.device.type == "cpu":
        chunk_tokens = min(chunk_tokens, CPU_CHUNK_BYTES // (4 * weight.shape[0]))
    lp, ent = _FusedHeadLogProb.apply(h, weight, bias, targets.reshape(-1), inv_temp, entropy,
                                      entropy_grad and torch.is_grad_enabled(), max(1, chunk_tokens))
    return lp.view(shape), (ent.view(shape) if entropy else ent)
