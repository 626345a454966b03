"""Math answer correctness with ``math-verify``.

The gold answer and the completion are parsed with math-verify's LaTeX and expression
extractors (a ``\\boxed{}`` answer first, else the last number or expression in the text), and
compared by mathematical equivalence. Reward 1.0 when equivalent, else 0.0.

math-verify implements its timeouts with ``signal.alarm``, which only works on the main thread:
off the main thread it is called with those timeouts disabled (the caller must bound the time).
Whatever the text, the reward is 0.0 or 1.0: an error inside math-verify counts as "not equivalent".
"""

from __future__ import annotations

import threading
from functools import lru_cache

from anabranch.rewards.registry import REWARDS

# Seconds math-verify may spend parsing one text / comparing one pair (whole seconds: signal.alarm).
PARSE_TIMEOUT_S = 5
VERIFY_TIMEOUT_S = 5


def _timeouts() -> dict:
    if threading.current_thread() is threading.main_thread():
        return {"parsing_timeout": PARSE_TIMEOUT_S}
    return {"parsing_timeout": None}


@lru_cache(maxsize=4096)
def _parse_gold(answer: str):
    from math_verify import parse

    text = answer if "\\boxed" in answer or "$" in answer else f"${answer}$"
    return parse(text, **_timeouts())


def is_equivalent(completion: str, answer: str) -> bool:
    try:
        return _is_equivalent(completion, answer)
    except Exception:  # a parser bug on odd text must not stop training: count it as wrong
        return False


def _is_equivalent(completion: str, answer: str) -> bool:
    from math_verify import parse, verify

    gold = _parse_gold(str(answer))
    if not gold:
        return False
    pred = parse(completion, **_timeouts())
    if not pred:
        return False
    main = threading.current_thread() is threading.main_thread()
    kwargs = {"timeout_seconds": VERIFY_TIMEOUT_S if main else None}
    return bool(verify(gold, pred, **kwargs))


@REWARDS.register("math_verify", correctness=True)
def math_verify_reward(prompts, completions, answer=None, **_):
    if answer is None:
        raise ValueError("math_verify reward needs an 'answer' column")
    return [1.0 if is_equivalent(c, a) else 0.0 for c, a in zip(completions, answer)]
