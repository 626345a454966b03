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


MIN_POINTS = 3  # two parameters through two points always fit exactly: R² = 1 says nothing


def _finite(entropy, reward) -> tuple[np.ndarray, np.ndarray]:
    h = np.asarray(entropy, dtype=np.float64)
    r = np.asarray(reward, dtype=np.float64)
    keep = np.isfinite(h) & np.isfinite(r)
    return h[keep], r[keep]


def why_no_fit(entropy, reward) -> str | None:
    """Why the data cannot support a fit (None when it can): fewer than MIN_POINTS finite points, no
    variance in reward (R² is 0/0; the old code called that a perfect fit), or no spread in entropy
    (a and b are not identifiable)."""
    h, r = _finite(entropy, reward)
    if h.size < MIN_POINTS:
        return f"{h.size} steps, the fit needs {MIN_POINTS}"
    if np.ptp(r) == 0:
        return "reward never changed"
    if np.ptp(h) == 0:
        return "entropy never changed"
    return None


def fit_reward_entropy(entropy, reward) -> EntropyLawFit | None:
    """Least-squares fit of R = −a·exp(H) + b over the finite points, or None where
    :func:`why_no_fit` gives a reason."""
    if why_no_fit(entropy, reward) is not None:
        return None
    h, r = _finite(entropy, reward)
    design = np.stack([-np.exp(h), np.ones_like(h)], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, r, rcond=None)
    resid = r - design @ np.array([a, b])
    ss_tot = float(np.sum((r - r.mean()) ** 2))  # > 0: the reward spread was checked above
    r2 = 1.0 - float(np.sum(resid ** 2)) / ss_tot
    return EntropyLawFit(a=float(a), b=float(b), r2=r2, n=int(h.size))
