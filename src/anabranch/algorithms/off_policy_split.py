"""A micro-batch loss split between on-policy and off-policy tokens, each row weighing as one row.

Used by AMPO (algorithms/ampo.py: whole injected teacher rows are off-policy) and SCOPE (algorithms/scope.py:
a salvaged row's policy prefix is on-policy, the rectifier's continuation off-policy). Per token,

    on-policy tokens:   the run's objective (PPO-clip, CISPO, ...) with its ratio π_θ / π_old
    off-policy tokens:  −f(π_θ(o_t | ·)) · Â,   f(p) = p / (p + γ)   (no clipping)

f is LUFFY's policy shaping (Yan et al. 2025, "Learning to Reason under Off-Policy Guidance",
arXiv 2504.14945): the ratio π_θ / π_guide with π_guide taken as 1, reshaped so that low-probability guidance
tokens keep a large gradient (∂f/∂log p = pγ / (p + γ)²).

The two parts are aggregated separately (the objective calls the run's aggregate on its own mask), which
is exact for ``token-mean``, ``seq-mean-token-sum`` and ``seq-mean-token-sum-norm`` (sums over tokens with
batch-wide normalizers), but not for ``seq-mean-token-mean``, which averages within each row: a row
split into a part of a tokens and a part of b tokens would contribute mean_a + mean_b, twice a plain row's
weight. Under that mode each part's per-token loss is scaled by its share of the row, a / (a + b) and
b / (a + b), so the row contributes (Σ_a L + Σ_b L) / (a + b), the mean over all its tokens, as any row.
(AMPO's rows are whole, shares 1, so this changes nothing for it.)
"""

from __future__ import annotations

import copy

import torch

# The one loss_agg_mode that normalizes by each row's own token count (algorithms/aggregation.py).
ROW_MEAN_MODE = "seq-mean-token-mean"


def shaped_prob(log_prob: torch.Tensor, gamma: float) -> torch.Tensor:
    """f(π_θ) = π_θ / (π_θ + γ) per token (LUFFY's policy shaping of the ratio π_θ / π_guide, π_guide = 1)."""
    p = log_prob.exp()
    return p / (p + gamma)


def off_policy_loss_mat(log_prob: torch.Tensor, advantage: torch.Tensor, gamma: float) -> torch.Tensor:
    """Per-token loss −f(π_θ)·Â of the off-policy tokens (no clipping)."""
    return -shaped_prob(log_prob, gamma) * advantage


def row_share(part: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """[b, 1]: each row's tokens in ``part`` over its tokens in ``full`` (masks [b, T]); 1 for a row with no
    ``part`` token (nothing of it is aggregated, and an exact 1 leaves whole rows bit-for-bit unchanged)."""
    n_part, n_full = part.sum(-1, keepdim=True), full.sum(-1, keepdim=True)
    return torch.where(n_part > 0, n_part / n_full.clamp(min=1.0), torch.ones_like(n_part))


def share_weighted(agg, share: torch.Tensor):
    """``agg`` with each row's per-token loss scaled by ``share`` first (the row-mean fix in the docstring)."""
    return lambda loss_mat, mask: agg(loss_mat * share.to(loss_mat.dtype), mask)


def split_objective(objective, log_prob, old_log_prob, advantage, mask, ctx, off: torch.Tensor, gamma: float, agg):
    """(loss, the objective's metrics, mean f over the off-policy tokens, 0 without any): the run's ``objective``
    on ``mask``'s tokens outside ``off`` ([b, T] bool) plus agg(−f(π_θ)·Â) on those inside, each row weighing
    one row's share under every loss_agg_mode (module docstring)."""
    off = off.to(mask.device).bool()
    on_mask, off_mask = mask * (~off).to(mask.dtype), mask * off.to(mask.dtype)
    off_agg = agg
    if ctx.cfg.loss_agg_mode == ROW_MEAN_MODE:
        ctx = copy.copy(ctx)  # the caller's context keeps the plain aggregate (its other terms use the whole row)
        ctx.aggregate = share_weighted(ctx.aggregate, row_share(on_mask, mask))
        off_agg = share_weighted(agg, row_share(off_mask, mask))
    loss, metrics = objective(log_prob, old_log_prob, advantage, on_mask, ctx)
    shaped = 0.0
    if bool(off_mask.any()):
        loss = loss + off_agg(off_policy_loss_mat(log_prob, advantage, gamma), off_mask)
        with torch.no_grad():
            f = shaped_prob(log_prob.detach(), gamma)
            shaped = float((f * off_mask).sum() / off_mask.sum().clamp(min=1))
    return loss, metrics, shaped
