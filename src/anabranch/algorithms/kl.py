"""KL estimators between the policy and the reference, per token (Schulman, "Approximating KL
Divergence", 2020). With ``log_ratio = log π_θ − log π_ref`` and samples from π_θ:

- k1 = log_ratio                         (unbiased, high variance, can be negative)
- k2 = ½ · log_ratio²                     (biased, low variance)
- k3 = exp(−log_ratio) − 1 + log_ratio    (unbiased, non-negative, low variance; GRPO's choice)
"""

from __future__ import annotations

import torch

ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    log_ratio = log_prob - ref_log_prob
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        # Clamp before exp so that one extreme token cannot overflow the loss.
        neg = (-log_ratio).clamp(-20.0, 20.0)
        return (torch.exp(neg) - 1.0 - neg).clamp(min=-10.0, max=10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {ESTIMATORS}")
