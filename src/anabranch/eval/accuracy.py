"""Greedy held-out accuracy: one greedy completion per problem, scored by the reward functions."""

from __future__ import annotations

from anabranch.rewards.compose import RewardSource, score


def correctness_source(sources: list[RewardSource]) -> RewardSource | None:
    """The reward that says right/wrong (for accuracy), if any: the first marked as correctness."""
    from anabranch.rewards.registry import REWARDS

    for src in sources:
        if src.name in REWARDS and REWARDS.meta(src.name).get("correctness"):
            return src
    return None


def truth_source(sources: list[RewardSource], rows: list[dict] | None = None) -> RewardSource | None:
    """The correctness reward among ``sources``, else ``math_verify`` when the rows have answers: runs
    trained on label-free rewards (majority vote, self-certainty) are still measured against the
    true answers, which is what the Model Collapse Step needs."""
    src = correctness_source(sources)
    if src is None and (rows is None or (rows and all(r.get("answer") not in (None, "") for r in rows))):
        from anabranch.rewards.registry import REWARDS

        src = RewardSource("math_verify", 1.0, REWARDS.get("math_verify"), {})
    return src


EVAL_BATCH_SIZE = 64  # prompts decoded together by greedy_accuracy


def greedy_accuracy(backend, prompts: list[str], rows: list[dict], sources: list[RewardSource],
                    max_new_tokens: int, batch_size: int = EVAL_BATCH_SIZE) -> dict:
    completions = []
    for start in range(0, len(prompts), batch_size):
        ro = backend.generate(prompts[start:start + batch_size], 1, greedy=True, max_new_tokens=max_new_tokens)
        completions.extend(ro.completions)
    src = truth_source(sources, rows)
    total, per_source = score(sources if src is None else [src], prompts, completions, rows)
    values = per_source[src.name] if src is not None else total
    return {
        "accuracy" if src is not None else "reward": sum(values) / max(len(values), 1),
        "n": len(values),
        "completions": completions,
        "scores": values,
    }
