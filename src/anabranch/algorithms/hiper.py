"""HiPER's hierarchical advantage estimation, HAE (``algorithm.advantage=hiper``, keys ``algorithm.hiper.*``).

Peng, Liu, Zhou, Fleming, Wang, Garcia, Hong 2026, "HiPER: Hierarchical Reinforcement Learning with Explicit Credit
Assignment for Large Language Model Agents" (arXiv 2602.16165). The agent's episode is cut into subgoal *segments*:
a planner decides at a segment's first turn (the boundary), an executor acts on every turn under that subgoal. HAE
gives credit at both time scales with GAE: per turn inside a segment (executor), per segment across the episode
(planner, a semi-MDP whose steps are segments), each bootstrapping from the critic at the next boundary.

One response is one episode of ``rollout.environment`` (rollout/environments.py): turn t (t = 0..T−1) is the t-th run
of trained tokens; u_t its reward (the environment's step reward r_t, the last turn also taking R − Σ_t r_t so the
turn rewards sum to the configured reward total R, as turn_norm's ``outcome_turn_rewards``); V_t the value head's
estimate of the state before turn t (read at turn t's first action token: ``ppo_value.response_values`` gives each
token the value of the state it was sampled in); V_T = 0 (the episode ended or was cut: no bootstrap). Segments
[s_k, e_k]: with ``segments=fixed`` (the default) one starts every ``segment_turns`` = K turns (s_k = kK); with
``segments=tags`` at turn 0 and at every turn whose action text (``Rollout.env_actions``) holds a ``<switch>`` tag
that does not say KEEP (:func:`switch_starts`, the authors' rule). With γ ``gamma``, λ_L ``lam_turn``, λ_H
``lam_seg``:

    executor (turn level, inside segment k only):
        δ_t   = u_t + γ·V_{t+1} − V_t                    (at t = e_k: V_{e_k+1} is the next boundary's value)
        A^L_t = δ_t + γλ_L·A^L_{t+1}   for t < e_k,      A^L_{e_k} = δ_{e_k}   (the recursion stops at the boundary)
    planner (segment level, over the episode):
        R_k   = Σ_{j=0}^{d_k−1} γ^j·u_{s_k+j},           d_k = e_k − s_k + 1
        δ^H_k = R_k + γ^{d_k}·V_{s_{k+1}} − V_{s_k}
        A^H_k = δ^H_k + γ^{d_k}λ_H·A^H_{k+1}             (A^H after the last segment = 0)
    tokens of turn t:  A^L_t, plus A^H_k when t = s_k;   critic target of turn t's tokens: A^L_t + V_t

``norm=batch`` whitens each level over the batch before placing (A^L over every turn, A^H over every segment;
population std + 1e-8); ``none`` leaves them raw. The critic is anabranch's PPO value head (algorithms/ppo_value.py:
the same head, its clipped value loss with ``vf_coef`` / ``vf_clip``), trained on every action token of turn t toward
A^L_t + V_t: inside a turn nothing is rewarded or discounted (γ acts per turn), so each of its states has that target.

What was read: the abstract (arXiv 2602.16165: a planner proposing subgoals and an executor carrying them out over
several action steps; HAE aggregates returns over each subgoal's execution and coordinates both levels, unbiased and
with lower variance than flat GAE), summaries of the paper (PPO-style actor-critic, one shared critic with value
heads), and the authors' released code (JonP07/HiPER-agent, ``core_hgae.py``, ``hier_mask.py``) as we read it, which
the formulas above follow: a boundary is the first turn or a turn whose ``<switch>`` tag does not say KEEP (a missing
tag counts as KEEP); turn-level GAE runs inside each segment and bootstraps at its end from the high-level value of
the next boundary; the segment return is discounted inside the segment and the segment-level GAE discounts by γ^d;
the high-level advantage goes to the boundary turn's subgoal tokens, the low-level one to the action tokens (all the
response's tokens when no ``<action>`` tag is found); with no high-level value head the low head stands for both (our
one head); defaults γ = 1, λ_H = 0.95, each level whitened over the batch (std + 1e-8) in the published scripts.
The paper's method section itself was not available to us.

Assumed (differences from the paper): by default segments of a fixed K turns (``segment_turns``, default 2) instead
of the policy's own SWITCH/KEEP decisions, since a plain environment's prompt does not ask the policy for
``<switch>`` tags (``segments=tags`` reads them, for a task whose prompt asks for them); both levels' advantages on
all of the boundary turn's tokens, with tags too (a plain environment action has no separate subgoal / action tags:
the authors' code does the same when no ``<action>`` tag parses); λ_L = 1 (verl's ``algorithm.lam`` default, which we
take to be the turn-level λ); a cut episode bootstraps 0 (the authors' ``bootstrap_truncated`` default); no
switching (termination) head and none of the authors' optional KEEP / consistency / invalid-action penalties; one
value head for both levels (the paper's critic has two heads on a shared backbone).
"""

from __future__ import annotations

import math
import re

import torch

from anabranch.algorithms.ppo_value import value_loss, value_modules
from anabranch.algorithms.registries import ADVANTAGES
from anabranch.algorithms.turn_credit import outcome_turn_rewards
from anabranch.algorithms.turn_spans import (env_turns_checked, needs_environment, per_turn_table, place_on_turns,
                                             turn_bounds)

NAME = "hiper"
NORMS = ("batch", "none")
SEGMENTS = ("fixed", "tags")
WHITEN_EPS = 1e-8  # the authors' code's
_SWITCH = re.compile(r"<switch>(.*?)</switch>", re.DOTALL)


def segment_starts(n_turns: int, k: int) -> list[int]:
    """The first turn of each segment of ``k`` turns: [0, k, 2k, ...] below ``n_turns``."""
    return list(range(0, n_turns, k))


def switch_starts(turn_texts: list[str]) -> list[int]:
    """The paper's segmentation from each turn's action text: turn 0 and every turn whose ``<switch>`` tag's content
    is not KEEP (case and spaces ignored; no tag or an empty one counts as KEEP)."""
    starts = []
    for t, text in enumerate(turn_texts):
        found = _SWITCH.search(text)
        decision = found.group(1).strip().upper() if found else ""
        if t == 0 or decision not in ("", "KEEP"):
            starts.append(t)
    return starts


def episode_hae(rewards: list[float], values: list[float], starts: list[int], gamma: float, lam_turn: float,
                lam_seg: float) -> tuple[list[float], list[float]]:
    """(A^L per turn, A^H per segment) of one episode (module docstring); V after the last turn is 0."""
    n = len(rewards)
    v = list(values) + [0.0]
    bounds = list(starts) + [n]
    low = [0.0] * n
    for s, nxt in zip(bounds[:-1], bounds[1:]):
        carry = 0.0  # nothing flows back across the segment's end
        for t in reversed(range(s, nxt)):
            carry = rewards[t] + gamma * v[t + 1] - v[t] + gamma * lam_turn * carry
            low[t] = carry
    high = [0.0] * len(starts)
    carry = 0.0
    for k in reversed(range(len(starts))):
        s, nxt = bounds[k], bounds[k + 1]
        d = nxt - s
        seg_return = sum(gamma ** j * rewards[s + j] for j in range(d))
        carry = seg_return + gamma ** d * v[nxt] - v[s] + gamma ** d * lam_seg * carry
        high[k] = carry
    return low, high


def whiten_entries(rows: list[list[float]]) -> list[list[float]]:
    """Every entry of ``rows`` minus their mean over all rows, over their population std + 1e-8 (one entry: 0)."""
    # Not advantages.whiten (sample std, max(std, ε)) on purpose: population std + ε is the authors' code's whitening.
    flat = [x for r in rows for x in r]
    if not flat:
        return rows
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / len(flat))
    return [[(x - mean) / (std + WHITEN_EPS) for x in r] for r in rows]


def turn_values(values: torch.Tensor, turns: torch.Tensor, n_turns: list[int]) -> list[list[float]]:
    """Per row, V_t at turn t's first action token (0 for a turn with no token: an empty final action)."""
    rows = values.tolist()
    out = []
    for i, (n, spans) in enumerate(zip(n_turns, turn_bounds(turns))):
        row = [0.0] * n
        for t, (first, _) in enumerate(spans[:n]):
            row[t] = float(rows[i][first])
        out.append(row)
    return out


def episode_starts(h, env_turns: list, env_actions) -> list[list[int]]:
    """Each row's segment starts: every ``segment_turns`` turns, or (``segments=tags``) from its turns' action texts."""
    if h.segments != "tags":
        return [segment_starts(len(t), h.segment_turns) for t in env_turns]
    if env_actions is None:
        raise RuntimeError("algorithm.hiper.segments=tags reads each turn's action text (Rollout.env_actions), which "
                           "only the environment rollout (rollout.environment) records")
    if [len(a) for a in env_actions] != [len(t) for t in env_turns]:
        raise RuntimeError("algorithm.hiper.segments=tags: the rollout's action texts (Rollout.env_actions) do not "
                           "match its environment turns (Rollout.env_turns) row by row")
    return [switch_starts(a) for a in env_actions]


@ADVANTAGES.register(NAME, needs=("values", "hidden"), modules=value_modules, aux_loss=value_loss)
def hiper_advantage(rewards, group_index, response_mask, cfg, env_turns=None, values=None, env_actions=None, **_):
    """HAE (module docstring). Returns ``(advantages, {"returns": critic targets})`` as ``gae`` does."""
    turns = env_turns_checked(env_turns, response_mask, NAME,
                              "each turn's reward from an environment rollout, to cut its episodes into segments")
    if values is None:
        raise RuntimeError("algorithm.advantage=hiper needs per-token values from the value head")
    h = cfg.hiper
    u = outcome_turn_rewards(env_turns, rewards)
    v = turn_values(values.float(), turns, [len(t) for t in env_turns])
    starts = episode_starts(h, env_turns, env_actions)
    low, high = zip(*[episode_hae(r, vr, s, h.gamma, h.lam_turn, h.lam_seg) for r, vr, s in zip(u, v, starts)]) \
        if u else ((), ())
    target = per_turn_table([[a + b for a, b in zip(lr, vr)] for lr, vr in zip(low, v)])
    low, high = list(low), list(high)
    if h.norm == "batch":
        low, high = whiten_entries(low), whiten_entries(high)
    per_turn = [list(lr) for lr in low]
    for row, hr, s in zip(per_turn, high, starts):
        for a, t in zip(hr, s):
            row[t] += a
    adv = place_on_turns(per_turn_table(per_turn), turns, response_mask)
    return adv, {"returns": place_on_turns(target, turns, response_mask)}


def hiper_inputs(cfg) -> dict:
    """The estimator's input the trainer passes from the rollout (``Algorithm.advantage_inputs``)."""
    if cfg.advantage != NAME:
        return {}
    if cfg.hiper.segments == "tags":
        return {"env_turns": lambda rollout: rollout.env_turns, "env_actions": lambda rollout: rollout.env_actions}
    return {"env_turns": lambda rollout: rollout.env_turns}


def check_hiper_config(cfg) -> str | None:
    """Whole-config refusals for ``advantage=hiper`` at load (None when fine): its key ranges, an environment whose
    episodes have turns, losses that never read the advantages, and options that reshape whole-sequence advantages."""
    from anabranch.algorithms.registries import lost_per_token_credit, whole_sequence_reshaper
    from anabranch.range_checks import first_failed, is_count, is_number

    a = cfg.algorithm
    if a.advantage != NAME:
        return None
    h = a.hiper
    # is_number / is_count first: a bool (YAML true), a string or None is this refusal, not 1.0 or a TypeError
    error = first_failed([
        *((is_number(getattr(h, k)) and 0 <= getattr(h, k) <= 1, k, "must be in [0, 1]")
          for k in ("gamma", "lam_turn", "lam_seg")),
        (is_count(h.segment_turns) and h.segment_turns >= 1, "segment_turns", "must be an integer >= 1"),
        (h.norm in NORMS, "norm", "must be batch or none"),
        (h.segments in SEGMENTS, "segments", "must be fixed or tags")], "algorithm.hiper", h)
    if error is not None:
        return error
    return needs_environment(cfg, "hiper", "cuts multi-turn episodes into subgoal segments") or \
        lost_per_token_credit(a, "HAE's per-turn and per-segment advantages") or \
        whole_sequence_reshaper(a, "HiPER", "turn")
