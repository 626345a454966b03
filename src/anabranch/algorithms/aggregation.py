"""Loss aggregation shared by every objective, with veRL's four modes.

Given a per-token loss ``L[b,t]`` and response mask ``m[b,t]``:

- ``token-mean``:            Σ_bt m·L / Σ_bt m
- ``seq-mean-token-sum``:    (1/B) Σ_b Σ_t m·L
- ``seq-mean-token-mean``:   (1/B) Σ_b (Σ_t m·L / Σ_t m)
- ``seq-mean-token-sum-norm``: Σ_bt m·L / (B · T_max)   (Dr. GRPO's constant normalizer)

The denominators are those of the *whole* step batch (``total_tokens``, ``total_seqs``), not
of a micro-batch, so that gradients accumulated over micro-batches add up to the full-batch
gradient exactly. ``T_max`` is a constant (the configured max response length), not a padded
width, for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass
class BatchScale:
    """Normalizers of the full step batch; ``None`` means use the tensors passed in."""

    total_tokens: Optional[float] = None
    total_seqs: Optional[float] = None
    max_response_len: Optional[int] = None


def batch_scale(mask: torch.Tensor, max_response_len: int) -> BatchScale:
    """The one-process normalizers of a batch's loss mask [B, T]: its tokens, and its sequences with at
    least one loss token (rows emptied by overlong filtering or HPT are not sequences of the loss)."""
    mask = mask.float()
    return BatchScale(total_tokens=mask.sum().clamp(min=1.0).item(),
                      total_seqs=max(float((mask.sum(-1) > 0).sum()), 1.0), max_response_len=max_response_len)


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
              scale: BatchScale | None = None) -> torch.Tensor:
    scale = scale or BatchScale()
    mask = mask.to(loss_mat.dtype)
    total_seqs = scale.total_seqs if scale.total_seqs is not None else float(loss_mat.shape[0])
    if mode == "token-mean":
        total = scale.total_tokens if scale.total_tokens is not None else mask.sum().clamp(min=1.0)
        return (loss_mat * mask).sum() / total
    if mode == "seq-mean-token-sum":
        return (loss_mat * mask).sum() / total_seqs
    if mode == "seq-mean-token-mean":
        per_seq = (loss_mat * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.sum() / total_seqs
    if mode == "seq-mean-token-sum-norm":
        t_max = scale.max_response_len if scale.max_response_len is not None else loss_mat.shape[-1]
        return (loss_mat * mask).sum() / (total_seqs * t_max)
    raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {MODES}")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def group_logsumexp(x: torch.Tensor, group_index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per row: log Σ_j exp(x_j) over the ``valid`` rows j of its group (``group_index``), in log space
    without a Python loop. A group with no valid row gets log(1e-300) (finite, so its rows stay finite);
    the objectives that read this mask such rows out. Used by BRAIn's softmaxes and f-DPG's log Ẑ."""
    _, inverse = torch.unique(group_index, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    masked = x.masked_fill(~valid, float("-inf"))
    # The per-group max is a constant shift of log Σ exp: detached, since its gradient would cancel anyway.
    peak = torch.full((n_groups,), float("-inf"), dtype=x.dtype, device=x.device)
    peak = peak.scatter_reduce(0, inverse, masked.detach(), reduce="amax")
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    sums = torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add(0, inverse, torch.exp(masked - peak[inverse]))
    return (peak + torch.log(sums.clamp(min=1e-300)))[inverse]
