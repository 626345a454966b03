"""The KL coefficient β: fixed, or adaptive (Ziegler et al. 2019, "Fine-Tuning Language Models
from Human Preferences"). The adaptive controller steers the measured KL per sequence toward a
target with a clipped proportional error:

    e = clip(KL / KL_target − 1, −0.2, 0.2),    β ← β · (1 + e · n / horizon)

after each step of n sequences. β multiplies the KL wherever it is applied (``kl_in``): in the
loss (β · aggregate(k)) or in the reward (r_t ← r_t − β · k_t, before the advantage).
"""

from __future__ import annotations


class KLController:
    def __init__(self, coef: float, target: float | None = None, horizon: int = 10000):
        self.value = float(coef)
        self.target = target
        self.horizon = horizon

    @property
    def adaptive(self) -> bool:
        return self.target is not None

    def update(self, current_kl: float, n_steps: int) -> None:
        if not self.adaptive:
            return
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


def build_kl_controller(cfg) -> KLController:
    return KLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
