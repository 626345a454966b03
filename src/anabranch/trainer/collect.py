"""One step's scored batch: generate, score, DAPO's overlong shaping and dynamic sampling.

Dynamic sampling (Yu et al. 2025, "DAPO"): groups whose samples are all right or all wrong carry
no accuracy signal, so they are dropped and more prompts are sampled, round after round,
until ``rollout.prompts_per_step`` groups are kept or ``algorithm.max_sample_batches`` rounds were
generated; then the batch is cut to ``prompts_per_step`` groups (or keeps what it has, and if no
group survived, the last round as is, so the step still runs and logs). What "all equal" is judged
on follows ``algorithm.dynamic_sampling_metric``: the reward that says right/wrong (``accuracy``,
the paper's 0 < #correct < n, so that a shaping term such as the overlong punishment cannot keep an
all-correct group whose normalized advantages would then be ±1.5 for a length difference), or the
total reward (``reward``). With ``algorithm.dynamic_sampling_filter=std`` the groups kept are those
whose reward std reaches RLPR's adaptive threshold instead (``trainer/std_filter.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from anabranch.algorithms.overlong import overlong_penalty
from anabranch.eval.accuracy import correct_flags, correctness_source
from anabranch.rewards import score_detailed
from anabranch.rewards.compose import commit_reward_states
from anabranch.rewards.rlpr import rlpr_fields
from anabranch.rewards.token_stats import trainer_fields
from anabranch.rollout.arpo_branching import concat_branch_segments
from anabranch.rollout.base import Rollout
from anabranch.rollout.environments import concat_env_turns
from anabranch.rollout.mcts_search import concat_values
from anabranch.rollout.semantic_tree import concat_trees
from anabranch.trainer.round_builders import build_round
from anabranch.trainer.std_filter import StdFilter


@dataclass
class ScoredBatch:
    rollout: Rollout
    rows: list            # [B] dataset row of each sequence
    total: list           # [B] total reward
    per_source: dict      # reward source -> [B]
    t_generate: float = 0.0
    metrics: dict = field(default_factory=dict)

    @property
    def rewards(self) -> torch.Tensor:
        return torch.tensor(self.total, dtype=torch.float32)

    def take(self, rows) -> "ScoredBatch":
        """The sequences ``rows`` (indices, in that order, repeats allowed), as :meth:`Rollout.take` gives them:
        the rollout's per-row fields, the dataset rows, totals and every reward source's scores; ``t_generate``
        and ``metrics`` (a copy) are the batch's. Group numbers and prompts are unchanged: callers that
        renumber groups set ``rollout.group_index`` and ``rollout.prompts`` after (:func:`select_groups`)."""
        keep = [int(i) for i in rows]
        return ScoredBatch(self.rollout.take(keep), [self.rows[i] for i in keep], [self.total[i] for i in keep],
                           {k: [v[i] for i in keep] for k, v in self.per_source.items()}, self.t_generate,
                           dict(self.metrics))


def generate_scored(c, idx: list[int], cfg, step: int | None = None, round_: int = 1,
                    n: int | None = None, sources: list | None = None) -> ScoredBatch:
    """The rollouts of prompts ``idx``, scored by :func:`score_rollout`.

    ``step``/``round_``: the training step and dynamic-sampling round, passed to reward functions
    as the ``train_step``/``sample_round`` fields (the random reward keys its draws on them).
    ``n``: samples per prompt (default ``rollout.n``; DARS's extra samples use 1 per repeated prompt).
    ``sources``: score with these reward sources only (default all of ``c.rewards``)."""
    t0 = time.perf_counter()
    # INSPO: each prompt rebuilt with an instruction drawn from its population (the training round's own prompts only:
    # a method's HintedPrompts has inspo=None, its prompts generated as built)
    inspo = getattr(c, "inspo", None)
    prompts = [c.train_prompts[i] for i in idx] if inspo is None else inspo.prompts([c.train_rows[i] for i in idx])
    # A round's own samples may come from a round builder (CURE, ARRoL, ROSE's tree, ARPO, DeepSearch, REFUEL:
    # trainer/round_builders.py; None: plain sampling); an explicit n (a side round's, DARS's) is always plain.
    rollout = None if n is not None else build_round(c, prompts, cfg, step, idx)
    if rollout is None:
        rollout = c.backend.generate(prompts, cfg.rollout.n if n is None else n)
    t_gen = time.perf_counter() - t0
    rows = [c.train_rows[idx[g]] for g in rollout.group_index.tolist()]
    batch = score_rollout(c, rollout, rows, cfg, step, round_, sources=sources)
    if inspo is not None:  # every round's rewards credit the instructions drawn (also groups dropped later)
        inspo.observe(batch)
    batch.t_generate = t_gen
    return batch


def score_rollout(c, rollout: Rollout, rows: list, cfg, step: int | None = None, round_: int = 1,
                  sources: list | None = None, reward_groups: list[int] | None = None) -> ScoredBatch:
    """``rollout`` scored as a training sample is: the trainer's reward fields (token counts and statistics,
    RLPR's policy forward, a PRM's step scores: each only when a source asks for it), the rewards, PRM
    step rewards put on the rollout (``reward.prm_shaping``), then DAPO's overlong penalty. Every caller that
    scores responses the policy trains on (training rounds, AMPO's teacher rows, the greedy filter) comes
    here, so a field added for a reward reaches all of them.

    ``rows``: [B] each sequence's dataset row; ``step``/``round_``: as :func:`generate_scored`'s.
    ``sources``: a subset of ``c.rewards`` to score with (the greedy filter's correctness reward alone), so
    that the other sources' fields (a PRM or policy forward) are not computed either; default all.
    ``reward_groups``: the ``group_index`` field the rewards see (default the rollout's)."""
    sources = c.rewards if sources is None else sources
    groups = rollout.group_index.tolist()
    extra = trainer_fields(sources, c.model, rollout, cfg.trainer.micro_batch_size)
    if step is not None:
        extra.update(train_step=[step] * len(groups), sample_round=[round_] * len(groups))
    # RLPR: the policy's probability of each row's reference answer (one no-grad forward, only when configured)
    if any(s.meta.get("needs_policy_forward") for s in sources):
        extra.update(rlpr_fields(sources, c.model, c.tokenizer, rollout, rows, cfg.trainer.micro_batch_size))
    if any(s.meta.get("process_reward") for s in sources):  # a PRM's step scores (only when configured)
        from anabranch.rewards.prm import prm_fields

        extra.update(prm_fields(sources, c.tokenizer, rollout, rows))
    if any(s.meta.get("gen_process_reward") for s in sources):  # CAPO: a critic's wrong steps -> token penalties
        from anabranch.algorithms.capo import attach as capo_attach

        extra.update(capo_attach(sources, c.tokenizer, rollout, rows))
    scored = score_detailed(sources, [rollout.prompts[g] for g in groups], rollout.completions, rows,
                            group_index=groups if reward_groups is None else reward_groups, extra_fields=extra)
    total, per_source = scored.total, scored.per_source
    if "prm_step_scores" in extra:  # PRM-Clip/Delta: step rewards on the step-end tokens (algorithms/prm_shaping.py)
        from anabranch.algorithms.prm_shaping import attach

        scored.metrics.update(attach(sources, cfg.reward, rollout, extra))
        if cfg.algorithm.prof_keep:  # PROF ranks rows by their mean step score (algorithms/prof.py; no reward)
            from anabranch.algorithms.prof import KEY, process_means

            per_source = {**per_source, KEY: process_means(extra["prm_step_scores"])}
    a = cfg.algorithm
    if a.overlong_buffer > 0:
        pen = overlong_penalty(rollout.response_lengths, cfg.rollout.max_new_tokens, a.overlong_buffer,
                               a.overlong_penalty)
        total = [t + p for t, p in zip(total, pen.tolist())]
        per_source = {**per_source, "overlong": pen.tolist()}
    # scored.metrics: reward/<name>/failures and each source's own metrics; the rollout's: tool use
    return ScoredBatch(rollout, rows, list(total), dict(per_source),
                       metrics={**rollout.metrics, **scored.metrics})


def generate_round(c, idx: list[int], cfg, step: int | None = None, round_: int = 1, dist=None,
                   commit: bool = True) -> ScoredBatch:
    """:func:`generate_scored`, then with ``rollout.extra_rollouts=dars`` the hard prompts' extra
    samples appended to their groups (trainer/extra_rollouts.py), before any dynamic-sampling filter
    (the DARS authors' code judges the enlarged groups). Then the stateful rewards' observations of the
    round are committed (gathered from every rank under ``dist``): every rank runs the same rounds.
    ``commit=False`` leaves them pending: async rollouts (trainer/async_rollouts.py) score in a background thread
    and commit them later, in the main thread, when the batch is taken (``AsyncRollouts.next_batch``)."""
    batch = generate_scored(c, idx, cfg, step, round_)
    if step is not None and cfg.rollout.arrol.enabled:  # ARRoL's head learns from the round's survivors
        from anabranch.trainer.arrol_rollouts import arrol_observe

        arrol_observe(c, batch)
    if cfg.rollout.extra_rollouts == "dars":
        from anabranch.trainer.extra_rollouts import top_up  # lazy: that module builds on this one

        batch = top_up(c, batch, idx, cfg, step, round_, dist)
    if cfg.algorithm.prof_keep:  # PROF (algorithms/prof.py): m of each prompt's n samples, before any group filter
        from anabranch.algorithms.prof import prof_filter

        batch = prof_filter(batch, c.rewards, cfg.algorithm.prof_keep)
    if commit:  # async rollouts (trainer/async_rollouts.py) commit in the main thread when the batch is taken
        commit_reward_states(c.rewards, dist)  # OLR's visits, LASER-D's window: training rollouts only
    return batch


def filter_signal(batch: ScoredBatch, sources, metric: str) -> torch.Tensor:
    """[B] what dynamic sampling compares within a group: the correctness reward's scores for
    ``metric="accuracy"`` as right (full credit) or wrong, DAPO's "0 < #correct < G" (the total
    reward where no source says right/wrong), else the total reward."""
    src = correctness_source(sources) if metric == "accuracy" else None
    if src is None or src.name not in batch.per_source:
        return batch.rewards
    return torch.tensor(correct_flags(batch.per_source[src.name]), dtype=torch.float32)


def informative_groups(rewards: torch.Tensor, group_index: torch.Tensor) -> list[int]:
    """Groups (in order) whose rewards are not all equal."""
    return [int(g) for g in group_index.unique()
            if not bool((rewards[group_index == g] == rewards[group_index == g][0]).all())]


def kept_groups(batch: ScoredBatch, c, cfg, group_filter: StdFilter | None) -> tuple[list[int], float, int]:
    """(groups one round keeps, sum of the finite reward stds of all its groups, how many): DAPO's all-equal test, or
    RLPR's std threshold when ``group_filter`` is given (the std sums then feed its moving average)."""
    signal = filter_signal(batch, c.rewards, cfg.algorithm.dynamic_sampling_metric)
    if group_filter is None:
        return informative_groups(signal, batch.rollout.group_index), 0.0, 0
    return group_filter.keep(signal, batch.rollout.group_index)


def collect_batch(c, sampler, cfg, dist=None, group_filter: StdFilter | None = None,
                  step: int | None = None) -> ScoredBatch:
    """``sampler.next(k)`` gives this rank's share of k prompts; ``dist``: a data-parallel run
    (:class:`~anabranch.trainer.distributed.Distributed` with several processes); ``group_filter``:
    RLPR's std filter (``algorithm.dynamic_sampling_filter=std``), whose state this step updates."""
    if cfg.task.curation == "greedy_wrong" and not getattr(sampler, "greedy_filtered", False):
        from anabranch.trainer.greedy_filter import collect_filtered  # SELF's online filter: wrong-greedy prompts only

        return collect_filtered(c, sampler, cfg, dist, group_filter, step)
    want = cfg.rollout.prompts_per_step
    if not cfg.algorithm.dynamic_sampling:
        return generate_round(c, sampler.next(want), cfg, step, dist=dist)
    if dist is not None and dist.world_size > 1:
        return collect_dynamic_distributed(c, sampler, cfg, dist, group_filter, step)
    kept, t_gen, seen, last, round_metrics = [], 0.0, 0, None, []
    std_sum, std_count = 0.0, 0
    for rounds in range(1, cfg.algorithm.max_sample_batches + 1):
        last = generate_round(c, sampler.next(want), cfg, step, rounds, dist)
        t_gen += last.t_generate
        round_metrics.append(last.metrics)
        groups, s, k = kept_groups(last, c, cfg, group_filter)
        std_sum, std_count = std_sum + s, std_count + k
        seen += int(last.rollout.group_index.unique().numel())
        kept.append(select_groups(last, groups))
        if sum(len(b.rollout.prompts) for b in kept) >= want:
            break
    n_kept = sum(len(b.rollout.prompts) for b in kept)
    batch = concat_batches([b for b in kept if b.rollout.prompts]) if n_kept else last
    if n_kept > want:
        batch = select_groups(batch, list(range(want)))
    batch.t_generate = t_gen
    # Reward-source metrics of the last round generated (failure counts are per call).
    batch.metrics = {**last.metrics, "dynamic_sampling/rounds": float(rounds), "dynamic_sampling/kept_groups": float(min(n_kept, want)),
                     "dynamic_sampling/kept_frac_of_generated": n_kept / max(seen, 1)}
    if group_filter is not None:  # the threshold moves for the next step; the metrics hold this one's
        batch.metrics.update(group_filter.end_step(std_sum, std_count))
    if cfg.rollout.extra_rollouts == "dars":  # DARS's counts over all rounds, not the last one's
        from anabranch.trainer.extra_rollouts import sum_round_metrics

        batch.metrics.update(sum_round_metrics(round_metrics))
    return batch


def collect_dynamic_distributed(c, sampler, cfg, dist, group_filter: StdFilter | None = None,
                                step: int | None = None) -> ScoredBatch:
    """Dynamic sampling over W processes, giving the batch one process would keep.

    Every round, all ranks generate their share of the same ``prompts_per_step`` prompts and count
    the groups they keep; the *global* count decides whether another round is drawn, so all ranks
    run the same rounds (generation stays in lockstep, which sharded engines need, and the prompt
    samplers stay identical). The kept groups are then ordered as one process would have them
    (round by round, rank by rank: the prompt order) and dealt out again in contiguous equal shares,
    so every rank trains on the same number of whole groups. If fewer than ``prompts_per_step``
    groups were kept after ``max_sample_batches`` rounds, the largest multiple of W is used; with
    fewer than W, each rank keeps its share of the last round as is (the step still runs and logs).
    RLPR's std filter: its statistic (sum and count of the group stds) is summed over ranks in the
    same reduction, so every rank's moving average, hence its threshold, stays the same.
    """
    want, world = cfg.rollout.prompts_per_step, dist.world_size
    kept, t_gen, n_global, seen, last, round_metrics = [], 0.0, 0, 0, None, []
    std_sum, std_count = 0.0, 0
    for rounds in range(1, cfg.algorithm.max_sample_batches + 1):
        last = generate_round(c, sampler.next(want), cfg, step, rounds, dist)
        t_gen += last.t_generate
        round_metrics.append(last.metrics)
        groups, s, k = kept_groups(last, c, cfg, group_filter)
        kept.append(select_groups(last, groups))
        counts = dist.all_reduce_sum(torch.tensor([len(groups), len(last.rollout.prompts), s, k], dtype=torch.float64))
        n_global, seen = n_global + int(counts[0].item()), seen + int(counts[1].item())
        std_sum, std_count = std_sum + float(counts[2].item()), std_count + int(counts[3].item())
        if n_global >= want:
            break
    take = want if n_global >= want else (n_global // world) * world
    if take == 0:
        batch = last
    else:
        everyone = dist.gather_objects(kept)  # [rank][round] -> ScoredBatch
        ordered = [everyone[r][k] for k in range(rounds) for r in range(world) if everyone[r][k].rollout.prompts]
        share = take // world
        batch = select_groups(concat_batches(ordered), list(range(dist.rank * share, (dist.rank + 1) * share)))
    batch.t_generate = t_gen
    batch.metrics = {**last.metrics, "dynamic_sampling/rounds": float(rounds),
                     "dynamic_sampling/kept_groups": float(take),
                     "dynamic_sampling/kept_frac_of_generated": n_global / max(seen, 1)}
    if group_filter is not None:  # the threshold moves for the next step; the metrics hold this one's
        batch.metrics.update(group_filter.end_step(std_sum, std_count))
    if cfg.rollout.extra_rollouts == "dars":  # DARS's counts over all rounds, not the last one's
        from anabranch.trainer.extra_rollouts import sum_round_metrics

        batch.metrics.update(sum_round_metrics(round_metrics))
    return batch


def select_groups(batch: ScoredBatch, groups: list[int]) -> ScoredBatch:
    """The sequences of ``groups`` (renumbered 0..len-1 in that order)."""
    r = batch.rollout
    new_id = {g: i for i, g in enumerate(groups)}
    out = batch.take([i for i, g in enumerate(r.group_index.tolist()) if g in new_id])
    out.rollout.group_index = torch.tensor([new_id[int(g)] for g in out.rollout.group_index], dtype=r.group_index.dtype)
    out.rollout.prompts = [r.prompts[g] for g in groups]
    return out


def pad_concat(tensors: list[torch.Tensor], left: bool) -> torch.Tensor:
    """[B_i, R_i, ...] tensors concatenated on dim 0, dim 1 zero-padded to the widest (on the left for prompts,
    on the right for responses); 1-D [B_i] ones (a value per row) are concatenated as they are."""
    if tensors[0].dim() == 1:
        return torch.cat(tensors)
    width = max(t.shape[1] for t in tensors)
    out = []
    for t in tensors:
        pad = torch.zeros(t.shape[0], width - t.shape[1], *t.shape[2:], dtype=t.dtype, device=t.device)
        out.append(torch.cat([pad, t] if left else [t, pad], dim=1))
    return torch.cat(out)


def _attempts(parts: list) -> torch.Tensor | None:
    """The rounds' per-attempt outcomes (``Rollout.attempt_correct``) stacked, padded with -1 (no attempt);
    None when no round has them. A mix is an error (as :func:`_process_rewards`): the rows without them would
    lose the outcomes that retry-turn rewards and metrics read, silently, for the whole batch."""
    have = [p is not None for p in parts]
    if not any(have):
        return None
    if not all(have):
        raise ValueError("concat_batches: some rounds carry per-attempt outcomes (Rollout.attempt_correct) and "
                         "others not; rows added to a batch under rollout.retry_turns must come from its backend too")
    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.cat([p, torch.full((p.shape[0], width - p.shape[1]), -1, dtype=p.dtype)], dim=1)
                      for p in parts])


def _process_rewards(rs: list[Rollout]) -> torch.Tensor | None:
    """The rounds' PRM step rewards ``Rollout.process_rewards`` re-right-padded as the responses (with 0: no
    step ends there); None when no round has them. Rows without them beside rows with them would train on
    the outcome alone while their neighbours get step rewards, so that mix is an error, not a silent zero."""
    have = [r.process_rewards is not None for r in rs]
    if not any(have):
        return None
    if not all(have):
        raise ValueError("concat_batches: some rounds carry PRM step rewards (Rollout.process_rewards) and others "
                         "not; rows added to a batch under reward.prm_shaping must be scored by rewards/prm.py too")
    return pad_concat([r.process_rewards for r in rs], left=False)


def concat_batches(batches: list[ScoredBatch]) -> ScoredBatch:
    """One batch of several rounds: prompts re-left-padded, responses re-right-padded."""
    rs = [b.rollout for b in batches]
    offsets, n = [], 0
    for r in rs:
        offsets.append(n)
        n += len(r.prompts)
    slp = loss_mask = None
    if all(r.sample_log_probs is not None for r in rs):
        slp = pad_concat([r.sample_log_probs for r in rs], left=False)
    if any(r.loss_mask is not None for r in rs):  # a round without tool outputs: every token sampled
        loss_mask = pad_concat([torch.ones_like(r.response_mask) if r.loss_mask is None else r.loss_mask
                                for r in rs], left=False)
    rollout = Rollout(
        prompt_ids=pad_concat([r.prompt_ids for r in rs], True),
        prompt_mask=pad_concat([r.prompt_mask for r in rs], True),
        response_ids=pad_concat([r.response_ids for r in rs], False),
        response_mask=pad_concat([r.response_mask for r in rs], False),
        group_index=torch.cat([r.group_index + o for r, o in zip(rs, offsets)]),
        prompts=[p for r in rs for p in r.prompts], completions=[c for r in rs for c in r.completions],
        truncated=torch.cat([r.truncated for r in rs]), sample_log_probs=slp, loss_mask=loss_mask,
        attempt_correct=_attempts([r.attempt_correct for r in rs]), process_rewards=_process_rewards(rs),
        env_turns=concat_env_turns([r.env_turns for r in rs]),  # rollout.environment's turns (GiGPO)
        env_actions=concat_env_turns([r.env_actions for r in rs], "action texts (Rollout.env_actions)"),  # HiPER
        # WebAgent-R1's per-turn sampling contexts (rollout/context_compression.py)
        turn_contexts=concat_env_turns([r.turn_contexts for r in rs], "turn contexts (Rollout.turn_contexts)"),
        semantic_tree=concat_trees(rs),  # ROSE's tree rows (rollout/semantic_tree.py)
        mcts_values=concat_values(rs),  # DeepSearch's node values (rollout/mcts_search.py)
        branch_segments=concat_branch_segments(rs),  # rollout.arpo's shared spans (hard attribution)
        metrics=dict(rs[-1].metrics))
    keys = batches[0].per_source.keys()
    return ScoredBatch(rollout, [x for b in batches for x in b.rows], [x for b in batches for x in b.total],
                       {k: [x for b in batches for x in b.per_source[k]] for k in keys})
