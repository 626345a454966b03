"""Task mixtures: several data sources trained together (``task.mixture``).

Each entry of ``task.mixture`` is a task of its own (a built-in task, a reasoning-gym dataset or a
file) whose TaskConfig is the ``task`` section with the entry's overrides on top. Its rows are
loaded by :func:`anabranch.data.tasks.load_task` as a single task's would be (held-out prompts
removed from its training rows), then tagged with the source's label under ``row["source"]``, so
that sampling, per-source metrics and the held-out accuracy per source can tell them apart.
Train rows (and held-out rows) are concatenated in the order of the entries.

An empty ``task.mixture`` leaves everything as it was: no row is tagged and ``load_task`` never
reaches this module.
"""

from __future__ import annotations

import dataclasses
import math

from anabranch.config import ConfigError, TaskConfig

SOURCE_KEY = "source"  # the row key holding the source's label
# TaskConfig fields that make sense per source; the rest (columns, seed, chat template, ...) are shared.
OVERRIDABLE = ("name", "path", "params", "train_size", "eval_size", "instruction", "system_prompt")
ENTRY_KEYS = OVERRIDABLE + ("weight", "label")
CURRICULA = ("none", "dump")


def check_task_config(cfg: TaskConfig) -> None:
    """Validate ``task.mixture``, ``task.curriculum`` and the DUMP options, naming the bad key."""
    from anabranch.trainer.prompt_pairing import check_pairing

    check_pairing(cfg)  # task.pairing_* (prompt pairing q+/q−)
    if cfg.curriculum not in CURRICULA:
        raise ConfigError(f"config key 'task.curriculum' must be one of {', '.join(CURRICULA)} "
                          f"(got {cfg.curriculum!r})")
    for key, ok, why in (("dump_window", cfg.dump_window >= 1, "must be >= 1"),
                         ("dump_exploration", cfg.dump_exploration >= 0, "must be >= 0 (0: no exploration bonus)"),
                         ("dump_temperature", cfg.dump_temperature > 0, "must be > 0")):
        if not ok:
            raise ConfigError(f"config key 'task.{key}' {why} (got {getattr(cfg, key)!r})")
    if cfg.curriculum == "dump" and len(cfg.mixture) < 2:
        raise ConfigError("config key 'task.curriculum'=dump schedules the sources of a mixture: set task.mixture "
                          f"to at least 2 sources (got {len(cfg.mixture)})")
    labels = []
    for i, entry in enumerate(cfg.mixture):
        key = f"task.mixture[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"config key {key!r} must be a mapping such as {{name: basic_arithmetic, weight: 1.0}}, "
                              f"got {entry!r}")
        unknown = sorted(set(entry) - set(ENTRY_KEYS))
        if unknown:
            raise ConfigError(f"config key '{key}.{unknown[0]}' is not a mixture entry key; use one of "
                              f"{', '.join(ENTRY_KEYS)}")
        if not isinstance(entry.get("name"), str) or not entry["name"]:
            raise ConfigError(f"config key '{key}.name' is required: a task name (basic_arithmetic, "
                              "reasoning_gym:chain_sum, file, ...)")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            raise ConfigError(f"config key '{key}.weight' must be a finite number > 0 (got {weight!r})")
        for field, tp in (("train_size", int), ("eval_size", int), ("params", dict), ("path", str),
                          ("instruction", str), ("system_prompt", str), ("label", str)):
            if field in entry and entry[field] is not None and not isinstance(entry[field], tp):
                raise ConfigError(f"config key '{key}.{field}' expects a {tp.__name__}, got {entry[field]!r}")
        if entry.get("train_size", 1) < 1:
            raise ConfigError(f"config key '{key}.train_size' must be >= 1 (got {entry['train_size']!r})")
        if entry.get("eval_size", 0) < 0:
            raise ConfigError(f"config key '{key}.eval_size' must be >= 0 (got {entry['eval_size']!r})")
        labels.append(source_label(entry))
    dup = sorted({lab for lab in labels if labels.count(lab) > 1})
    if dup:
        raise ConfigError(f"config key 'task.mixture' has two sources named {dup[0]!r}: give each a distinct "
                          "label (task.mixture[i].label)")
    bad = [lab for lab in labels if "/" in lab or not lab]
    if bad:
        raise ConfigError(f"config key 'task.mixture' label {bad[0]!r} must be non-empty and free of '/' "
                          "(it names metrics such as eval/<label>/accuracy)")


def source_label(entry: dict) -> str:
    if entry.get("label"):
        return str(entry["label"])
    return entry["name"].removeprefix("reasoning_gym:")


def source_configs(cfg: TaskConfig) -> list[tuple[str, float, TaskConfig]]:
    """(label, weight, TaskConfig) of every source: the ``task`` section with the entry's overrides."""
    out = []
    for entry in cfg.mixture:
        over = {k: entry[k] for k in OVERRIDABLE if k in entry}
        sub = dataclasses.replace(cfg, mixture=[], curriculum="none", **over)
        out.append((source_label(entry), float(entry.get("weight", 1.0)), sub))
    return out


def load_mixture(cfg: TaskConfig) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows) of every source, each row tagged with ``row["source"]``."""
    from anabranch.data.tasks import load_task

    train, held = [], []
    for i, (label, _, sub) in enumerate(source_configs(cfg)):
        try:
            t, h = load_task(sub)
        except ConfigError as exc:  # name the entry: "task.name" alone would point at the wrong key
            raise ConfigError(f"task.mixture[{i}] ({label}): {exc}") from exc
        train += [{**row, SOURCE_KEY: label} for row in t]
        held += [{**row, SOURCE_KEY: label} for row in h]
    # Sources may share problems (one file or generator under two labels, overlapping params): a
    # prompt held out by any source leaves every source's training rows, as within one task.
    from anabranch.data.tasks import DataError, _prompt_key

    held_keys = {_prompt_key(r["question"]) for r in held}
    train = [r for r in train if _prompt_key(r["question"]) not in held_keys]
    for i, (label, _, _) in enumerate(source_configs(cfg)):
        if not any(r[SOURCE_KEY] == label for r in train):
            raise DataError(f"task.mixture[{i}] ({label}): no training rows left after removing the prompts "
                            "held out by the other sources; lower their eval_size or use other data")
    return train, held


def source_indices(rows: list[dict], labels: list[str]) -> list[list[int]]:
    """For each label, the indices of ``rows`` from that source (in row order)."""
    pos = {lab: j for j, lab in enumerate(labels)}
    out: list[list[int]] = [[] for _ in labels]
    for i, row in enumerate(rows):
        out[pos[row[SOURCE_KEY]]].append(i)
    return out


def source_prompts(cfg, rows: list[dict], prompts: list[str], tokenizer) -> list[str]:
    """``prompts`` rebuilt with each source's own instruction and system prompt (``cfg``: the whole
    Config). Prompts of sources without those overrides are kept as they are."""
    from anabranch.data.prompts import build_prompt
    from anabranch.rollout.multi_turn import prompt_task

    own = {}
    for (label, _, sub), entry in zip(source_configs(cfg.task), cfg.task.mixture):
        if "instruction" in entry or "system_prompt" in entry:
            own[label] = prompt_task(sub, cfg.rollout)  # with the tools' instructions, as components.py
    if not own:
        return prompts
    return [build_prompt(r, own[r[SOURCE_KEY]], tokenizer) if r[SOURCE_KEY] in own else p
            for r, p in zip(rows, prompts)]


def eval_by_source(rows: list[dict], scores: list[float], labels: list[str], accuracy: bool) -> dict:
    """{label: held-out accuracy (fraction of full-credit problems) or mean reward} per source."""
    from anabranch.eval.accuracy import correct_flags

    out = {}
    for label, idx in zip(labels, source_indices(rows, labels)):
        if not idx:
            continue
        values = [scores[i] for i in idx]
        measured = correct_flags(values) if accuracy else values
        out[label] = sum(measured) / len(measured)
    return out


__all__ = ["SOURCE_KEY", "check_task_config", "source_configs", "load_mixture", "source_indices",
           "source_prompts", "eval_by_source"]
