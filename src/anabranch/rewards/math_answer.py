"""Math answer correctness with ``math-verify``.

The gold answer and the completion are parsed with math-verify's LaTeX and expression
extractors and compared by mathematical equivalence. Reward 1.0 when equivalent, else 0.0. The
completion's answer is looked for with the precedence of
:func:`~anabranch.rewards.extract.extract_answer`: inside the last ``<answer>...</answer>`` block
when there is a non-empty one (a ``\\boxed{}`` in it still counts), else in the whole text (a
``\\boxed{}`` answer first, else the last number or expression). Both texts first go through
:func:`~anabranch.rewards.extract.normalize_text`, so "−5" (U+2212) equals a gold "-5".

math-verify's own timeouts (a one-shot ``signal.alarm``) can be swallowed and are disabled; one
comparison is bounded by :func:`~anabranch.rewards.time_limit.time_limit` instead (main thread
only: elsewhere the caller must bound the time). Whatever the text, the reward is 0.0 or 1.0: an
error or a timeout inside math-verify counts as "not equivalent".
"""

from __future__ import annotations

import logging
import re
from functools import lru_cache

from anabranch.rewards.extract import extract_answer_tag, normalize_text
from anabranch.rewards.registry import REWARDS
from anabranch.rewards.time_limit import TimeLimitExceeded, time_limit

# Seconds one completion/answer comparison may take (parsing both and comparing).
TIMEOUT_S = 5.0
# math-verify warns on every call that its own (disabled) timeout is off: our time_limit bounds it,
# and the warning would flood the progress bar.
logging.getLogger("math_verify").setLevel(logging.ERROR)


@lru_cache(maxsize=1)
def _warm_up() -> None:
    """Import math-verify (sympy, latex2sympy2, antlr) and run one comparison, outside any time limit.

    A timeout that lands inside an import leaves the half-imported package in ``sys.modules``:
    sympy then fails in every later use in this process ("module 'sympy' has no attribute
    'printing'"), torch's own symbolic shapes included. A cold first import can take seconds (seen
    on a GPU machine with 8 test workers importing at once), so it must not run on the clock."""
    from math_verify import parse, verify

    verify(parse("$1$", parsing_timeout=None), parse("$1$", parsing_timeout=None), timeout_seconds=None)


# A "$" that delimits math, not the escaped currency sign "\$" of answers such as "\$18.90".
_MATH_DOLLAR = re.compile(r"(?<!\\)\$")


@lru_cache(maxsize=4096)
def _parse_gold(answer: str):
    """The gold answer parsed as math: a bare answer ("12", "\\frac{1}{2}", "\\$18.90") is read as
    the inside of ``$...$``; one that already has ``\\boxed`` or ``$`` delimiters as it is."""
    from math_verify import parse

    text = answer if "\\boxed" in answer or _MATH_DOLLAR.search(answer) else f"${answer}$"
    return parse(text, parsing_timeout=None)


def is_equivalent(completion: str, answer: str) -> bool:
    _warm_up()
    try:
        with time_limit(TIMEOUT_S):
            return _is_equivalent(completion, answer)
    except (Exception, TimeLimitExceeded):  # odd text must not stop training: count it as wrong
        return False


def _parse_completion(completion: str):
    """The completion's answer parsed as math: the ``<answer>`` block first (as extract_answer), else
    math-verify's own choice in the whole text (a boxed answer, else the last expression)."""
    from math_verify import parse

    tag = extract_answer_tag(completion)
    if not tag:
        return parse(normalize_text(completion), parsing_timeout=None)
    pred = parse(tag, parsing_timeout=None)
    if not pred and not _MATH_DOLLAR.search(tag):
        # Bare LaTeX in the tag ("\\sqrt{2}", "\\pi/2") has no delimiters for the LaTeX extractor.
        pred = parse(f"${tag}$", parsing_timeout=None)
    return pred


def _is_equivalent(completion: str, answer: str) -> bool:
    from math_verify import verify

    gold = _parse_gold(normalize_text(str(answer)))
    if not gold:
        return False
    pred = _parse_completion(completion)
    if not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=None))


@REWARDS.register("math_verify", correctness=True)
def math_verify_reward(prompts, completions, answer=None, **_):
    if answer is None:
        raise ValueError("math_verify reward needs an 'answer' column")
    return [1.0 if is_equivalent(c, a) else 0.0 for c, a in zip(completions, answer)]


def answers_equivalent(a: str | None, b: str | None) -> bool:
    """Whether two extracted answers are mathematically equal (both parsed as gold answers)."""
    if a is None or b is None:
        return False
    a, b = normalize_text(str(a)), normalize_text(str(b))
    if a.strip() == b.strip():
        return True
    from math_verify import verify

    _warm_up()
    try:
        with time_limit(TIMEOUT_S):
            pa, pb = _parse_gold(str(a)), _parse_gold(str(b))
            return bool(pa and pb and verify(pa, pb, timeout_seconds=None))
    except (Exception, TimeLimitExceeded):  # math-verify raises on some exotic expressions
        return False
