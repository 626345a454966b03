"""DPH-RL's rehearsal buffer: the initial policy's samples on the prompts it already solves.

Pre-sampling (Li et al. 2025, "The Choice of Divergence ...", arXiv 2509.07430): at the start of the
run, before any update, ``algorithm.dph.buffer_prompts`` training prompts (a seeded choice; 0: all)
are sampled ``buffer_n`` times each with the run's rollout backend and scored with the run's rewards.
A prompt whose samples are *all* correct is "perfect" (the paper's D_pef): its first
``keep_per_prompt`` samples enter the buffer with their token ids and their per-token log π_0,
computed by the trainer's own forward (the same numerics as log π_θ later), so no reference model is
needed during training. The other prompts (D_exp) stay the RL prompts; with ``exclude_from_rl`` the
perfect ones are left out of RL, as in the paper (prompts not pre-sampled stay in RL).

Correct means full credit (>= 1) on the reward that says right/wrong (``correctness`` rewards such as
math_verify), or on the total reward when no reward does.

Every optimizer step (each PPO epoch) takes ``samples_per_step`` buffer sequences without
replacement, from a generator seeded by (trainer.seed, step, epoch), and adds
``coef · mean_t f(π_θ/π_0)`` (algorithms/dph.py) with its own forward and backward before the
gradient is clipped, so it shares the RL loss's optimizer step.

Resume: the buffer is saved in every checkpoint (``trainer_state.pt``, stateful ``dph_rehearsal``)
and restored from it, never rebuilt from the resumed weights; the mini-batch choice depends only on
the seed and the step, so a resumed run draws what the uninterrupted one would have.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from anabranch.algorithms.dph import rehearsal_loss
from anabranch.config import Config, ConfigError
from anabranch.eval.accuracy import batch_correct
from anabranch.models.logprobs import response_forward
from anabranch.rewards import score_detailed
from anabranch.rewards.token_stats import trainer_fields
from anabranch.trainer.collect import ScoredBatch, concat_batches, select_groups
from anabranch.trainer.distributed import require_plain_ddp

FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "loss_mask", "init_log_prob",
          "prompt_index")
BUILD_SEED_OFFSET = 7919  # the buffer's generation seed is trainer.seed + this (not the run's own stream)


@dataclasses.dataclass
class RehearsalBuffer:
    """Sequences of π_0 with their per-token log π_0; ``prompt_index`` is each one's training row."""

    prompt_ids: torch.Tensor | None = None      # [N, P] left-padded
    prompt_mask: torch.Tensor | None = None
    response_ids: torch.Tensor | None = None    # [N, R] right-padded
    response_mask: torch.Tensor | None = None   # attention over the response (tool outputs included)
    loss_mask: torch.Tensor | None = None       # the tokens π_0 sampled: where the divergence is taken
    init_log_prob: torch.Tensor | None = None   # [N, R] log π_0(y_t | x, y_<t)
    prompt_index: torch.Tensor | None = None    # [N]
    perfect_prompts: list = dataclasses.field(default_factory=list)  # every perfect row (buffer or not)
    stats: dict = dataclasses.field(default_factory=dict)
    built: bool = False

    def __len__(self) -> int:
        return 0 if self.response_ids is None else int(self.response_ids.shape[0])

    def state_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in FIELDS}, "perfect_prompts": list(self.perfect_prompts),
                "stats": dict(self.stats), "built": self.built}

    def load_state_dict(self, state: dict) -> None:
        for k in FIELDS:
            setattr(self, k, state[k])
        self.perfect_prompts, self.stats, self.built = list(state["perfect_prompts"]), dict(state["stats"]), state["built"]


def choose_prompts(n_rows: int, k: int, seed: int) -> list[int]:
    """``k`` training rows (all when k = 0 or k >= n_rows), a seeded choice kept in row order."""
    if k == 0 or k >= n_rows:
        return list(range(n_rows))
    g = torch.Generator().manual_seed(seed + BUILD_SEED_OFFSET)
    return sorted(torch.randperm(n_rows, generator=g)[:k].tolist())


def minibatch_indices(n: int, k: int, seed: int, step: int, epoch: int = 0) -> torch.Tensor:
    """``min(k, n)`` distinct buffer rows for optimizer step ``step`` (epoch ``epoch``): a function of
    (seed, step, epoch) only, so a resumed run draws the same rows as the uninterrupted one."""
    g = torch.Generator().manual_seed(((seed * 1_000_003 + step) * 101 + epoch) % (2**63 - 1))
    return torch.randperm(n, generator=g)[:min(k, n)].sort().values


def sample_correct(batch: ScoredBatch, sources) -> torch.Tensor:
    """[B] bool: full credit on the reward that says right/wrong (the total reward when none does)."""
    return torch.tensor(batch_correct(batch, sources), dtype=torch.bool)


def perfect_groups(batch: ScoredBatch, sources) -> list[int]:
    """The groups (prompts) of ``batch`` whose samples all got full credit."""
    ok = sample_correct(batch, sources)
    groups = batch.rollout.group_index
    return [int(g) for g in groups.unique() if bool(ok[groups == g].all())]


def sequence_log_probs(model, buf: RehearsalBuffer, rows: torch.Tensor, temperature: float,
                       grad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log π(response tokens) of buffer ``rows`` (trimmed to their longest prompt and response), with
    the matching log π_0 and loss mask."""
    device = next(model.parameters()).device
    pm, rm = buf.prompt_mask[rows], buf.response_mask[rows]
    p_len = max(int(pm.sum(-1).max()), 1)
    r_len = max(int(rm.sum(-1).max()), 1)
    ids = torch.cat([buf.prompt_ids[rows][:, -p_len:], buf.response_ids[rows][:, :r_len]], 1).to(device)
    mask = torch.cat([pm[:, -p_len:], rm[:, :r_len].to(pm.dtype)], 1).to(device)
    with torch.set_grad_enabled(grad):
        lp = response_forward(model, ids, mask, r_len, temperature).log_probs
    return lp, buf.init_log_prob[rows][:, :r_len].to(device), buf.loss_mask[rows][:, :r_len].to(device)


def rank_slice(n: int, rank: int, world: int) -> tuple[int, int]:
    """[lo, hi): rank ``rank``'s contiguous share of ``n`` items, ceil(n / world) each (the last
    ranks' shares may be shorter or empty); one process: (0, n)."""
    size = -(-n // world)
    lo = min(rank * size, n)
    return lo, min(lo + size, n)


def gather_ranks(dist, obj) -> list:
    """Every rank's ``obj`` in rank order (``[obj]`` without data parallelism)."""
    return [obj] if dist is None or dist.world_size == 1 else dist.gather_objects(obj)


def presample(c, cfg: Config, idx: list[int], n: int, seed: int, dist=None):
    """Yield ``(rows, batch)`` for this rank's share of each chunk of ``rollout.prompts_per_step``
    training rows of ``idx``: ``n`` samples of each by the current policy, scored with the run's
    rewards. Shared by DPH-RL's buffer and prompt pairing's pre-pass (trainer/prompt_pairing.py);
    batch group g is training row ``rows[g]``.

    Data parallelism (``dist``, W ranks): every chunk is split into W contiguous shares
    (:func:`rank_slice`), so each rank samples ~1/W of the prompts, prompts_per_step / W per call as in
    training; concatenating the ranks' shares chunk by chunk, rank by rank, gives ``idx`` in order.
    Generation seed: ``seed`` + the position in ``idx`` of the call's first prompt: one process calls
    with seed + chunk offset (as before), rank r with seed + chunk offset + its share's offset, so a
    run is reproducible for a given W, but W ranks' samples are not those of one process (other
    batches, other seeds). Sharded training (FSDP / ZeRO-3): every forward is a collective, so every
    rank makes the same calls with the same number of prompts: a short or empty share is padded with
    the chunk's first prompt, sampled and scored like the others and then dropped."""
    chunk = max(cfg.rollout.prompts_per_step, 1)
    rank, world = (0, 1) if dist is None else (dist.rank, dist.world_size)
    pad = dist is not None and world > 1 and bool(getattr(dist, "sharded", False))
    for start in range(0, len(idx), chunk):
        part = idx[start:start + chunk]
        lo, hi = rank_slice(len(part), rank, world)
        mine = part[lo:hi]
        calls = mine + [part[0]] * (-(-len(part) // world) - len(mine)) if pad else mine
        if not calls:
            continue
        rollout = c.backend.generate([c.train_prompts[i] for i in calls], n, seed=seed + start + lo)
        groups = rollout.group_index.tolist()
        rows = [c.train_rows[calls[g]] for g in groups]
        extra = trainer_fields(c.rewards, c.model, rollout, cfg.trainer.micro_batch_size)
        scored = score_detailed(c.rewards, [rollout.prompts[g] for g in groups], rollout.completions, rows,
                                group_index=groups, extra_fields=extra)
        batch = ScoredBatch(rollout, rows, list(scored.total), dict(scored.per_source))
        if not mine:
            continue
        yield mine, batch if len(calls) == len(mine) else select_groups(batch, list(range(len(mine))))


def build_buffer(c, cfg: Config, dist=None) -> RehearsalBuffer:
    """Pre-sample with the current (initial) policy and keep the perfect prompts' samples.

    Data parallelism (``dist``): each rank samples and scores its share of the chosen prompts
    (:func:`presample`); the kept samples and perfect prompts are gathered and ordered by the
    prompts' order in the choice, then every rank computes log π_0 of its contiguous share of the
    buffer's rows and those are gathered too, so every rank ends with the same buffer."""
    d = cfg.algorithm.dph
    idx = choose_prompts(len(c.train_prompts), d.buffer_prompts, cfg.trainer.seed)
    pos = {row: k for k, row in enumerate(idx)}
    kept, perfect = [], []  # kept: (position in idx of the share's first prompt, its perfect prompts' samples)
    for part, batch in presample(c, cfg, idx, d.buffer_n, cfg.trainer.seed + BUILD_SEED_OFFSET, dist):
        good = perfect_groups(batch, c.rewards)
        perfect += [part[g] for g in good]
        if good:
            sel = select_groups(batch, good)
            # The first keep_per_prompt samples of each perfect prompt (rows are n adjacent per group).
            keep = [i for i, g in enumerate(sel.rollout.group_index.tolist())
                    if i - g * d.buffer_n < d.keep_per_prompt]
            sel = sel.take(keep)  # every per-row field (attempt_correct, process_rewards, ...)
            sel.rows = [part[good[g]] for g in sel.rollout.group_index.tolist()]  # training row of each
            kept.append((pos[part[0]], sel))
    # Every rank's results, in the choice's order (shares are contiguous): the state does not depend on W.
    everyone = gather_ranks(dist, (kept, perfect))
    kept = [sel for _, sel in sorted((x for k, _ in everyone for x in k), key=lambda x: x[0])]
    perfect = [row for _, p in everyone for row in p]
    buf = RehearsalBuffer(perfect_prompts=sorted(perfect), built=True,
                          stats={"dph/buffer_prompts_sampled": float(len(idx)),
                                 "dph/buffer_perfect_prompts": float(len(perfect))})
    if kept:
        b = concat_batches(kept) if len(kept) > 1 else kept[0]
        r = b.rollout
        buf.prompt_ids, buf.prompt_mask, buf.response_ids = r.prompt_ids, r.prompt_mask, r.response_ids
        buf.response_mask, buf.loss_mask = r.response_mask, r.trained_mask
        buf.prompt_index = torch.tensor([int(x) for x in b.rows], dtype=torch.long)
        buf.init_log_prob = torch.zeros(r.response_ids.shape, dtype=torch.float32)  # read (unused) below
        buf.init_log_prob = _initial_log_probs(c.model, buf, cfg, dist)
    buf.stats["dph/buffer_size"] = float(len(buf))
    return buf


def _initial_log_probs(model, buf: RehearsalBuffer, cfg: Config, dist=None) -> torch.Tensor:
    """[N, R] log π_0 of the buffer's tokens by the trainer's forward, before any update: each rank
    its contiguous share of rows (under sharded training padded to equal shares, so all ranks run the
    same forwards), gathered in rank order."""
    rank, world = (0, 1) if dist is None else (dist.rank, dist.world_size)
    lo, hi = rank_slice(len(buf), rank, world)
    mine = list(range(lo, hi))
    if world > 1 and bool(getattr(dist, "sharded", False)):
        mine += [0] * (-(-len(buf) // world) - len(mine))
    lp = torch.zeros((len(mine),) + tuple(buf.response_ids.shape[1:]), dtype=torch.float32)
    micro = max(cfg.trainer.micro_batch_size, 1)
    for start in range(0, len(mine), micro):
        rows = torch.tensor(mine[start:start + micro], dtype=torch.long)
        out, _, _ = sequence_log_probs(model, buf, rows, cfg.rollout.temperature)
        lp[start:start + len(rows), :out.shape[1]] = out.float().cpu()
    return torch.cat([part for part in gather_ranks(dist, lp[:hi - lo])])


class ExcludingSampler:
    """The run's prompt sampler without the perfect prompts (``dph.exclude_from_rl``): its draws with
    those rows dropped, topped up by further draws. Its state is the wrapped sampler's."""

    def __init__(self, inner, excluded: Callable[[], set]):
        self.inner, self.excluded = inner, excluded

    def next(self, k: int) -> list[int]:
        skip, out, drawn = self.excluded(), [], 0
        while len(out) < k:
            got = self.inner.next(k - len(out))
            drawn += len(got)
            out += [i for i in got if i not in skip]
            if drawn > 100 * k + 10_000:
                raise RuntimeError("DPH-RL: the prompt sampler gives only perfect prompts")
        return out

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def __getattr__(self, name):  # labels, curriculum state, ...: the wrapped sampler's
        return getattr(self.inner, name)


class Rehearsal:
    """What the training loop holds for DPH-RL: the buffer, its checkpoint entry and the update term."""

    def __init__(self, cfg: Config):
        self.cfg, self.d = cfg, cfg.algorithm.dph
        self.buffer = RehearsalBuffer()

    @classmethod
    def create(cls, cfg: Config, dist=None) -> "Rehearsal | None":
        """None when ``algorithm.dph.coef`` is 0; refuses sharded training (see ``extra_loss``)."""
        if cfg.algorithm.dph.coef == 0:
            return None
        require_plain_ddp(dist, f"algorithm.dph.coef={cfg.algorithm.dph.coef}", "DPH-RL's rehearsal term splits its "
                          "mini-batch over the ranks, so ranks may run different numbers of forward passes",
                          "algorithm.dph.coef=0")
        return cls(cfg)

    def wrap_sampler(self, sampler):
        if not self.d.exclude_from_rl:
            return sampler
        return ExcludingSampler(sampler, lambda: set(self.buffer.perfect_prompts))

    def prepare(self, c, start: int, dist=None) -> dict:
        """Build the buffer on a fresh run (the policy is still π_0); a resumed run restored it (on every
        rank, from the checkpoint rank 0 wrote). ``dist``: the pre-pass is split over the ranks."""
        if not self.buffer.built:
            if start > 0:
                raise ConfigError("algorithm.dph.coef > 0 but the checkpoint being resumed holds no DPH-RL "
                                  "buffer (it was written without DPH): π_0's samples cannot be drawn from "
                                  "resumed weights; resume with the checkpoint's own config or start afresh")
            # In place: the checkpointer holds this object (stateful "dph_rehearsal").
            self.buffer.load_state_dict(build_buffer(c, self.cfg, dist).state_dict())
        if self.d.exclude_from_rl and len(set(self.buffer.perfect_prompts)) >= len(c.train_rows):
            raise ConfigError("algorithm.dph.exclude_from_rl: every training prompt is perfect for the initial "
                              "policy, none is left for RL; set algorithm.dph.exclude_from_rl=false")
        return dict(self.buffer.stats)

    @staticmethod
    def describe(stats: dict) -> str:
        text = (f"DPH-RL buffer: {int(stats['dph/buffer_size'])} samples of {int(stats['dph/buffer_perfect_prompts'])} "
                f"perfect prompts (of {int(stats['dph/buffer_prompts_sampled'])} pre-sampled)")
        return text + ("; no perfect prompt: no rehearsal term, plain RL" if not stats["dph/buffer_size"] else "")

    def extra_loss(self, model, step: int, dist=None) -> Callable[[], dict] | None:
        """The ``policy_update(extra_loss=...)`` callable of optimizer step ``step``: one call per epoch,
        beside the RL micro-batches and before clipping; forward + backward of ``coef · D_f``.

        DDP (``dist`` with W ranks): the buffer and the drawn rows are the same on every rank (same
        seed), so rank r trains rows ``[r::W]`` and every rank knows the mini-batch's token count N
        without a collective; its loss and metrics are ``Σ_{rows of r} · W / N``, whose average over the
        ranks (DDP's gradient, ``Distributed.mean_metrics``) is the one-process value."""
        buf, d, cfg = self.buffer, self.d, self.cfg
        if len(buf) == 0:
            return None
        epoch = [0]
        backward = (lambda loss: loss.backward()) if dist is None else dist.backward
        world, rank = (1, 0) if dist is None else (dist.world_size, dist.rank)

        def run() -> dict:
            rows = minibatch_indices(len(buf), d.samples_per_step, cfg.trainer.seed, step, epoch[0])
            total = float(buf.loss_mask[rows].sum().clamp(min=1.0))  # the whole mini-batch's, on every rank
            mine = rows[rank::world]  # this rank's share of the drawn rows
            sums = {"dph/f_sum": 0.0, "dph/log_ratio_sum": 0.0}
            micro = max(cfg.trainer.micro_batch_size, 1)
            for i in range(0, len(mine), micro):
                lp, init, mask = sequence_log_probs(model, buf, mine[i:i + micro], cfg.rollout.temperature, grad=True)
                loss, m = rehearsal_loss(lp, init, mask, d.divergence, total_tokens=total)
                backward(d.coef * loss * world)  # × W: DDP averages the ranks' gradients
                for k in sums:
                    sums[k] += m[k] * world
            epoch[0] += 1  # only once the epoch's term is done: an epoch redone after an OOM draws the same rows
            return {"dph/loss": sums["dph/f_sum"] / total, "dph/log_ratio": sums["dph/log_ratio_sum"] / total,
                    "dph/samples": float(len(rows)), "dph/buffer_size": float(len(buf))}

        return run
