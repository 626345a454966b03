"""Counting steps whose loss or gradient was NaN/inf.

``policy_update`` already refuses to apply such an update (the weights and the optimizer state
stay as they were); this guard counts those steps, adds the counts to the step's metrics, and
says when too many came in a row for the run to go on.
"""

from __future__ import annotations

import math


class NonFiniteGuard:
    def __init__(self, limit: int):
        self.limit = limit
        self.in_a_row = 0
        self.total = 0
        self.last_good_step = 0

    def observe(self, step: int, metrics: dict) -> str | None:
        """Update the counts from ``metrics`` (in place) and return a warning if the step was skipped."""
        loss, grad = metrics.get("loss", 0.0), metrics.get("grad_norm", 0.0)
        bad = metrics.get("skipped_updates", 0.0) > 0 or not (math.isfinite(loss) and math.isfinite(grad))
        if bad:
            self.in_a_row += 1
            self.total += 1
        else:
            self.in_a_row = 0
            self.last_good_step = step
        metrics["nonfinite/steps_total"] = float(self.total)
        metrics["nonfinite/in_a_row"] = float(self.in_a_row)
        if not bad:
            return None
        # SPEAR's separate replay step adds its own skip to skipped_updates (trainer/loop.py) after the on-policy
        # step was applied: then only that second step left the weights alone
        replay_only = (metrics.get("spear/replay/skipped", 0.0) > 0 and math.isfinite(loss) and math.isfinite(grad)
                       and metrics.get("skipped_updates", 0.0) <= metrics["spear/replay/skipped"])
        what = ("SPEAR's replay step skipped, the on-policy update applied" if replay_only
                else "update skipped, weights unchanged")
        return (f"step {step}: non-finite loss or gradient (loss={loss}, grad_norm={grad}); {what} "
                f"({self.in_a_row} in a row, the run stops at "
                f"trainer.max_nonfinite_in_a_row={self.limit})")

    @property
    def should_stop(self) -> bool:
        return self.in_a_row >= self.limit

    def stop_message(self, step: int) -> str:
        return (f"stopped at step {step}: {self.in_a_row} steps in a row had a non-finite (NaN/inf) loss or "
                f"gradient, so none of them changed the weights. The weights are those of step "
                f"{self.last_good_step}, the last finite update. Usual causes: a reward function returning NaN/inf, "
                "a learning rate too high (trainer.lr), or fp16 overflow (model.dtype). Raise "
                "trainer.max_nonfinite_in_a_row to tolerate longer runs of bad steps.")

    def state_dict(self) -> dict:
        return {"in_a_row": self.in_a_row, "total": self.total, "last_good_step": self.last_good_step}

    def load_state_dict(self, state: dict) -> None:
        self.in_a_row, self.total = state["in_a_row"], state["total"]
        self.last_good_step = state["last_good_step"]
