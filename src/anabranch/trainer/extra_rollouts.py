"""Adaptive rollout budgets for hard prompts: DARS's extra rollouts (``rollout.extra_rollouts=dars``).

Yang, Guo, Huang, Wang, Xie, Wang, Liang, Tang 2025, "Depth-Breadth Synergy in RLVR: Unlocking LLM
Reasoning Gains with Adaptive Exploration" (arXiv 2508.13755), Difficulty Adaptive Rollout Sampling.
Without std normalization a group of N samples with accuracy a carries the cumulative advantage
Σ|Â| = 2N·a(1 − a): most at a = 1/2, little for hard prompts. DARS first samples N = ``rollout.n`` per
prompt (the pre-rollout), estimates a from them, and gives each prompt with a < ``dars_threshold``
extra samples, generated in a second stage and appended to *its own group* (same ``group_index``),
so the advantages are computed over the enlarged group of N + Δn samples:

- ``equal`` (ET, "equal treatment"): N_tot(a) = N / (4a(1 − a)), which raises N_tot·a(1 − a) to an
  a = 1/2 group's N/4;
- ``hardness`` (HW, "hardness weighted"): N_tot(a) = max(N / (4a(1 − a)), 3N / (8a)), more for
  the hardest;
- ``fixed``: N_tot = N + ``dars_max_extra`` for every hard prompt (DRIVE's "8 → 64" budget, below).

Δn = min(max(⌊N_tot + ½⌋ − N, 0), ``dars_max_extra``), and Δn = ``dars_max_extra`` at a = 0 (N_tot is
unbounded there). Assumed where the paper's text was not readable here: ET's form is inferred from
the authors' released schedule (github.com/yangzhch6/DARS, N = 8: totals 32/18/11/9 at
a = 0, 1/8, 2/8, 3/8, which ET reproduces with the cap 24), and HW's form is the simplest one that
reproduces their second table (48/24/12/9; with the cap 40 at a = 0) — not the paper's stated formula.
The authors' code then drops enlarged groups whose accuracy is 0 or 1: here that is DAPO's dynamic
sampling (``algorithm.dynamic_sampling=true``), which judges the enlarged groups. DARS-B's "breadth"
(large full-batch updates) is a configuration: a large ``rollout.prompts_per_step`` with
``algorithm.ppo_epochs`` > 1.

DRIVE's hard-focus stage (Zhu et al. 2025, "DRIVE: Data Curation Best Practices for Reinforcement
Learning with Verifiable Reward in Competitive Code Generation", arXiv 2511.06307) trains a small
curated set of hard problems with 64 rollouts each; ``rollout.n=8 dars_schedule=fixed
dars_max_extra=56`` is its per-step reading (see docs/algorithms.md for what differs).

Accuracy is the correctness reward's full-credit flags (eval/accuracy.py, as dynamic sampling counts
them), or the total reward's where no source says right/wrong. Under data parallelism each rank tops
up its own prompts' groups (groups never cross ranks), so ranks do unequal work; the loss normalizers
are all-reduced (Distributed.batch_scale) and the logged counts summed over ranks.
"""

from __future__ import annotations

import math

import torch

SCHEDULES = ("equal", "hardness", "fixed")


def total_samples(acc: float, n: int, schedule: str) -> float:
    """N_tot(a) of the schedule (module docstring); ``inf`` at a = 0 for equal and hardness."""
    if schedule == "fixed":
        return math.inf
    if acc <= 0.0:
        return math.inf
    if acc >= 1.0:
        return float(n)
    equal = n / (4.0 * acc * (1.0 - acc))
    return equal if schedule == "equal" else max(equal, 3.0 * n / (8.0 * acc))


def extra_counts(accs: list[float], n: int, schedule: str, threshold: float, max_extra: int) -> list[int]:
    """Δn of each prompt: 0 unless its accuracy is below ``threshold``, then the schedule's, capped."""
    out = []
    for a in accs:
        if a >= threshold:
            out.append(0)
            continue
        tot = total_samples(a, n, schedule)
        out.append(max_extra if math.isinf(tot) else min(max(math.floor(tot + 0.5) - n, 0), max_extra))
    return out


def group_accuracy(batch, sources=None, correct: list[float] | None = None) -> list[float]:
    """Per group 0..G−1: the fraction of its samples with full credit (0 for a group without rows), in
    float64 (2 of 3 right is 2/3's nearest double, which SEELE's fit reads). ``correct``: the rows' 0/1 flags
    when already known, else ``batch_correct(batch, sources)``."""
    from anabranch.eval.accuracy import batch_correct

    flags = torch.tensor(batch_correct(batch, sources) if correct is None else correct, dtype=torch.float64)
    g = batch.rollout.group_index.long()
    n_groups = len(batch.rollout.prompts)
    hits = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, g, flags)
    sizes = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, g, torch.ones_like(flags))
    return (hits / sizes.clamp(min=1.0)).tolist()


def top_up(c, batch, idx: list[int], cfg, step=None, round_: int = 1, dist=None):
    """``batch`` (the first ``rollout.n`` samples of prompts ``idx``, scored) with each hard prompt's
    extra samples generated, scored and placed right after its group's rows (groups stay contiguous,
    which the micro-batch planner needs). Adds ``rollout/extra_samples``, ``rollout/hard_prompts``,
    ``rollout/scored_prompts`` and ``rollout/hard_prompt_frac`` (summed over ranks under ``dist``)."""
    from anabranch.trainer.collect import generate_scored

    r = cfg.rollout
    accs = group_accuracy(batch, c.rewards)
    counts = extra_counts(accs, r.n, r.dars_schedule, r.dars_threshold, r.dars_max_extra)
    hard = sum(a < r.dars_threshold for a in accs)
    out = batch
    if sum(counts):
        extra = generate_scored(c, [i for i, k in zip(idx, counts) for _ in range(k)], cfg, step, round_, n=1)
        owner = torch.tensor([g for g, k in enumerate(counts) for _ in range(k)], dtype=batch.rollout.group_index.dtype)
        out = merge_groups(batch, extra, owner)
    totals = torch.tensor([float(sum(counts)), float(hard), float(len(accs))], dtype=torch.float64)
    if dist is not None and dist.world_size > 1:  # every rank calls this once per round (same rounds)
        totals = dist.all_reduce_sum(totals)
    out.metrics.update(count_metrics(*totals.tolist()))
    return out


def count_metrics(extra: float, hard: float, scored: float) -> dict:
    return {"rollout/extra_samples": extra, "rollout/hard_prompts": hard, "rollout/scored_prompts": scored,
            "rollout/hard_prompt_frac": hard / max(scored, 1.0)}


def sum_round_metrics(rounds: list[dict]) -> dict:
    """The counts of several dynamic-sampling rounds' top-ups, summed (the fraction recomputed)."""
    keys = ("rollout/extra_samples", "rollout/hard_prompts", "rollout/scored_prompts")
    return count_metrics(*(sum(m.get(k, 0.0) for m in rounds) for k in keys))


def merge_groups(batch, extra, owner: torch.Tensor):
    """One batch: ``batch``'s groups, each followed by the rows of ``extra`` whose ``owner`` it is."""
    from anabranch.trainer.collect import concat_batches

    both = concat_batches([batch, extra])
    both.rollout.group_index = torch.cat([batch.rollout.group_index, owner])
    both.rollout.prompts = list(batch.rollout.prompts)
    # Stable sort by group: a group's first-stage rows, then its extra rows, in sampling order.
    out = both.take(torch.sort(both.rollout.group_index, stable=True).indices.tolist())  # PRM step rewards too
    out.rollout.metrics = {**batch.rollout.metrics, **_summed(batch.rollout.metrics, extra.rollout.metrics)}
    out.metrics = {**batch.metrics, **_summed(batch.metrics, extra.metrics)}
    out.t_generate = batch.t_generate + extra.t_generate
    return out


def _summed(first: dict, second: dict) -> dict:
    """Per-call counts (reward failures, tool calls) of both calls added; other keys keep the first's."""
    return {k: first[k] + v for k, v in second.items()
            if k in first and isinstance(v, (int, float)) and ("failures" in k or k.endswith("_count"))}


def check_config(cfg) -> None:
    """Combinations refused before any work (config_checks, when DARS is on)."""
    from anabranch.config import ConfigError

    if cfg.task.pairing:
        raise ConfigError("config key 'rollout.extra_rollouts' cannot be dars with task.pairing=true: prompt pairing "
                          "trains fixed (q+, q−) groups whose roles and weights assume the rollout.n samples of each; "
                          "set one of them off")
    from anabranch.rewards.registry import REWARDS

    for fn in cfg.reward.functions:
        name = getattr(fn, "name", fn)
        if name in REWARDS and "group_index" in REWARDS.meta(name).get("needs_fields", ()):
            raise ConfigError(f"config key 'rollout.extra_rollouts' cannot be dars with the group-level reward "
                              f"{name!r} in reward.functions: extra samples are scored apart from their group's first "
                              "samples, so a reward that compares a prompt's samples (majority vote, label refinement, "
                              "LASER-D's difficulty levels) would see split groups; set rollout.extra_rollouts=none")
