"""The reward–entropy law of Cui et al. 2025 ("The Entropy Mechanism of Reinforcement Learning for
Reasoning Language Models"): over training, validation reward R and policy entropy H follow

    R = −a·exp(H) + b

so reward is bought with entropy and the ceiling is R = −a + b at H = 0. With the form fixed, R is
linear in (a, b) given x = exp(H), so ordinary least squares on [−x, 1] fits it exactly (no
iterative optimizer needed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class EntropyLawFit:
    a: float
    b: float
    r2: float  # coefficient of determination of the fit
    n: int

    def predict(self, entropy):
        return -self.a * np.exp(np.asarray(entropy, dtype=np.float64)) + self.b

    @property
    def ceiling(self) -> float:
        """Predicted reward at zero entropy."""
        return self.b - self.a


def fit_reward_entropy(entropy, reward) -> EntropyLawFit:
    h = np.asarray(entropy, dtype=np.float64)
    r = np.asarray(reward, dtype=np.float64)
    keep = np.isfinite(h) & np.isfinite(r)
    h, r = h[keep], r[keep]
    if h.size < 2 or np.ptp(h) == 0:
        raise ValueError(f"the reward–entropy fit needs at least two points with different entropies (got {h.size})")
    design = np.stack([-np.exp(h), np.ones_like(h)], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, r, rcond=None)
    resid = r - design @ np.array([a, b])
    ss_tot = float(np.sum((r - r.mean()) ** 2))
    r2 = 1.0 - float(np.sum(resid ** 2)) / ss_tot if ss_tot > 0 else 1.0
    return EntropyLawFit(a=float(a), b=float(b), r2=r2, n=int(h.size))
