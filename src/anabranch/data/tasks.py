"""Built-in tasks and the user's own datasets, as lists of ``{"question", "answer", ...}`` rows.

Procedural tasks come from reasoning-gym: the training split and the held-out split are drawn
with different seeds. For every task, training rows whose prompt is also a held-out prompt are
removed, so that the held-out accuracy measures problems never trained on.
"""

from __future__ import annotations

import importlib.util
import json
import logging

from anabranch.config import ConfigError, TaskConfig
from anabranch.data.files import DataError, check_columns, load_rows
from anabranch.registry import Registry

log = logging.getLogger(__name__)

TASKS: Registry = Registry("task")

# Defaults that a 135M model can learn on a CPU in minutes; task.params overrides them.
REASONING_GYM_DEFAULTS = {
    "basic_arithmetic": dict(
        min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=["+", "-"],
        allow_parentheses=False, allow_negation=False,
    ),
    "chain_sum": dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2),
}


def load_task(cfg: TaskConfig) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows) for ``cfg``; with ``task.mixture``, every source's rows, tagged."""
    if cfg.mixture:
        from anabranch.data.mixture import load_mixture

        return load_mixture(cfg)
    if cfg.name == "file":
        return _file_task(cfg)
    if cfg.name in TASKS:
        return TASKS.get(cfg.name)(cfg)
    name = cfg.name.removeprefix("reasoning_gym:")
    if _is_reasoning_gym(name):
        return reasoning_gym_task(cfg, name)
    missing = "" if importlib.util.find_spec("reasoning_gym") else " (reasoning-gym is not installed: pip install reasoning-gym)"
    raise ConfigError(
        f"unknown task {cfg.name!r} in task.name: use a built-in task ({', '.join(TASKS.names())}), "
        f"any reasoning-gym dataset name{missing}, or task.name=file with task.path=..."
    )


def _is_reasoning_gym(name: str) -> bool:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as err:
        # Installed but broken (a dependency of its own missing, as on a machine where packages were
        # copied in by hand) must not read as "unknown task": the task name is probably right.
        if importlib.util.find_spec("reasoning_gym") is not None:
            raise ConfigError(f"task.name={name!r}: reasoning-gym is installed but failed to import "
                              f"({type(err).__name__}: {err}), so its tasks cannot be loaded; repair it, "
                              "e.g. pip install --force-reinstall reasoning-gym") from err
        return False
    return name in DATASETS


def reasoning_gym_task(cfg: TaskConfig, name: str) -> tuple[list[dict], list[dict]]:
    import reasoning_gym

    params = {**REASONING_GYM_DEFAULTS.get(name, {}), **cfg.params}
    try:
        # Held-out problems come from their own seed and are removed from the training split,
        # so that the held-out accuracy measures problems never trained on.
        held = reasoning_gym.create_dataset(name, size=max(4 * cfg.eval_size, 1), seed=cfg.seed + 10_007, **params)
        train = reasoning_gym.create_dataset(name, size=cfg.train_size, seed=cfg.seed, **params)
    except (TypeError, ValueError, AssertionError) as exc:  # reasoning-gym validates its configs with assert
        raise ConfigError(f"task.params {cfg.params} do not fit reasoning-gym task {name!r}: {exc}") from exc
    train_rows, eval_rows = split_held_out(train, held, cfg.eval_size, f"task {name!r} with params {params}")
    return [_rg_row(train, e) for e in train_rows], [_rg_row(held, e) for e in eval_rows]


def split_held_out(train_pool, held_pool, eval_size: int, what: str) -> tuple[list, list]:
    """(training rows, held-out rows) of a procedural task drawn twice with different seeds: the first
    ``eval_size`` distinct questions of ``held_pool`` (short problems repeat), and ``train_pool`` less
    every held-out question, so that the held-out accuracy measures problems never trained on.
    A small problem space can hold fewer distinct problems than asked: said aloud, not silent."""
    held, seen = [], set()
    for row in held_pool:
        if len(held) == eval_size:
            break
        if row["question"] not in seen:
            seen.add(row["question"])
            held.append(row)
    if len(held) < eval_size:
        log.warning("task.eval_size=%d: %s has only %d distinct held-out problems; widen task.params for more",
                    eval_size, what, len(held))
    train = [r for r in train_pool if r["question"] not in seen]
    if not train:
        raise DataError(f"{what} has no training problems left after removing the {len(held)} held-out ones; "
                        "lower task.eval_size or widen task.params")
    return train, held


def _rg_row(dataset, entry: dict) -> dict:
    # The reasoning-gym entry is kept so that its own scorer can be used as a reward.
    # Some tasks have no single answer (None: only their scorer can judge); keep None rather than the
    # text "None", which a math reward would take as the true answer.
    answer = entry["answer"] if entry["answer"] is None else str(entry["answer"])
    return {"question": entry["question"], "answer": answer, "task": "reasoning_gym",
            "rg_entry": entry, "rg_dataset": dataset}


def _file_task(cfg: TaskConfig) -> tuple[list[dict], list[dict]]:
    if not cfg.path:
        raise ConfigError("task.name=file needs task.path=FILE (.jsonl, .parquet, .csv, a saved dataset, or hf:ID)")
    skip = cfg.skip_bad_rows
    rows = check_columns(load_rows(cfg.path, cfg.split, skip), cfg.path, cfg.prompt_column, cfg.answer_column, skip)
    rows = _with_demonstrations(rows, cfg.demonstration_column)  # HPT's SFT target (algorithm.hpt)
    if cfg.eval_split:
        held = check_columns(load_rows(cfg.path, cfg.eval_split, skip, split_key="task.eval_split"),
                             f"{cfg.path}[{cfg.eval_split}]", cfg.prompt_column, cfg.answer_column, skip)
        held = held[: cfg.eval_size]
        train = _without_held_out(rows, held, cfg.path)
        if not train:
            raise DataError(f"dataset {cfg.path}: every training prompt also occurs in the held-out split "
                            f"{cfg.eval_split!r} (task.eval_split)")
        return train[: cfg.train_size], held
    # No held-out split given: keep the last eval_size rows out of training.
    n_eval = min(cfg.eval_size, len(rows) // 2)
    if n_eval < cfg.eval_size:
        log.warning("task.eval_size=%d: %s has %d rows, so only %d are held out (at most half the rows)",
                    cfg.eval_size, cfg.path, len(rows), n_eval)
    train, held = rows[: len(rows) - n_eval], rows[len(rows) - n_eval:]
    train = _without_held_out(train, held, cfg.path)
    if not train:
        raise DataError(f"dataset {cfg.path} has too few distinct rows ({len(rows)}) to train on after holding "
                        f"out task.eval_size={n_eval}")
    return train[: cfg.train_size], held


def _with_demonstrations(rows: list[dict], column: str) -> list[dict]:
    """Each row's reference solution (``task.demonstration_column``) copied into ``row["demonstration"]``
    where it is a non-empty text; rows without one get none (HPT then writes one from the answer)."""
    for row in rows:
        value = row.get(column)
        if isinstance(value, str) and value.strip():
            row["demonstration"] = value
    return rows


def _prompt_key(question) -> str:
    return question if isinstance(question, str) else json.dumps(question, sort_keys=True, default=str)


def _without_held_out(train: list[dict], held: list[dict], source: str) -> list[dict]:
    """``train`` less the rows whose prompt is also a held-out prompt (a dataset with duplicate
    prompts would otherwise train on held-out problems), as for the built-in tasks."""
    held_keys = {_prompt_key(r["question"]) for r in held}
    kept = [r for r in train if _prompt_key(r["question"]) not in held_keys]
    if len(kept) < len(train):
        log.warning("%s: removed %d training rows whose prompt is also held out", source, len(train) - len(kept))
    return kept


__all__ = ["TASKS", "load_task", "DataError"]

# Built-in tasks defined in their own modules register themselves on import.
from anabranch.data import humaneval  # noqa: E402,F401
from anabranch.data import random_calculation  # noqa: E402,F401
from anabranch.data import ssrl_qa  # noqa: E402,F401 - search_qa (SSRL's knowledge QA, rollout/self_search.py)
from anabranch.rollout import env_games  # noqa: E402,F401 - number_guess (rollout.environment's game)
