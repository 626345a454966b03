"""The final answer of a completion, as a canonical string for voting and counting.

The answer is found by :func:`anabranch.rewards.extract.extract_answer` (an ``<answer>`` tag,
``\\boxed{}``, an "Answer:" line, else the last number: the order every reward uses; linear time
on any text, so it is safe to call on every rollout inside the training step), then numbers are
canonicalized so that equal values written differently ("7", "7.0", "14/2", "1,000", "1000", and
"−5" with a Unicode minus and "-5") count as one answer.
"""

from __future__ import annotations

import math
from fractions import Fraction

from anabranch.rewards.extract import extract_answer as _extract
from anabranch.rewards.extract import normalize_text


def canonical_number(text: str) -> str | None:
    """``text`` as a canonical number string if it is a plain number or fraction, else ``None``."""
    s = normalize_text(text).strip().strip("$").replace(",", "").replace(" ", "")
    if not s or len(s) > 64:
        return None
    try:
        value = Fraction(s)  # "14/2", "-3", "0.5", "1e3"
    except (ValueError, ZeroDivisionError):
        return None
    if value.denominator == 1:
        return str(value.numerator)
    number = float(value)
    return repr(number) if math.isfinite(number) else None


def extract_answer(completion: str) -> str | None:
    raw = _extract(completion)
    if raw is None:
        return None
    return canonical_number(raw) or raw.strip() or None
