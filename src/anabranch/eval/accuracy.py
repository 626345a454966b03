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


def greedy_accuracy(backend, prompts: list[str], rows: list[dict], sources: list[RewardSource],
                    max_new_tokens: int, batch_size: int = 64) -> dict:
    completions = []
    for start in range(0, len(prompts), batch_size):
        ro = backend.generate(prompts[start:start + batch_size], 1, greedy=True, max_new_tokens=max_new_tokens)
        completions.extend(ro.completions)
    src = correctness_source(sources)
    total, per_source = score(sources if src is None else [src], prompts, completions, rows)
    values = per_source[src.name] if src is not None else total
    return {
        "accuracy" if src is not None else "reward": sum(values) / max(len(values), 1),
        "n": len(values),
        "completions": completions,
        "scores": values,
    }
