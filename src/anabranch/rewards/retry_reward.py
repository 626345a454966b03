"""UFO's episode reward for multi-attempt rollouts (``rollout.retry_turns``; the ``retry_turns`` reward).

Liu, Wang, Li, Xu, Lu, Liu, Sil, Li 2025, "A Simple "Try Again" Can Elicit Multi-Turn LLM Reasoning"
(arXiv 2507.14295). The episode's attempts a_1..a_T (T <= K) are read from the transcript: the
completion is cut at the feedback message (:data:`anabranch.rollout.retry_turns.FEEDBACK`). With k the
first correct attempt (1-indexed), E the number of distinct answers among the T_v attempts that state
one, and the constants of the authors' released MetaMathQA environment (γ = 1/2, λ = 0.5):

    R = γ^(k−1) · 1[some attempt is correct]  −  λ · (1 − E / T_v)     (penalty 0 when T_v = 0)

The turn-decayed success term rewards solving early; the repetition penalty punishes answering the
same (wrong) answer again after the feedback. A correct first attempt gets 1; right at the second
0.5; never right with the same answer twice in two attempts −0.25.

Not a correctness reward (an episode solved at attempt 2 gets 0.5, not full credit): with it,
``rollout.retry_turns`` >= 2 (with one attempt it would be a plain correctness reward) and ``math_verify``
as the first correctness reward are required at config load (:func:`anabranch.rollout.retry_turns.check_config`).

An attempt's correctness is the ``math_verify`` check (:func:`anabranch.rewards.math_answer.is_equivalent`); an
attempt's answer for E is :func:`anabranch.rewards.extract.extract_answer` with whitespace removed and
lowercased (the authors' "minimal normalization": 1/2 and 0.5 are distinct answers).

Assumed: the attempt boundaries are the feedback text in the decoded completion, so an attempt in which
the policy itself writes "Let's try again." is read as two attempts; role names a chat template leaves
in the decoded text ("user", "assistant") are part of the attempts' text and do not change their answers.
"""

from __future__ import annotations

import re

from anabranch.rewards.extract import extract_answer
from anabranch.rewards.registry import REWARDS

GAMMA = 0.5     # the authors' environment: 1 / 2**step for a success at (0-indexed) step
PENALTY = 0.5   # the authors' environment: penalty_lambda


def split_attempts(completion: str, feedback: str) -> list[str]:
    """The attempts of an episode's transcript: its text cut at each feedback message."""
    return completion.split(feedback)


def _norm(answer: str | None) -> str:
    return re.sub(r"\s+", "", answer.strip().lower()) if answer else ""


def episode_reward(attempts: list[str], correct: list[bool], gamma: float = GAMMA, penalty: float = PENALTY) -> float:
    """R = γ^(k−1)·1[solved] − λ·(1 − E/T_v) for one episode (see the module's docstring)."""
    first = next((k for k, ok in enumerate(correct) if ok), None)
    success = gamma ** first if first is not None else 0.0
    answers = [a for a in (_norm(extract_answer(t)) for t in attempts) if a]
    rep = penalty * (1.0 - len(set(answers)) / len(answers)) if answers else 0.0
    return success - rep


def check_params(params: dict) -> None:
    from anabranch.config import ConfigError

    unknown = set(params) - {"gamma", "penalty"}
    if unknown:
        raise ConfigError(f"reward.functions: retry_turns has no option {sorted(unknown)[0]!r} "
                          "(its options: gamma, penalty)")
    if not 0 < float(params.get("gamma", GAMMA)) <= 1:
        raise ConfigError(f"reward.functions: retry_turns gamma must be in (0, 1] (got {params['gamma']!r})")
    if float(params.get("penalty", PENALTY)) < 0:
        raise ConfigError(f"reward.functions: retry_turns penalty must be >= 0 (got {params['penalty']!r})")


@REWARDS.register("retry_turns", check_params=check_params)
def retry_turns_reward(prompts, completions, answer=None, gamma: float = GAMMA, penalty: float = PENALTY, **_):
    if answer is None:
        raise ValueError("retry_turns reward needs an 'answer' column")
    from anabranch.rewards.math_answer import is_equivalent
    from anabranch.rollout.retry_turns import FEEDBACK

    out = []
    for text, gold in zip(completions, answer):
        attempts = split_attempts(text, FEEDBACK)
        out.append(episode_reward(attempts, [is_equivalent(a, str(gold)) for a in attempts],
                                  float(gamma), float(penalty)))
    return out
