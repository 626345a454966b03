"""The top fraction of masked values over every data-parallel rank's batch (an exact, global threshold).

:func:`global_top_fraction_mask` is :func:`~anabranch.algorithms.exploration.top_fraction_mask` over the
union of the ranks' masked entries: the k = ⌈frac · n⌉ highest of all n entries (n summed over ranks) and
every entry tied with the k-th, each rank returning its own share of that mask. One process (``dist`` None
or a world of one) calls ``top_fraction_mask`` itself, so its result is bit-identical.

Why it is exact without gathering every rank's entries: the global k highest entries hold at most k of any
one rank's, and those are that rank's own k highest, so the k-th largest of the union of each rank's local
top k (padded to k with −inf, so every rank sends a tensor of one size) is the global k-th largest value.
The collectives: one all-reduce of the counts and one all-gather of k floats per rank (every rank must
call this, an empty mask included).
"""

from __future__ import annotations

import math

import torch

from anabranch.algorithms.exploration import top_fraction_mask, top_k_count


@torch.no_grad()
def global_top_fraction_mask(values: torch.Tensor, mask: torch.Tensor, frac: float, dist=None) -> torch.Tensor:
    """Bool [same shape as ``values``]: this rank's entries under ``mask`` that are >= the k-th largest masked
    entry over all ranks, k = ⌈frac · n⌉ with n the masked entries of all ranks (ties with it all kept).
    ``dist``: a :class:`~anabranch.trainer.distributed.Distributed`, or None for one process. A collective."""
    if dist is None or dist.world_size == 1:
        return top_fraction_mask(values, mask, frac)
    valid = mask.bool()
    picked = values.detach()[valid].float()
    n = int(dist.all_reduce_sum(torch.tensor([float(picked.numel())], dtype=torch.float64))[0].item())
    if n == 0:
        return torch.zeros_like(valid)
    k = top_k_count(frac, n)
    local = torch.full((k,), -math.inf, dtype=torch.float32)
    m = min(k, picked.numel())
    if m:  # the local top m on the values' device; only those m values move
        local[:m] = torch.topk(picked, m).values.cpu()
    cutoff = torch.topk(dist.all_gather(local), k).values[-1].to(values.device)
    return valid & (values.detach().float() >= cutoff)
