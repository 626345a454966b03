"""Weighted sum of several reward functions, each reported as its own metric."""

from __future__ import annotations

from dataclasses import dataclass

from anabranch.config import ConfigError, RewardConfig
from anabranch.rewards.registry import REWARDS


@dataclass
class RewardSource:
    name: str
    weight: float
    fn: object
    params: dict


def build_rewards(cfg: RewardConfig) -> list[RewardSource]:
    sources = []
    for item in cfg.functions:
        try:
            fn = REWARDS.get(item.name)
        except (KeyError, ImportError, AttributeError, ValueError) as exc:
            raise ConfigError(f"reward.functions: {exc.args[0] if exc.args else exc}") from None
        if not callable(fn):
            raise ConfigError(f"reward.functions: {item.name!r} is not callable")
        sources.append(RewardSource(item.name, item.weight, fn, dict(item.params)))
    return sources


def score(sources: list[RewardSource], prompts: list[str], completions: list[str],
          rows: list[dict], group_index: list[int] | None = None) -> tuple[list[float], dict[str, list[float]]]:
    """Total reward per completion and each source's raw values (``rows`` aligned with completions).

    ``group_index`` (which prompt each completion answers) is passed to reward functions as a
    field too, so that group-level rewards (majority vote) can see a prompt's samples together.
    """
    fields: dict[str, list] = {}
    for key in rows[0] if rows else []:
        fields[key] = [r.get(key) for r in rows]
    if group_index is not None:
        fields["group_index"] = list(group_index)
    per_source: dict[str, list[float]] = {}
    total = [0.0] * len(completions)
    for src in sources:
        values = src.fn(prompts, completions, **fields, **src.params)
        values = [float(v) for v in values]
        if len(values) != len(completions):
            raise ValueError(f"reward {src.name!r} returned {len(values)} values for {len(completions)} completions")
        per_source[src.name] = values
        total = [t + src.weight * v for t, v in zip(total, values)]
    return total, per_source
