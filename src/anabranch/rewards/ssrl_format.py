"""SSRL's rewards (Fan et al. 2025, "SSRL: Self-Search Reinforcement Learning", arXiv 2508.10874): a format reward
for the self-search layout (``ssrl_format``) and the exact-match outcome reward of knowledge QA
(``qa_exact_match``). rollout/self_search.py has the rollout side (information masking, sim2real).

``ssrl_format`` is 1.0 when the whole stripped completion is::

    <think>T</think> ( <search>Q</search> <information>I</information> [<think>T</think>] )* <answer>A</answer>

(whitespace allowed between blocks, nothing else outside them), else 0.0: one opening think block, any number of
search rounds, each a non-empty query followed by its information block and optionally a new think block, then one
non-empty answer. No block may hold any of the four tags (a nested or stray tag fails the format). Zero searches is
well-formed: the policy may answer from its first thought.

``qa_exact_match`` (a correctness reward) is 1.0 when the last ``<answer>`` block's text (rewards/extract.py's
``extract_answer_tag``, the one answer-tag reader of the library: tags in any case, Unicode dashes and spaces
normalised), normalised, equals the row's ``answer`` (or one of them, for a list) normalised: lower case,
punctuation removed, the articles a/an/the removed, whitespace collapsed (the exact-match normalisation of SQuAD,
Rajpurkar et al. 2016, used by Search-R1). No ``<answer>`` block: 0.0.

Combined reward. With the two as ``reward.functions`` of weights 1 − λ_f (qa_exact_match) and λ_f (ssrl_format),
the total is the piecewise reward of Search-R1's format-reward study (Jin et al. 2025, arXiv 2505.15117)::

    r = 1        correct and well-formed         (1 − λ_f) + λ_f
    r = 1 − λ_f  correct, not well-formed
    r = λ_f      wrong, well-formed
    r = 0        wrong and not well-formed

since that table is linear in the two indicators: r = (1 − λ_f)·EM + λ_f·format.

Confirmed (abstract; the authors' example script): SSRL rewards format and a rule-based outcome. Assumed (the
method section could not be read): the layout above (its optional later think blocks, the non-empty query and
answer), the piecewise combination and any λ_f value (docs/algorithms.md suggests 0.2), and exact match as the
rule-based outcome.
"""

from __future__ import annotations

import re
import string

from anabranch.rewards.extract import extract_answer_tag, normalize_text
from anabranch.rewards.registry import REWARDS

_TAG = r"</?(?:think|search|information|answer)>"
_FREE = rf"(?:(?!{_TAG}).)*"                      # any text without one of the four tags
_FILLED = rf"\s*(?!{_TAG})\S{_FREE}"              # the same, with a non-space character (one way to split it)
SSRL_LAYOUT = re.compile(
    rf"<think>{_FREE}</think>\s*"
    rf"(?:<search>{_FILLED}</search>\s*<information>{_FREE}</information>\s*(?:<think>{_FREE}</think>\s*)?)*"
    rf"<answer>{_FILLED}</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(?:a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def well_formed(completion: str) -> bool:
    return SSRL_LAYOUT.fullmatch(completion.strip()) is not None


@REWARDS.register("ssrl_format")
def ssrl_format_reward(prompts, completions, **_):
    return [1.0 if well_formed(c) else 0.0 for c in completions]


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation, after extract.normalize_text (Unicode dashes as "-", Unicode spaces as " ") on both
    sides, so that a "−" the model wrote and a "-" in the gold answer are the same punctuation."""
    return " ".join(_ARTICLES.sub(" ", normalize_text(str(text)).lower().translate(_PUNCT)).split())


@REWARDS.register("qa_exact_match", correctness=True)
def qa_exact_match_reward(prompts, completions, answer=None, **_):
    if answer is None:
        raise ValueError("qa_exact_match reward needs an 'answer' column")
    out = []
    for c, gold in zip(completions, answer):
        pred = extract_answer_tag(c)  # the last <answer> block, tags in any case
        golds = gold if isinstance(gold, (list, tuple)) else [gold]
        out.append(1.0 if pred is not None and normalize_answer(pred) in {normalize_answer(g) for g in golds} else 0.0)
    return out
