"""Answer extraction from free-form completions: ``\\boxed{...}``, an "Answer:" line, the last number.

Every function takes any string (or ``None``) and returns a string or ``None``; none raises,
loops without bound, or backtracks catastrophically (the patterns are linear and the boxed
scanner walks the text once), so they are safe on adversarial model output.
"""

from __future__ import annotations

import re

# "Answer: 42", "final answer is 42", "**Answer**: 42" — the rest of that line.
_ANSWER_LINE = re.compile(r"(?i)\banswer\b[ \t]*(?:is\b[ \t]*:?|\**[ \t]*[:=])[ \t]*\**[ \t]*([^\n]*)")
# Integers, decimals, thousands separators, simple fractions: -1,234.5  3/4  .5
_NUMBER = re.compile(r"-?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|\.\d+)")


def extract_boxed(text: str | None) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; ``None`` if absent."""
    if not text:
        return None
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        # "\boxed 5" (no braces): the next token.
        rest = text[start:].split(None, 2)
        return rest[1].strip() if len(rest) > 1 else None
    depth, j = 0, i
    while j < len(text):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j].strip()
        j += 1
    return None  # unbalanced


def extract_answer_tag(text: str | None) -> str | None:
    """Content of the last ``<answer>...</answer>`` block."""
    if not text:
        return None
    # rfind rather than a lazy regex: linear even on "<answer>" repeated without a closing tag.
    lower = text.lower()
    end = lower.rfind("</answer>")
    start = lower.rfind("<answer>", 0, end) if end >= 0 else -1
    return text[start + len("<answer>"):end].strip() if start >= 0 else None


def extract_answer_line(text: str | None) -> str | None:
    """What follows the last "Answer:" / "answer is" on its line, without trailing period."""
    if not text:
        return None
    found = [m.group(1).strip() for m in _ANSWER_LINE.finditer(text)]
    found = [f.rstrip(".").strip(" *$") for f in found if f.strip(" .*$")]
    return found[-1] if found else None


def extract_last_number(text: str | None) -> str | None:
    """The last number in the text (thousands separators removed), or ``None``."""
    if not text:
        return None
    last = None
    for last in _NUMBER.finditer(text):
        pass
    return last.group(0).replace(",", "") if last else None


def extract_answer(text: str | None) -> str | None:
    """Best guess of the final answer: boxed, then <answer> tag, then "Answer:" line, then last number."""
    for fn in (extract_boxed, extract_answer_tag, extract_answer_line, extract_last_number):
        found = fn(text)
        if found:
            return found
    return None
