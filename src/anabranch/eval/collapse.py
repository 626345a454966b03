"""The Model Collapse Step ("How Far Can Unsupervised RLVR Scale LLM Training?"): under label-free
(intrinsic or self-voted) rewards, true accuracy on a held-out labelled split first rises, then
falls as the policy sharpens onto its own mistakes. The collapse step is the step at which that
accuracy peaks before it falls by at least ``margin`` (absolute): scanning the evaluations in order,
the first time accuracy drops to ``best_so_far − margin`` or below, the step of ``best_so_far`` is
the collapse step and the current step is where the fall was seen.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def model_collapse_step(steps: list[int], accuracy: list[float], margin: float) -> dict:
    if len(steps) != len(accuracy):
        raise ValueError("steps and accuracy must have the same length")
    if margin <= 0:
        raise ValueError(f"the collapse margin must be positive (got {margin})")
    best_step, best = None, float("-inf")
    for step, acc in zip(steps, accuracy):
        if acc > best:
            best_step, best = step, acc
        elif _fell_by(best, acc, margin):
            return {"collapse_step": best_step, "peak_accuracy": best, "fell_at_step": step,
                    "accuracy_then": acc, "margin": margin}
    return {"collapse_step": None, "peak_accuracy": None if best_step is None else best,
            "peak_step": best_step, "margin": margin}


def _fell_by(best: float, acc: float, margin: float) -> bool:
    """``acc <= best − margin``, counting a drop of exactly ``margin`` in spite of rounding: with
    margin 0.1, 0.3 → 0.2 is a fall of 0.1, but 0.3 − 0.1 = 0.19999999999999998 < 0.2 in floats."""
    drop = best - acc
    return drop >= margin or math.isclose(drop, margin, rel_tol=1e-9, abs_tol=1e-12)


def eval_history(metrics_path: str | Path, key: str = "eval/accuracy") -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` in a run's metrics.jsonl (the held-out evaluations)."""
    steps, values = [], []
    path = Path(metrics_path)
    if not path.is_file():
        return steps, values
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if isinstance(row.get(key), (int, float)):
            steps.append(int(row["step"]))
            values.append(float(row[key]))
    return steps, values


def collapse_report(metrics_path: str | Path, margin: float, key: str = "eval/accuracy") -> dict | None:
    """The collapse summary of a run, or None when it has fewer than two held-out evaluations."""
    steps, values = eval_history(metrics_path, key)
    if len(steps) < 2:
        return None
    return {"metric": key, **model_collapse_step(steps, values, margin)}
