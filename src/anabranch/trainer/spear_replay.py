"""SPEAR in the training loop: the self-imitation buffer and which rows a step trains.

SPEAR (Qin et al. 2025, arXiv 2509.22601; the formulas and what is confirmed vs assumed are in algorithms/spear.py)
is on with ``algorithm.spear.enabled``. It shares RoRecomp's replay machinery (trainer/replay.py: ``Chunk``,
``ReplayBuffer``'s FIFO cap / age / pop, ``merge``, the behaviour pass and the replayed-row marks that
trainer/step.py reads, the per-rank checkpoint state, the shared refusals). At the loop's hook, after the step's advantages, each step s:

1. drops buffered rows older than ``max_age`` steps;
2. adds this step's group reward means/stds to the baseline history (under DDP every rank's groups: the
   baseline is global, the same on every rank) and recalibrates every buffered row's Â against it; rows with
   Â ≤ 0 leave the buffer;
3. when at least K = ``replay_rows`` rows wait, the K oldest leave the buffer and train in this step, with Â·c_s
   as their advantage on every token but those Clip-Cov detaches (a no-grad pass of π_θ over them), and the
   clipped ratio to the behaviour log-probs of the step that sampled them;
4. this step's rows with A > 0 (and a recalibrated Â > 0) enter the buffer with their behaviour log-probs
   (the precomputed ``old_log_prob`` or a no-grad pass before the update), their reward and precomputed tensors;
   the oldest rows beyond ``buffer_size`` are dropped. They never replay in the step that sampled them.

The step trains all its own rows as without SPEAR, plus the replayed ones: with ``replay_step=joint`` (the default)
in its one update, with ``replay_step=separate`` in a second optimizer step after the on-policy one, on the replayed
rows alone (trainer/spear_update.py; the loop's ``replay_update`` hook; under DDP all ranks take it or none: it is
due when any rank has K rows waiting, one gather per step, and a rank short of K replays the rows it has, none
being one row without trained tokens). With ``tool_reward.coef > 0`` the loop's
``tool_reward`` hook adds the decayed tool-call bonus to each row's reward before the advantages. Under DDP (W processes) the buffer
is per rank (each rank keeps its own groups' wins, ⌈size/W⌉ rows, replays ⌈K/W⌉), the baseline global; FSDP /
ZeRO-3 are refused (ranks would train different numbers of rows). Checkpoint/resume: stateful ``spear`` in
``trainer_state.pt``, every rank's buffer (each restores its own) and the baseline history.

Refused at config load (``check_config``): RoRecomp together (both recompose the trained rows), the objectives
RoRecomp refuses for reading group statistics from the update's own rows or matching a distribution over
unbiased draws (replayed rows are neither a whole group nor this policy's draws), methods that rebuild the
step's rows by position, and ``tool_reward.coef > 0`` without rollout.tools (nothing to count).
"""

from __future__ import annotations

import torch

from anabranch.algorithms.spear import (RECALIBRATIONS, REPLAY_STEPS, BaselineHistory, covariance_keep,
                                        group_reward_stats, recalibrated, replay_coef, tool_bonus, tool_calls,
                                        tool_reward_weight)
from anabranch.config import ConfigError
from anabranch.range_checks import first_failed
from anabranch.rollout.base import Rollout
from anabranch.trainer.advantage_pass import rollout_forward
from anabranch.trainer.replay import Chunk, ReplayMethod, mark_rows, merge, replay_refusal, step_chunk
from anabranch.trainer.rorecomp import Recomposed, compensation_rows
from anabranch.trainer.spear_update import empty_rows, separate_update

_OFF = "algorithm.spear.enabled=false"


def check_config(cfg) -> None:
    """Config-load refusals and key ranges (config_checks' method table); nothing while SPEAR is off."""
    s, a = cfg.algorithm.spear, cfg.algorithm
    if not s.enabled:
        return
    error = first_failed([
        (s.buffer_size >= 1, "buffer_size", "must be >= 1"),
        (s.replay_rows >= 0, "replay_rows", "must be >= 0 (0: one step's batch)"),
        (s.max_age >= 0, "max_age", "must be >= 0 (0: rows never age out)"),
        (s.recalibration in RECALIBRATIONS, "recalibration", f"must be one of {RECALIBRATIONS}"),
        (0 < s.advantage_decay <= 1, "advantage_decay", "must be in (0, 1]"),
        (s.baseline_groups >= 1, "baseline_groups", "must be >= 1"),
        (s.coef > 0, "coef", "must be > 0 (turn the replay off with algorithm.spear.enabled=false)"),
        (s.warmup_steps >= 0, "warmup_steps", "must be >= 0"),
        (0 <= s.cov_clip_ratio <= 1, "cov_clip_ratio", "must be in [0, 1] (0: no covariance clipping)"),
        (s.cov_clip_low <= s.cov_clip_high, "cov_clip_low", "must be <= algorithm.spear.cov_clip_high"),
        (s.replay_step in REPLAY_STEPS, "replay_step", f"must be one of {REPLAY_STEPS}"),
    ], "algorithm.spear", s) or check_tool_reward(cfg)
    if error:
        raise ConfigError(error)
    if (k := replay_rows(cfg)) > s.buffer_size:
        raise ConfigError(f"algorithm.spear.replay_rows={k} exceeds algorithm.spear.buffer_size={s.buffer_size}: no "
                          "replay could ever be due; raise the buffer size or lower replay_rows")
    if a.rorecomp_fraction > 0:
        raise ConfigError("algorithm.spear.enabled with algorithm.rorecomp_fraction > 0: both recompose the rows a "
                          "step trains from their own replay buffers; set algorithm.rorecomp_fraction=0 or " + _OFF)
    error = replay_refusal(cfg, "algorithm.spear.enabled", _OFF,
                           "this step's groups plus replayed single winners of earlier groups (earlier policies')")
    if error:
        raise ConfigError(error)


def check_tool_reward(cfg) -> str | None:
    """The tool-call reward's refusal text, or None: key ranges, rollout.tools, knobs set while coef = 0."""
    t = cfg.algorithm.spear.tool_reward
    error = first_failed([
        (t.coef >= 0, "coef", "must be >= 0 (0: no tool-call reward)"),
        (t.cap > 0, "cap", "must be > 0"),
        (t.decay_steps >= 0, "decay_steps", "must be >= 0 (0: no decay)"),
    ], "algorithm.spear.tool_reward", t)
    if error:
        return error
    if t.coef > 0 and not cfg.rollout.tools:
        return ("algorithm.spear.tool_reward.coef > 0 without rollout.tools: the bonus counts the tool calls of "
                "each response, and a rollout without tools has none; set rollout.tools (e.g. [python]) or "
                "algorithm.spear.tool_reward.coef=0")
    if t.coef == 0 and t != type(t)():
        return (f"algorithm.spear.tool_reward={t} has no effect with tool_reward.coef=0 (the bonus is off); "
                "set algorithm.spear.tool_reward.coef > 0 or leave the section at its defaults")
    return None


def replay_rows(cfg) -> int:
    """K (global): ``algorithm.spear.replay_rows``, or one step's batch when 0 (RoRecomp's rule)."""
    k = cfg.algorithm.spear.replay_rows
    return k if k > 0 else compensation_rows(cfg)


def row_advantage(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] each row's advantage: its mean over the trained tokens (the outcome estimators' A_i; 0 without any)."""
    adv = advantages.reshape(advantages.shape[0], -1).float()
    if adv.shape[1] == 1:
        return adv[:, 0]
    m = mask.float()
    return (adv * m).sum(-1) / m.sum(-1).clamp(min=1)


class Spear(ReplayMethod):
    """What the loop holds for SPEAR: the buffer and baseline (stateful ``spear``) and the per-step replay."""

    def __init__(self, cfg, dist=None, model=None):
        s = cfg.algorithm.spear
        self.s, self.algo_cfg = s, cfg.algorithm
        self.dist = dist if dist is not None and dist.world_size > 1 else None
        self._setup_replay(cfg, dist, model, replay_rows(cfg), s.buffer_size, s.max_age)
        self.history = BaselineHistory(s.baseline_groups)
        # replay_step=separate: (chunk, Â, c_k) of the rows this step replays, trained by replay_update after the
        # on-policy update; None otherwise (joint mode never sets it).
        self.pending = None

    @classmethod
    def create(cls, cfg, dist=None, c=None) -> "Spear | None":
        """None unless ``algorithm.spear.enabled`` (the default: nothing on the hot path)."""
        if not cfg.algorithm.spear.enabled:
            return None
        check_config(cfg)  # configs built in code skip load_config
        cls.check_runtime(dist, c, "algorithm.spear.enabled", _OFF, "which replayed single rows are not",
                          "SPEAR's ranks train different numbers of replayed rows")
        return cls(cfg, dist, None if c is None else c.model)

    def _advantages(self, chunk: Chunk) -> torch.Tensor:
        """[len(chunk)] Â of buffered rows against the current baseline."""
        stored = row_advantage(chunk.advantages, chunk.rollout.trained_mask.cpu())
        return recalibrated(chunk.rewards, stored, self.s.recalibration, self.history.baseline(),
                            self.s.advantage_decay, self.algo_cfg.norm_adv_by_std, self.algo_cfg.adv_epsilon)

    def _keep_wins(self) -> int:
        """Drop buffered rows whose recalibrated Â is no longer > 0; the number dropped."""
        before, kept = len(self.buffer), []
        for c in self.buffer.chunks:
            rows = torch.nonzero(self._advantages(c) > 0).flatten().tolist()
            if rows:
                kept.append(c if len(rows) == len(c) else c.take(rows))
        self.buffer.chunks = kept
        return before - len(self.buffer)

    def _replayed(self, due: list[Chunk], step: int, micro_tokens: int) -> tuple[Chunk, dict]:
        """The due rows as one chunk, advantages Â·c_s on their tokens with Clip-Cov's detached tokens at 0."""
        out = merge(due)
        out = Chunk(out.born, out.rollout, out.advantages, dict(out.precomputed), out.rewards)
        coef = replay_coef(step, self.s.coef, self.s.warmup_steps)
        adv_row = self._advantages(out)
        mask = out.rollout.trained_mask.cpu().float()
        adv = (adv_row * coef)[:, None].expand(-1, mask.shape[1]).clone()
        keep = torch.ones_like(adv)
        if self.s.cov_clip_ratio > 0 and self.model is not None:
            with torch.no_grad():  # π_θ now, before the update: Cov_t's log-probs and the ratio's clip test
                lp, _ = rollout_forward(self.model, out.rollout, self.micro, self.temperature,
                                        share_prefix=self.share_prefix, micro_batch_tokens=micro_tokens)
            keep = covariance_keep(lp.float().cpu(), out.precomputed["behaviour_log_prob"].float(), adv, mask,
                                   self.algo_cfg, self.s.cov_clip_ratio, self.s.cov_clip_low, self.s.cov_clip_high)
        out.advantages = (adv * keep).to(out.advantages.dtype)
        tokens = float(mask.sum())
        return out, {"spear/replay_coef": coef, "spear/replay_advantage": float(adv_row.mean()),
                     "spear/cov_clipped_frac": float(((1 - keep) * mask).sum()) / max(tokens, 1.0)}

    def step(self, batch, train_rollout: Rollout, advantages: torch.Tensor, precomputed: dict,
             rewards: torch.Tensor, step: int, micro_tokens: int = 0) -> Recomposed:
        """This step's rows plus the replayed ones (``Recomposed``); metrics go into ``batch.metrics`` (spear/...)."""
        n = int(rewards.shape[0])
        whole = step_chunk(step, train_rollout, advantages, precomputed, rewards)
        expired = self.buffer.expire(step)
        means, stds = group_reward_stats(whole.rewards, train_rollout.group_index)
        if self.dist is not None:  # the baseline is global: every rank's groups, in rank order
            parts = self.dist.gather_objects((means, stds))
            means, stds = [x for m, _ in parts for x in m], [x for _, s in parts for x in s]
        self.history.add(step, means, stds)
        dropped = self._keep_wins()
        self.pending = None
        ready = len(self.buffer) >= self.k
        if self.s.replay_step == "separate" and self.dist is not None:
            # The replay step's policy_update holds collectives (normalizers, DDP's all-reduce): every rank takes it
            # when any rank has K rows due, a rank short of K with the rows it has (none: empty_rows).
            ready = any(self.dist.gather_objects(ready))
        due = self.buffer.pop(self.k) if ready else []
        # Admission: the row's own advantage > 0 and, recalibrated now, still > 0 (p50: R > b).
        mask = train_rollout.trained_mask.cpu()
        wins = (row_advantage(whole.advantages, mask) > 0) & (self._advantages(whole) > 0)
        rest = torch.nonzero(wins).flatten().tolist()[-self.buffer.capacity:]  # the cap would drop the older ones
        entering = whole.take(rest)
        if rest:
            mark_rows(entering, self.behaviour_log_prob(entering.rollout, entering.precomputed, micro_tokens))
        self.buffer.add(entering)
        metrics = {"spear/replayed_rows": 0.0, "spear/replay_coef": 0.0, "spear/replay_advantage": 0.0,
                   "spear/cov_clipped_frac": 0.0}
        out = whole
        if ready and self.s.replay_step == "separate":  # trained alone after the on-policy update (replay_update)
            chunk = merge(due) if due else empty_rows(whole)  # empty: a DDP rank with no row due joins the step
            adv_row = self._advantages(chunk) if due else torch.zeros(1)
            coef = replay_coef(step, self.s.coef, self.s.warmup_steps)
            self.pending = (chunk, adv_row, coef)
            metrics.update({"spear/replayed_rows": float(len(chunk)) if due else 0.0, "spear/replay_coef": coef,
                            "spear/replay_advantage": float(adv_row.mean())})
        elif due:
            replayed, m = self._replayed(due, step, micro_tokens)
            fresh = whole.take(list(range(n)))
            mark_rows(fresh, None)
            out = merge([fresh, replayed])
            metrics.update(m, **{"spear/replayed_rows": float(len(replayed))})
        base = self.history.baseline()
        metrics.update({"spear/admitted_rows": float(len(rest)), "spear/buffer_rows": float(len(self.buffer)),
                        "spear/expired_rows": float(expired), "spear/dropped_rows": float(dropped),
                        "spear/baseline": 0.0 if base is None else base[0]})
        # Every key on every step: each log has them, and under DDP (mean_metrics averages a key over the
        # ranks that log it) each is a mean over all W.
        batch.metrics.update(metrics)
        return Recomposed(out.rollout, out.advantages, out.precomputed, out.rewards)

    def replay_update(self, c, dist, cfg, micro_tokens: int = 0, oom_retry: bool = False) -> dict:
        """replay_step=separate: the pending replayed rows' own optimizer step (trainer/spear_update.py), after the
        on-policy update; its metrics (spear/replay/..., spear/cov_clipped_frac). {} when nothing is pending."""
        if self.pending is None:
            return {}
        chunk, adv_row, coef = self.pending
        self.pending = None
        return separate_update(self, chunk, adv_row, coef, c, dist, cfg, micro_tokens, oom_retry)

    def tool_reward(self, batch, step: int) -> None:
        """The tool-call curriculum on a scored batch before its advantages: ``batch.total`` += w_k·min(coef·n_i,
        cap), logged as the reward source ``spear_tool_call``; nothing while tool_reward.coef = 0."""
        t = self.s.tool_reward
        if t.coef == 0:
            return
        ro = batch.rollout
        calls = tool_calls(ro.response_mask.cpu(), ro.trained_mask.cpu())
        w = tool_reward_weight(step, t.decay_steps)
        bonus = tool_bonus(calls, t.coef, t.cap, w)
        batch.total = [r + b for r, b in zip(batch.total, bonus.tolist())]
        batch.per_source = {**batch.per_source, "spear_tool_call": bonus.tolist()}
        batch.metrics = {**batch.metrics, "spear/tool_reward_weight": w, "spear/tool_calls_mean": float(calls.mean()),
                         "spear/tool_bonus_mean": float(bonus.mean())}

    def state_dict(self) -> dict:
        """Every rank's buffer and the (global) baseline history (a collective under DDP: called on every rank)."""
        return {**self._buffer_state(), "baseline": self.history.state()}

    def load_state_dict(self, state: dict) -> None:
        self._load_buffer(state)
        self.history.load(state.get("baseline", []))
