"""Policy objectives besides the PPO clip (``grpo.py``): GSPO and CISPO.

Same registry signature as every objective:
``fn(log_prob[B,T], old_log_prob[B,T], advantages[B,T], response_mask[B,T], ctx) -> (loss, metrics)``.
"""

from __future__ import annotations

import torch

from anabranch.algorithms.aggregation import masked_mean
from anabranch.algorithms.registries import OBJECTIVES, RECIPES


def _seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(x.dtype)
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


@OBJECTIVES.register("gspo", needs=(), inert_at_zero_advantage=True)
def gspo_loss(log_prob, old_log_prob, advantages, response_mask, ctx):
    """GSPO: a sequence-level, length-normalized importance ratio, clipped per sequence.

    Zheng et al. 2025, "Group Sequence Policy Optimization":

        s_i = exp((1/|y_i|) Σ_t (log π_θ(y_{i,t}) − log π_old(y_{i,t})))
        L_i = −min(s_i Â_i, clip(s_i, 1 − ε_low, 1 + ε_high) Â_i)

    in the paper's token form s_{i,t} = sg(s_i) · π_θ(y_{i,t}) / sg(π_θ(y_{i,t})), which equals s_i
    in value and, with Â constant over a sequence, gives the same gradient (and lets token-level
    advantages through). Use with ``loss_agg_mode=seq-mean-token-mean`` and small clip ranges
    (3e-4 / 4e-4 in the paper).
    """
    cfg = ctx.cfg
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = _seq_mean(log_ratio, response_mask)
    log_s = (seq_log_ratio.detach()[:, None] + log_prob - log_prob.detach()).clamp(max=10.0)
    s = torch.exp(log_s)
    unclipped = -advantages * s
    clipped = -advantages * s.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped)
    loss = ctx.aggregate(loss_mat, response_mask)
    with torch.no_grad():
        seq_clipped = ((clipped > unclipped).float() * response_mask).sum(-1) > 0
        metrics = {"clip_frac": masked_mean((clipped > unclipped).float(), response_mask).item(),
                   "seq_clip_frac": seq_clipped.float().mean().item(),
                   "approx_kl": masked_mean(-log_ratio, response_mask).item()}
    return loss, metrics


@OBJECTIVES.register("cispo", needs=(), inert_at_zero_advantage=True)
def cispo_loss(log_prob, old_log_prob, advantages, response_mask, ctx):
    """CISPO: clip the importance weight, not the update; every token keeps its gradient.

    MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention":

        L_t = −sg(clip(ρ_t, 1 − ε_low, 1 + ε_high)) · Â_t · log π_θ(y_t)

    with ρ_t = π_θ / π_old. The paper leaves the lower bound open (a large ε_low) and tunes ε_high.
    """
    cfg = ctx.cfg
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio.detach().clamp(-20.0, 20.0))
    weight = ratio.clamp(max(0.0, 1.0 - cfg.clip_ratio_low), 1.0 + cfg.clip_ratio_high)
    loss_mat = -weight * advantages * log_prob
    loss = ctx.aggregate(loss_mat, response_mask)
    with torch.no_grad():
        metrics = {"clip_frac": masked_mean((weight != ratio).float(), response_mask).item(),
                   "approx_kl": masked_mean(-log_ratio, response_mask).item()}
    return loss, metrics


RECIPES.register("gspo")({"advantage": "grpo", "loss": "gspo", "loss_agg_mode": "seq-mean-token-mean",
                          "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4})
RECIPES.register("cispo")({"advantage": "grpo", "loss": "cispo", "loss_agg_mode": "token-mean",
                           "clip_ratio_low": 1.0, "clip_ratio_high": 0.28})
