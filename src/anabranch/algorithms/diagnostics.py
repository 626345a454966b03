"""Per-step diagnostics that every objective gets, whatever it computes itself.

Each micro-batch returns token means; the trainer weights them by the micro-batch's share of the
response tokens, so the sums are full-batch means, and :func:`finish_diagnostics` turns the
moments into covariances:

- ``entropy``: mean token entropy H_t of the policy.
- ``approx_kl``: mean of log π_old − log π_θ over response tokens (KL(π_old‖π_θ), k1 form).
- ``cov/entropy_adv``: Cov(H_t, Â_t) = E[H·Â] − E[H]·E[Â].
- ``cov/logp_adv``: Cov(log π(y_t), Â_t), whose sign drives the entropy change (Cui et al. 2025,
  "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models").
"""

from __future__ import annotations

import torch

from anabranch.algorithms.aggregation import masked_mean

_MOMENTS = "_moment/"


def update_diagnostics(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                       entropy: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    adv = advantages.detach()
    return {
        "entropy": masked_mean(entropy, mask).item(),
        "approx_kl": masked_mean(old_log_prob - log_prob, mask).item(),
        _MOMENTS + "a": masked_mean(adv, mask).item(),
        _MOMENTS + "ha": masked_mean(entropy * adv, mask).item(),
        _MOMENTS + "lp": masked_mean(log_prob, mask).item(),
        _MOMENTS + "lpa": masked_mean(log_prob * adv, mask).item(),
    }


def finish_diagnostics(metrics: dict) -> dict:
    """Replace the accumulated moments (in place) by the covariances."""
    m = {k[len(_MOMENTS):]: metrics.pop(k) for k in [k for k in metrics if k.startswith(_MOMENTS)]}
    if m:
        metrics["cov/entropy_adv"] = m["ha"] - metrics["entropy"] * m["a"]
        metrics["cov/logp_adv"] = m["lpa"] - m["lp"] * m["a"]
    return metrics
