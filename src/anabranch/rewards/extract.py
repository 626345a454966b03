"""Answer extraction from free-form completions: an ``<answer>`` tag, ``\\boxed{...}``, an
"Answer:" line, the last number.

Every function takes any string (or ``None``) and returns a string or ``None``; none raises,
loops without bound, or backtracks catastrophically (the patterns are linear and the boxed
scanner walks the text once), so they are safe on adversarial model output.

Every extractor first applies :func:`normalize_text`: models (and tokenizers trained on typeset
text) write minus signs as U+2212 "−" or an en dash, and spaces as no-break or thin spaces, which
would otherwise never equal a gold "-5" (and the last-number extractor would drop the sign).
"""

from __future__ import annotations

import re

# "Answer: 42", "final answer is 42", "**Answer**: 42" — the lead-in only; the answer is what
# follows the last lead-in on its line, up to the end of its sentence.
_ANSWER_LEAD = re.compile(r"(?i)\banswer\b[ \t]*(?:is\b[ \t]*:?|\**[ \t]*[:=])[ \t]*\**[ \t]*")
# The end of a sentence: "." or "?" then a space (not the point of "3.5"; not "!", a factorial
# in "5! = 120").
_SENTENCE_END = re.compile(r"[.?](?=\s)")
# Integers, decimals, thousands separators, simple fractions: -1,234.5  3/4  .5
_NUMBER = re.compile(r"-?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|\.\d+)")

# Characters that stand for an ASCII minus or space in answers. The dashes are those used as a minus
# sign in typeset or word-processed text: minus sign, figure dash, en dash, (non-breaking) hyphen,
# small and fullwidth hyphen-minus. The em dash (U+2014) is left alone: it is sentence punctuation
# ("5 — so"), and reading it as a minus would make a number after it negative. An en dash in a
# range ("3–5") becomes "3-5", the same as the range typed with an ASCII hyphen.
_DASHES = "\u2212\u2012\u2013\u2010\u2011\ufe63\uff0d"
# No-break, figure, thin, narrow no-break, ideographic and the other fixed-width spaces.
_SPACES = "\u00a0\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u202f\u205f\u3000"
# Zero-width characters carry nothing and would split a number or a word.
_INVISIBLE = "\u200b\u200c\u200d\u2060\ufeff"
_NORMALIZE = {**{ord(c): "-" for c in _DASHES}, **{ord(c): " " for c in _SPACES},
              **{ord(c): None for c in _INVISIBLE}}


def normalize_text(text: str) -> str:
    """``text`` with Unicode minus signs/dashes as "-", Unicode spaces as " " and zero-width
    characters removed (one linear pass)."""
    return text.translate(_NORMALIZE)


def _extract_boxed(text: str | None) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; ``None`` if absent."""
    if not text:
        return None
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (6 if text.startswith("\\boxed", start) else 5)
    while i < len(text) and text[i] in " \t":
        i += 1
    if i >= len(text) or text[i] != "{":
        # "\boxed 5" or "\boxed5" (no braces): the token right after it, not a later brace.
        token = text[i:i + 200].split(None, 1)
        token = token[0].rstrip(".,;:$") if token else ""
        return token or None
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


def _extract_answer_tag(text: str | None) -> str | None:
    """Content of the last ``<answer>...</answer>`` block."""
    if not text:
        return None
    # rfind rather than a lazy regex: linear even on "<answer>" repeated without a closing tag.
    lower = text.lower()
    end = lower.rfind("</answer>")
    start = lower.rfind("<answer>", 0, end) if end >= 0 else -1
    return text[start + len("<answer>"):end].strip() if start >= 0 else None


def _extract_answer_line(text: str | None) -> str | None:
    """What follows the last "Answer:" / "answer is" on its line, up to the end of that sentence.

    "Final Answer: The final answer is $7$. I hope it is correct." gives "7" (the last lead-in,
    not the first), and "The answer is 12. There were 5 left." gives "12", not the whole line.
    """
    if not text:
        return None
    leads = list(_ANSWER_LEAD.finditer(text))
    for k in range(len(leads) - 1, -1, -1):
        # Up to the next lead-in, the end of the line and the end of the sentence: each character
        # is looked at once, so this stays linear on "answer: answer: ...".
        start, bound = leads[k].end(), leads[k + 1].start() if k + 1 < len(leads) else len(text)
        newline = text.find("\n", start, bound)
        rest = text[start:newline if newline >= 0 else bound]
        stop = _SENTENCE_END.search(rest)
        rest = (rest[:stop.start()] if stop else rest).strip().rstrip(".").strip(" *$")
        if rest.strip(" .*$"):
            return rest
    return None


def _extract_last_number(text: str | None) -> str | None:
    """The last number in the text (thousands separators removed), or ``None``."""
    if not text:
        return None
    last = None
    for last in _NUMBER.finditer(text):
        pass
    return last.group(0).replace(",", "") if last else None


def _on_normalized(raw):
    """The public extractor: ``raw`` (which expects normalized text) applied to normalize_text(text)."""
    def extractor(text: str | None) -> str | None:
        return raw(normalize_text(text)) if text else None

    extractor.__name__, extractor.__doc__ = raw.__name__.lstrip("_"), raw.__doc__
    return extractor


extract_boxed = _on_normalized(_extract_boxed)
extract_answer_tag = _on_normalized(_extract_answer_tag)
extract_answer_line = _on_normalized(_extract_answer_line)
extract_last_number = _on_normalized(_extract_last_number)


def extract_answer(text: str | None) -> str | None:
    """Best guess of the final answer, in this order: the last ``<answer>`` block (its
    ``\\boxed{}`` content if it holds one, else the block as written: reasoning-gym answers can be
    words or expressions), the last ``\\boxed{}``, the "Answer:" line, the last number.

    The tag comes first because it is the explicit final answer that reasoning-gym and R1-style
    prompts ask for: a ``\\boxed{}`` earlier in the reasoning is then an intermediate result. This
    is the one order used by every reward and diagnostic that extracts an answer (reasoning_gym,
    majority_vote, eval); math_verify gives the tag the same precedence (``rewards/math_answer.py``)."""
    if not text:
        return None
    text = normalize_text(text)  # once, for every extractor below
    tag = _extract_answer_tag(text)
    if tag:
        return _extract_boxed(tag) or tag
    for fn in (_extract_boxed, _extract_answer_line, _extract_last_number):
        found = fn(text)
        if found:
            return found
    return None
