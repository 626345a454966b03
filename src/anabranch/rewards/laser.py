"""LASER and LASER-D: length-based step rewards around a target length, wrapping a correctness verifier.

Liu, Zhou, Deng, Huang, Liu, Deng, Zhang, He 2025, "Learn to Reason Efficiently with Adaptive
Length-based Reward Shaping" (arXiv 2505.15612). The paper's unified view writes a length-shaped
reward as R̂(x, y) = C(y) + λ(y)·S(L(y)), with C the correctness reward, λ a gate and S a function of
the response length L(y) (tokens when the trainer passes ``response_length``, else characters).

``laser`` — LASER, a step function at a fixed target length L_T (param ``target``):

  C(y) = v(y), the wrapped verifier's value;  λ(y) = 1[y correct];  S(L) = α·1[L ≤ L_T]
  r(y) = v(y) + α·1[y correct]·1[L(y) ≤ L_T]

``laser_d`` — LASER-D, the same step with one target per difficulty level d ∈ {easy, medium, hard}.
A group (the n rollouts of one prompt, k of them correct) is easy when k/n ≥ 2/3, medium when
1/3 ≤ k/n < 2/3, hard when k/n < 1/3; its responses use L_T(d). The targets adapt: every
``update_every`` training steps, from the training rollouts of the steps since the last update
(before the current step: see State below), for each level d

  P_d(l) = fraction of the responses of level-d groups with length ≤ l   (the coverage ratio)
  c_d    = ⌊2n/3⌋ (easy), ⌊n/3⌋ (medium), 1 (hard)   (the fewest correct rollouts a level-d group has)
  L_T(d) = min { l ∈ grid : P_d(l)·c_d ≥ 1 }, else ``max_target``

on the grid ``min_target``, ``min_target`` + ``interval``, …, ``max_target``. P_d(l)·c_d is the
expected number of correct responses within l tokens ("ECR"); the target is the shortest budget at
which a group of that level still expects one correct answer. With ``explore: true`` (LASER-DE) an
incorrect response longer than its target also gets the bonus: r = v + α·1[incorrect]·1[L > L_T(d)],
which rewards exploring further on the problems the policy still fails.

Taken from the authors' released code (hkust-nlp/Laser, ``length_penalty.py``) where the text is
brief: α = 0.5; the difficulty thresholds above (the reward's: k/n ≥ 2/3 easy, ≥ 1/3 medium); c_d as
above (their ``floor`` rounding) with an expected count of 1; coverage over *all* responses of a
level's groups, correct or not; the grid from the lower bound to the maximum response length in
steps of 1024 (their L4096 runs: 4096…16384; ``min_target``/``max_target`` default to those); a level
with no groups in the window gets ``max_target``. Assumed or changed here: the statistics come from
the training rollouts of the window, not from a separate 500-prompt monitoring set evaluated every
20 steps; their monitoring split puts k/n = 1/3 and 2/3 one level lower than the reward does, here
one rule serves both; "correct" is the verifier's full credit (v ≥ 1); LASER-DE's exclusion of
incorrect responses detected as n-gram repetition is not implemented (every long incorrect
response gets the bonus).

State: LASER-D's targets and window live in a :class:`LaserDState` held by the reward source in
the trainer process (the reward runs in a thread, ``in_process``) and saved in checkpoints
(``stateful["reward_state/laser_d"]``), so a resumed run continues with the same targets.

Only training rollouts feed the window: a call carrying the trainer's ``train_step`` field records
its (level, length) pairs as *pending*; the trainer commits every rank's pending records in rank
order after each sampling round (``compose.commit_reward_states``; every dynamic-sampling round's
groups enter the window, the dropped ones too: they are rollouts of the current policy). The targets
used at step t are computed from committed statistics only, i.e. from the steps before t: when an
update is due at t (t ≥ last update + ``update_every``, or no targets yet) they are recomputed from the
window, which then restarts with step t's rollouts. Every rank therefore computes the same targets,
equal to one process's. Before any statistics (the first step) every level's target is
``max_target``, so the first update is at the second step. This replaces "the window including this
step's batch" of the one-process version, which needs the whole batch on one rank; reading
statistics gathered before the step is also closer to the paper's monitoring set, measured apart
from the batch being trained. A call without ``train_step`` (pre-passes, RL-PLUS's demonstrations,
evaluation) uses the targets in force and records nothing.
"""

from __future__ import annotations

import math
from collections import defaultdict

from anabranch.config import ConfigError
from anabranch.rewards.guard import RewardOutput
from anabranch.rewards.length import response_lengths
from anabranch.rewards.registry import REWARDS

LEVELS = ("easy", "medium", "hard")
COMMON = {"reward": "math_verify", "alpha": 0.5, "reward_params": {}}
DEFAULTS = {
    "laser": {**COMMON, "target": 4096},
    "laser_d": {**COMMON, "min_target": 4096, "max_target": 16384, "interval": 1024, "update_every": 20,
                "explore": False},
}


def level_of(k: int, n: int) -> str:
    """Difficulty of a group with k correct of n rollouts (integer comparisons: exact at 1/3, 2/3)."""
    if 3 * k >= 2 * n:
        return "easy"
    return "medium" if 3 * k >= n else "hard"


def min_correct(level: str, n: int) -> int:
    """c_d: the fewest correct rollouts a group of ``level`` has (0 means the level cannot set a target)."""
    return {"easy": (2 * n) // 3, "medium": n // 3, "hard": 1}[level]


def target_grid(min_target: int, max_target: int, interval: int) -> list[int]:
    grid = list(range(min_target, max_target + 1, interval))
    return grid if grid[-1] == max_target else [*grid, max_target]  # never past the maximum


def choose_target(lengths: list[float], c: int, grid: list[int]) -> int:
    """The shortest grid length l with coverage·c ≥ 1, else the grid's last (the maximum)."""
    total = len(lengths)
    for length in grid:
        covered = sum(1 for x in lengths if x <= length)
        if total and c >= 1 and covered * c >= total:  # P·c ≥ 1 in integers: no float rounding at the edge
            return length
    return grid[-1]


class LaserDState:
    """LASER-D's targets per level and the committed lengths since the last update; checkpointed, with the
    pending/commit protocol of ``compose.commit_reward_states`` (pending records are never saved)."""

    def __init__(self, min_target: int = 4096, max_target: int = 16384, interval: int = 1024, update_every: int = 20):
        self.grid = target_grid(int(min_target), int(max_target), int(interval))
        self.update_every = int(update_every)
        self.targets: dict[str, int] | None = None  # None until the first update
        self.last_update: int | None = None
        self.window: dict[str, list[float]] = {lv: [] for lv in LEVELS}
        self.group_size = 0
        self.step: int | None = None  # the training step of the last committed records
        self._pending: list[tuple] = []  # (step, group size, [(level, length)]) of this process's training calls

    def _due(self, step: int) -> bool:
        # A new step (the window then holds earlier steps only) with statistics, and the interval reached.
        return (step != self.step and any(self.window[lv] for lv in LEVELS)
                and (self.targets is None or step >= self.last_update + self.update_every))

    def _computed(self) -> dict[str, int]:
        return {lv: choose_target(self.window[lv], min_correct(lv, self.group_size), self.grid) for lv in LEVELS}

    def targets_at(self, step: int | None) -> dict[str, int]:
        """The targets in force at training step ``step`` (None: a call that is no training rollout);
        ``max_target`` for every level before any statistics. Changes nothing."""
        if step is not None and self._due(int(step)):
            return self._computed()
        return dict(self.targets) if self.targets is not None else {lv: self.grid[-1] for lv in LEVELS}

    def record(self, step: int, group_size: int, records: list[tuple[str, float]]) -> None:
        """Add a training call's (level, length) records to this process's pending ones."""
        self._pending.append((int(step), int(group_size), list(records)))

    def take_pending(self) -> list:
        out, self._pending = self._pending, []
        return out

    def commit(self, entries: list) -> None:
        """Apply entries (every rank's, in rank order): the update due at their step, from the window
        before it (what :meth:`targets_at` gave the calls), then their records enter the window."""
        for step, group_size, records in entries:
            if self._due(step):
                self.targets, self.last_update = self._computed(), step
                self.window = {lv: [] for lv in LEVELS}
            self.step = step
            self.group_size = max(self.group_size, group_size)
            for level, length in records:
                self.window[level].append(float(length))

    def state_dict(self) -> dict:
        return {"targets": self.targets, "last_update": self.last_update, "group_size": self.group_size,
                "step": self.step, "window": {lv: list(v) for lv, v in self.window.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.targets = dict(state["targets"]) if state["targets"] is not None else None
        self.last_update, self.group_size = state["last_update"], state["group_size"]
        self.step = state.get("step", state["last_update"])  # older checkpoints: the last update's step
        self.window = {lv: list(state["window"][lv]) for lv in LEVELS}
        self._pending = []


def _int_at_least(params, key, name, low):
    value = params.get(key, DEFAULTS[name][key])
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"reward.functions[{name}].params.{key} must be an integer >= {low} (got {value!r})")
    return value


def _checker(name: str):
    def check_params(params: dict) -> None:
        """Raise :class:`ConfigError` naming the offending key when ``params`` are invalid."""
        key = f"reward.functions[{name}].params"
        unknown = sorted(set(params) - set(DEFAULTS[name]))
        if unknown:
            raise ConfigError(f"{key}.{unknown[0]}: unknown option (known: {', '.join(DEFAULTS[name])})")
        inner = params.get("reward", "math_verify")
        if not isinstance(inner, str) or inner in ("", *DEFAULTS) or inner not in REWARDS:
            raise ConfigError(f"{key}.reward must name a registered correctness verifier, e.g. math_verify "
                              f"(got {inner!r})")
        alpha = params.get("alpha", 0.5)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
            raise ConfigError(f"{key}.alpha must be a finite number > 0, the bonus for a short correct answer "
                              f"(got {alpha!r})")
        if not isinstance(params.get("reward_params", {}), dict):
            raise ConfigError(f"{key}.reward_params must be a mapping (got {params.get('reward_params')!r})")
        if name == "laser":
            _int_at_least(params, "target", name, 1)
            return
        low = _int_at_least(params, "min_target", name, 1)
        high = _int_at_least(params, "max_target", name, 1)
        if high < low:
            raise ConfigError(f"{key}.max_target must be >= min_target (got {high} < {low})")
        _int_at_least(params, "interval", name, 1)
        _int_at_least(params, "update_every", name, 1)
        if not isinstance(params.get("explore", False), bool):
            raise ConfigError(f"{key}.explore must be true or false (got {params.get('explore')!r})")
    return check_params


def make_state(params: dict) -> LaserDState:
    """The source's targets (compose.build_rewards)."""
    d = DEFAULTS["laser_d"]
    return LaserDState(*(params.get(k, d[k]) for k in ("min_target", "max_target", "interval", "update_every")))


def _row_fields(params: dict) -> tuple:
    inner = REWARDS.meta(params.get("reward", "math_verify")).get("row_fields", ("answer",))
    return tuple(inner(params.get("reward_params", {})) if callable(inner) else inner)


def _verify(reward, prompts, completions, fields, reward_params) -> list[float]:
    out = REWARDS.get(reward)(prompts, completions, **{**fields, **(reward_params or {})})
    return [float(v) for v in (out.values if isinstance(out, RewardOutput) else out)]


@REWARDS.register("laser", check_params=_checker("laser"), row_fields=_row_fields)
def laser_reward(prompts, completions, response_length=None, reward="math_verify", alpha=0.5, target=4096,
                 reward_params=None, **fields):
    """LASER: v + α for a correct response within ``target`` (module docstring)."""
    values = _verify(reward, prompts, completions, {**fields, "response_length": response_length}, reward_params)
    lengths = response_lengths(completions, response_length)
    bonus = [v >= 1.0 and n <= target for v, n in zip(values, lengths)]
    return RewardOutput([v + alpha * b for v, b in zip(values, bonus)],
                        {"bonus_frac": sum(bonus) / max(len(bonus), 1)})


@REWARDS.register("laser_d", check_params=_checker("laser_d"), row_fields=_row_fields,
                  needs_fields=("group_index",), in_process=True, state_factory=make_state)
def laser_d_reward(prompts, completions, group_index=None, response_length=None, train_step=None, reward_state=None,
                   reward="math_verify", alpha=0.5, min_target=4096, max_target=16384, interval=1024,
                   update_every=20, explore=False, reward_params=None, **fields):
    """LASER-D (LASER-DE with ``explore``): the step bonus at each group's difficulty-level target."""
    one_off = reward_state is None  # a direct call: one-off targets from this batch (below)
    if one_off:
        reward_state = LaserDState(min_target, max_target, interval, update_every)
    values = _verify(reward, prompts, completions, {**fields, "group_index": group_index,
                                                    "response_length": response_length, "train_step": train_step},
                     reward_params)
    lengths = response_lengths(completions, response_length)
    correct = [v >= 1.0 for v in values]
    groups: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(group_index):
        groups[g].append(i)
    levels = [""] * len(completions)
    for idx in groups.values():
        level = level_of(sum(correct[i] for i in idx), len(idx))
        for i in idx:
            levels[i] = level
    step = int(train_step[0]) if train_step else None
    size = max((len(idx) for idx in groups.values()), default=0)
    records = list(zip(levels, lengths))
    if one_off:  # this batch committed as step 0, then read at step 1
        reward_state.commit([(0, size, records)])
    targets = reward_state.targets_at(1 if one_off else step)
    short = [c and n <= targets[lv] for c, n, lv in zip(correct, lengths, levels)]
    long_wrong = [explore and not c and n > targets[lv] for c, n, lv in zip(correct, lengths, levels)]
    out = [v + alpha * (s or w) for v, s, w in zip(values, short, long_wrong)]
    m = len(out) or 1
    metrics = {f"target_{lv}": float(targets[lv]) for lv in LEVELS}
    metrics.update(bonus_frac=sum(short) / m, explore_frac=sum(long_wrong) / m)
    if step is not None and not one_off:  # only training rollouts feed the window (module docstring)
        reward_state.record(step, size, records)
    return RewardOutput(out, metrics)
