"""ARRoL's probe (``rollout.arrol.head_probe``): an unbiased training set for the quality head.

Without it the head learns BCE on the survivors' outcomes only, and the survivors are chosen by the head itself
(the top and the bottom of its ranking): it never sees how the middle of its own ranking ends, so its training
set is a selection-dependent, biased sample of the n' prefixes it scores. With ``head_probe`` = f > 0, on every
pruning round each group's m = n' − n pruned prefixes lose k_p = ⌊f·m + ½⌋ of their number, drawn uniformly
without replacement (seeded), which finish anyway (``continue_ids``, the same budget as the survivors) for the
head only. With inclusion probabilities π = 1 for a survivor and k_p/m for a pruned prefix, the head's loss

    L(φ) = Σ_{i ∈ survivors ∪ probe} w_i·BCE(p_i, c_i) / Σ_i w_i,    w_i = 1/π_i   (1, or m/k_p)

is the Horvitz–Thompson estimate of the mean BCE over all n' prefixes (Σ_i w_i = n' per group exactly, so the
self-normalised and the plain estimator coincide): unbiased whatever the head's own ranking. The probed rows are
never in the policy's batch, never rewarded, never in the batch's reward/accuracy metrics (only the correctness
reward scores them, here, for their 0/1 flags) and never seen by the stateful rewards.

The probe's continuation and its draw use their own seed, derived from (``trainer.seed``, the head's update count,
the rank) (rewards/random_reward.derived_seed: nothing to checkpoint, a resumed run draws what the uninterrupted
one would), and run after the survivors' continuation inside forked generators (rollout/base.seeded_torch): the
policy's batch is the same token for token with the probe on or off, and so is the process's RNG afterwards.
Generation cost: ``arrol/probe_tokens`` (the probed rows' continuation tokens), at most G·k_p·(L − L_p) a round.

Not from the paper: ARRoL's method text was not readable here and the authors' code was not released (their
repository held a README only), so this is this library's remedy for the selection bias, **assumed**, not the
paper's. The paper's own training set for the head is not known (the survivors' outcomes are what the pruned
rollout offers for free). Under DDP each rank probes its own groups; the weighted loss and Σ w are summed over
ranks before the head's step (trainer/aux_head.all_reduce_grads), as the plain loss and the row count are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from anabranch.algorithms.arrol import probe_columns
from anabranch.rollout.base import Rollout


@dataclass
class Probe:
    """The probed pruned prefixes of one round, finished: the rows, their prefix states and predictions, each
    row's importance weight m/k_p, and the continuation tokens they cost."""

    rollout: Rollout
    states: torch.Tensor      # [K, H] the prefix states the head read
    predicted: torch.Tensor   # [K] the head's p at pruning time
    weight: float             # m / k_p (every probed row of a round has the same)
    tokens: float             # phase-2 tokens generated for them


def probe_seed(seed: int, updates: int, rank: int) -> int:
    """The probe's seed for the head's update ``updates`` on rank ``rank`` (its draw and its continuation)."""
    from anabranch.rewards.random_reward import derived_seed

    return derived_seed("anabranch.arrol_probe", seed, updates, rank)


def draw_probe(state, backend, tokenizer, first: Rollout, h: torch.Tensor, p: torch.Tensor, keep: torch.Tensor,
               n_prime: int, budget: int) -> Probe | None:
    """The round's probe: each group's k_p pruned columns (uniform, seeded) finished from their prefixes
    (``continue_survivors``, forked generators); None when k_p = 0. ``first``: phase 1's n' rows per group; ``h``,
    ``p``: their prefix states and predictions; ``keep`` [G, n]: the survivors' columns; ``state``: the ARRoL."""
    from anabranch.trainer.arrol_rollouts import continue_survivors

    rank = int(getattr(state.dist, "rank", 0) or 0) if state.dist is not None else 0
    seed = probe_seed(state.cfg.trainer.seed, state.updates, rank)
    cols, weight = probe_columns(keep, n_prime, state.a.head_probe, torch.Generator().manual_seed(seed))
    if cols.numel() == 0:
        return None
    rows = (cols + torch.arange(keep.shape[0])[:, None] * n_prime).flatten().tolist()
    out = continue_survivors(backend, first, rows, budget, tokenizer.pad_token_id, tokenizer, seed=seed)
    tokens = float(out.response_mask.sum()) - float(first.response_mask[rows].sum())
    return Probe(out, h[rows], p[rows], weight, tokens)


def probe_correct(c, probe: Probe, batch) -> list[float]:
    """The probed rows' 0/1 flags: full credit on the correctness reward alone (config load requires one), each
    row scored against its prompt's dataset row (that of the round's survivors of the same group)."""
    from anabranch.eval.accuracy import correct_flags, correctness_source
    from anabranch.trainer.collect import score_rollout

    src = correctness_source(c.rewards)
    row_of = dict(zip(batch.rollout.group_index.tolist(), batch.rows))
    rows = [row_of[g] for g in probe.rollout.group_index.tolist()]
    scored = score_rollout(c, probe.rollout, rows, c.arrol.cfg, sources=[src])
    return correct_flags(scored.per_source[src.name])


def with_probe(h: torch.Tensor, y: torch.Tensor, p: torch.Tensor, probe: Probe,
               probe_y: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """The head's training set with the probe: (states, flags, predictions, weights) of survivors ⊕ probed rows
    (weights 1 and m/k_p), and the probe's metrics: ``arrol/probe_rows``, ``arrol/probe_acc`` (the head's accuracy
    on the probed rows: the middle of its ranking) and ``arrol/head_acc_all`` (its importance-weighted accuracy: an
    unbiased estimate over all n' prefixes)."""
    py = torch.tensor(probe_y, dtype=torch.float32)
    if py.numel() != probe.states.shape[0]:
        raise RuntimeError(f"rollout.arrol.head_probe: {py.numel()} flags for {probe.states.shape[0]} probed prefixes")
    w = torch.cat([torch.ones(y.numel()), torch.full((py.numel(),), float(probe.weight))])
    hh, yy, pp = torch.cat([h, probe.states.to(h.dtype)]), torch.cat([y, py]), torch.cat([p, probe.predicted])
    hit = ((pp >= 0.5).float() == yy).float()
    metrics = {"arrol/probe_rows": float(py.numel()),
               "arrol/probe_acc": float(hit[y.numel():].mean()) if py.numel() else 0.0,
               "arrol/head_acc_all": float((hit * w).sum() / w.sum()) if w.numel() else 0.0}
    return hh, yy, pp, w, metrics


def check_probe(cfg) -> str | None:
    """``head_probe``'s refusals (the caller prefixes the key): a fraction in [0, 1] that probes at least one pruned
    prefix per group, and a correctness reward to judge the probed rows with."""
    a = cfg.rollout.arrol
    if a.head_probe == 0:
        return None
    if not 0.0 < a.head_probe <= 1.0:
        return f"head_probe must be in [0, 1] (the fraction of each group's pruned prefixes finished for the " \
               f"head; 0: off), got {a.head_probe}"
    from anabranch.algorithms.arrol import probe_count
    from anabranch.trainer.arrol_rollouts import oversampled

    m = oversampled(cfg) - cfg.rollout.n
    if probe_count(m, a.head_probe) < 1:
        return f"head_probe={a.head_probe} probes ⌊{a.head_probe}·{m} + ½⌋ = 0 of each group's {m} pruned " \
               f"prefixes: raise it to at least {0.5 / m:.3g}, or set 0 (off)"
    from anabranch.rewards.configured import has_correctness_reward

    if not has_correctness_reward(cfg.reward.functions):
        return "head_probe judges the probed rows with the correctness reward alone (they must not reach the " \
               "other, possibly stateful, rewards), and reward.functions has none; add one (e.g. math_verify) " \
               "or set rollout.arrol.head_probe=0"
    return None
