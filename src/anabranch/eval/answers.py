"""The final answer of a completion, as a canonical string for voting and counting.

math-verify extracts it (a ``\\boxed{}`` answer first, else the last number or expression); equal
numbers written differently ("7", "7.0", "14/2") map to the same string.
"""

from __future__ import annotations

import math
import threading


def extract_answer(completion: str) -> str | None:
    from math_verify import parse

    kwargs = {} if threading.current_thread() is threading.main_thread() else {"parsing_timeout": None}
    try:
        parsed = parse(completion, **kwargs)
    except Exception:  # an unparseable completion simply has no answer
        return None
    if not parsed:
        return None
    value = parsed[0]
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value).strip() or None
    if math.isfinite(number) and number == int(number):
        return str(int(number))
    return str(value)
