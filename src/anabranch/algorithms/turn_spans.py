"""Per-turn credit helpers shared by the multi-turn advantage estimators (GiGPO, TRLOO, HiPER, ArCHer (and its
critic, trainer/archer_critic.py), turn_broadcast / turn_norm / spa in algorithms/turn_credit.py, SPA's progress
fit in trainer/spa_step.py) and TCOD's turn-depth curriculum.

A multi-turn response is ``action_1 · observation_1 · action_2 · ...``; turn t's tokens are the t-th maximal run of
trained tokens (mask 1; observations, feedback and padding are 0). Each estimator computes one value per row and
turn, then puts it on that turn's tokens. The pieces they all need:

- :func:`turn_index`: the turn of each trained token; :func:`turn_counts` and :func:`turn_bounds`: each row's number
  of turns and each turn's (first, last) token column;
- :func:`checked_turns` / :func:`env_turns_checked`: that index, after checking the mask has no more runs than the
  rollout recorded turns (an empty final action has no run, so fewer is fine);
- :func:`per_turn_table` and :func:`place_on_turns`: ragged per-turn values → [B, K] → on the tokens;
- :func:`returns_to_go`: G_t = r_t + γ·G_{t+1} per row (zeros past a row's end change nothing before it);
- :func:`group_normalized`: F(x) = (x − mean of the prompt's group) [/ (std + ε)], GRPO's statistics;
- :func:`normalize_within_sets`: the same F over arbitrary sets of (row, turn) entries named by a key (GiGPO's
  anchor states, MARS's turn index), a set of one giving 0;
- :func:`needs_environment`: the config refusal of an estimator run without ``rollout.environment``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Hashable

import torch

from anabranch.algorithms.grpo import group_stats
from anabranch.rollout.base import right_padded_values


def needs_environment(cfg, name: str, does: str) -> str | None:
    """The refusal text when ``algorithm.advantage=name`` (which ``does`` something with the turns of environment
    episodes) runs without ``rollout.environment``, else None (the estimators' config checks)."""
    if cfg.rollout.environment:
        return None
    return (f"algorithm.advantage={name} {does}: set rollout.environment=NAME "
            "(e.g. number_guess with task.name=number_guess)")


def turn_index(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] long: the 0-based turn of each trained token (its maximal run of mask 1), −1 elsewhere."""
    on = mask > 0
    prev = torch.zeros_like(on)
    prev[:, 1:] = on[:, :-1]
    starts = (on & ~prev).long()
    return torch.where(on, starts.cumsum(-1) - 1, torch.full_like(starts, -1))


def turn_counts(turns: torch.Tensor) -> torch.Tensor:
    """[B] long: each row's number of turns with tokens (runs of trained tokens) of a :func:`turn_index` ``turns``."""
    if turns.shape[-1] == 0:  # no response columns (a max over an empty dimension raises)
        return torch.zeros(turns.shape[:-1], dtype=torch.long, device=turns.device)
    return turns.max(-1).values + 1


def turn_bounds(turns: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the (first, last) response column of each turn's tokens, in turn order, of a :func:`turn_index`
    ``turns`` (turns are numbered 0, 1, ... in each row, so every turn below the row's count has tokens)."""
    b, width = turns.shape
    counts = turn_counts(turns)
    k = int(counts.max()) if b else 0
    cols = torch.arange(width, device=turns.device).expand(b, width)
    slot = turns + 1  # column 0 collects the untrained tokens (turn −1), dropped below
    first = torch.full((b, k + 1), width, dtype=torch.long, device=turns.device).scatter_reduce(1, slot, cols, "amin")
    last = torch.full((b, k + 1), -1, dtype=torch.long, device=turns.device).scatter_reduce(1, slot, cols, "amax")
    return [list(zip(starts[1:n + 1], ends[1:n + 1]))
            for starts, ends, n in zip(first.tolist(), last.tolist(), counts.tolist())]


def checked_turns(response_mask: torch.Tensor, made: torch.Tensor, name: str, what: str) -> torch.Tensor:
    """:func:`turn_index` of ``response_mask`` after checking no row has more runs than ``made`` [B] recorded turns
    (``what``: their name in the error, e.g. "environment turns")."""
    turns = turn_index(response_mask)
    # An empty final action has no run: fewer runs than turns is possible, more means mask and turns disagree.
    counts = turn_counts(turns)
    extra = counts > made
    if bool(extra.any()):
        row = int(extra.nonzero()[0, 0])
        raise RuntimeError(f"algorithm.advantage={name}: response {row} has {int(counts[row])} runs of "
                           f"trained tokens but {int(made[row])} {what}")
    return turns


def env_turns_checked(env_turns, response_mask: torch.Tensor, name: str, needs: str) -> torch.Tensor:
    """The turn index of an environment rollout's responses (``Rollout.env_turns``: per row, its turns' (state key,
    step reward)), after checking there are turns, one row of them per response and no extra runs. ``needs``:
    what the estimator reads from them, for the error when there are none."""
    if env_turns is None:
        raise RuntimeError(f"algorithm.advantage={name} needs {needs} (rollout.environment); this batch has none")
    if len(env_turns) != response_mask.shape[0]:
        raise RuntimeError(f"algorithm.advantage={name}: {len(env_turns)} rows of environment turns for "
                           f"{response_mask.shape[0]} responses")
    return checked_turns(response_mask, torch.tensor([len(t) for t in env_turns]), name, "environment turns")


def per_turn_table(rows: list[list[float]], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[B, max(1, K)] of ragged per-row, per-turn values, 0 past a row's end."""
    return right_padded_values(rows, max([1] + [len(v) for v in rows]), dtype=dtype)


def place_on_turns(table: torch.Tensor, turns: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] float32: ``table[i, t]`` on every token of row i's t-th run; 0 on observations and padding."""
    picked = table.to(torch.float32).gather(1, turns.clamp(min=0))
    return torch.where(turns >= 0, picked, torch.zeros_like(picked)) * response_mask.to(torch.float32)


def returns_to_go(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """[B, K] G_{i,t} = r_{i,t} + γ·G_{i,t+1} (G = 0 past the last column), in ``rewards``' dtype."""
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0]) if rewards.shape[1] else None
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        out[:, t] = running
    return out


def discounted(rewards: list[float], gamma: float) -> list[float]:
    """One trajectory's :func:`returns_to_go` (float64)."""
    if not rewards:
        return []
    return returns_to_go(torch.tensor([rewards], dtype=torch.float64), gamma)[0].tolist()


def ragged_returns(rows: list[list[float]], gamma: float) -> list[list[float]]:
    """Per row, the discounted returns of its per-turn rewards (float64), ragged as given."""
    g = returns_to_go(per_turn_table(rows, torch.float64), gamma)
    return [g[i, :len(v)].tolist() for i, v in enumerate(rows)]


def group_normalized(values: torch.Tensor, group_index: torch.Tensor, norm: str, eps: float) -> torch.Tensor:
    """[B] F(x_i) = x_i − mean of the prompt's group, divided by (unbiased std + ``eps``) when ``norm == "std"``."""
    values = values.to(torch.float32)
    mean, std = group_stats(values, group_index)
    dev = values - mean
    return dev / (std + eps) if norm == "std" else dev


def normalize_within_sets(values: list[list[float]], key: Callable[[int, int], Hashable], norm: str,
                          eps: float) -> list[list[float]]:
    """Per row, per turn: F(values[i][t]) over the set of entries (j, k) with ``key(j, k) == key(i, t)``
    (deviation from the set's mean, divided by its unbiased std + ``eps`` with ``norm == "std"``, as
    :func:`group_normalized`); an entry alone in its set gets 0 (nothing to compare with)."""
    sets: dict = defaultdict(list)
    for i, row in enumerate(values):
        for t in range(len(row)):
            sets[key(i, t)].append((i, t))
    out = [[0.0] * len(row) for row in values]
    for members in sets.values():
        if len(members) < 2:
            continue
        v = torch.tensor([values[i][t] for i, t in members], dtype=torch.float64)
        dev = v - v.mean()
        if norm == "std":
            dev = dev / (v.std() + eps)
        for (i, t), a in zip(members, dev.tolist()):
            out[i][t] = a
    return out
