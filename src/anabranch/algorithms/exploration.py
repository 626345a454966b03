"""Exploration controls that reshape the per-token advantages at update time, from the policy's
own token entropies H_t (detached). They apply to every objective and are off by default.

- Entropy-shaped advantage (Cheng et al. 2025, "Reasoning with Exploration: An Entropy
  Perspective"):  Â'_t = Â_t + min(α · sg(H_t), |Â_t| / κ)  with α = ``entropy_adv_alpha``
  (0 = off; paper 0.4) and κ = ``entropy_adv_kappa`` (paper 2). The clip keeps the bonus from
  flipping the sign of Â, and it vanishes where Â = 0.
- Forking-token mask (Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive
  Effective Reinforcement Learning for LLM Reasoning"): Â'_t = Â_t · [H_t ≥ H_(k)] keeps the
  policy gradient only on the top-ρ fraction of response tokens by entropy (ρ =
  ``entropy_top_rho``, paper 0.2; 1 = off): the k = ⌈ρ·n⌉ highest of the n response tokens, and
  every token tied with the k-th (:func:`top_fraction_mask`). The selection is over the micro-batch's
  response tokens (exact when one micro-batch holds the step batch: ``trainer.micro_batch_tokens``
  large enough, or 0 with ``trainer.micro_batch_size`` ≥ the step batch). The other tokens
  still count in the loss normalizer, so the step size per kept token is unchanged.
"""

from __future__ import annotations

import math

import torch


def entropy_shaped_advantage(advantages: torch.Tensor, entropy: torch.Tensor, alpha: float, kappa: float) -> torch.Tensor:
    return advantages + torch.minimum(alpha * entropy.detach(), advantages.abs() / kappa)


def top_k_count(frac: float, n: int) -> int:
    """k = ⌈frac · n⌉ clamped to [1, n] (n ≥ 1): how many of n entries the top ``frac`` keeps."""
    # frac·n in floating point can land just above an integer (0.07·100 = 7.000000000000001).
    return min(n, max(1, math.ceil(frac * n - 1e-9)))


def top_fraction_mask(values: torch.Tensor, mask: torch.Tensor, frac: float) -> torch.Tensor:
    """Bool [same shape]: the entries under ``mask`` whose value is >= the k-th largest of them,
    k = ⌈frac · n⌉ (n the masked entries; ties with the k-th are all kept, so a threshold, not a count).

    ``torch.topk``, not ``torch.quantile``: quantile refuses inputs over 16M elements (a large step's
    tokens), and its interpolated (1 − frac)-quantile kept ⌊1 + (n − 1)·frac⌋ entries, one fewer than
    ⌈frac·n⌉ when the fraction of frac·n is below frac (never for frac = 0.2 or 0.5)."""
    valid = mask.bool()
    picked = values.detach()[valid]
    n = picked.numel()
    if n == 0:
        return torch.zeros_like(valid)
    cutoff = torch.topk(picked.float(), top_k_count(frac, n)).values[-1]
    return valid & (values.detach().float() >= cutoff)


def forking_token_mask(entropy: torch.Tensor, mask: torch.Tensor, rho: float) -> torch.Tensor:
    """1 on the top-ρ entropy response tokens, 0 elsewhere."""
    return top_fraction_mask(entropy, mask, rho).to(entropy.dtype)


def shape_advantages(advantages: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor, cfg):
    """Apply the enabled controls; returns (advantages, metrics)."""
    metrics = {}
    if cfg.entropy_adv_alpha > 0:
        advantages = entropy_shaped_advantage(advantages, entropy, cfg.entropy_adv_alpha, cfg.entropy_adv_kappa)
        advantages = advantages * mask
    if cfg.entropy_top_rho < 1.0:
        keep = forking_token_mask(entropy, mask, cfg.entropy_top_rho)
        advantages = advantages * keep
        metrics["forking/kept_frac"] = (keep.sum() / mask.sum().clamp(min=1.0)).item()
    return advantages, metrics
