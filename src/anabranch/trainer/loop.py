"""The training loop: rollouts -> rewards -> advantages -> update, with logging and checkpoints."""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from anabranch.algorithms.kl_control import build_kl_controller
from anabranch.algorithms.dsdr import apply_dsdr, with_dsdr
from anabranch.algorithms.overlong import filter_overlong
from anabranch.config import Config
from anabranch.config_checks import check_whole_config
from anabranch.eval.accuracy import correct_flags, correctness_source, greedy_accuracy, greedy_skip_reason
from anabranch.eval.answers import extract_answer
from anabranch.eval.collapse import collapse_report
from anabranch.eval.diversity import group_distinct_answers
from anabranch.rollout.self_search import evaluation_backend  # SSRL's sim2real held-out eval
from anabranch.trainer.advantage_pass import compute_advantages
from anabranch.trainer.checkpoint import export_hf
from anabranch.trainer.sharded_state import full_model_state
from anabranch.trainer.collect import collect_batch
from anabranch.trainer.std_filter import build_std_filter
from anabranch.algorithms.mssr import attach_mssr
from anabranch.rewards.compose import reward_states
from anabranch.trainer.components import build, lr_lambda, quiet_libraries
from anabranch.trainer.distributed import Distributed, NullRunDir
from anabranch.trainer.gpu_budget import measured_budget
from anabranch.trainer.microbatch import resolve_micro_batch_tokens
from anabranch.trainer.progress import Progress
from anabranch.trainer.prompt_pairing import PromptPairing
from anabranch.trainer.curation import Curation
from anabranch.trainer.rehearsal import Rehearsal
from anabranch.trainer.hpt_step import HPT, combine_extra_losses
from anabranch.trainer.recap_step import Recap
from anabranch.trainer.guide_step import Guide
from anabranch.trainer.agent_rlvr_step import AgentRLVR
from anabranch.trainer.scaffold_step import Scaffold
from anabranch.trainer.svs_step import SvS
from anabranch.trainer.ssp_round import SSP
from anabranch.trainer.sws_synthesis import SwS
from anabranch.trainer.eva_evolve import Eva
from anabranch.trainer.ampo_step import AMPO
from anabranch.trainer.scope_rollouts import Scope
from anabranch.trainer.rl_plus_step import RLPlus
from anabranch.trainer.calibrl_step import CalibRL
from anabranch.trainer.rltf_sd_step import RLTFSD
from anabranch.trainer.kdrl_step import KDRL
from anabranch.trainer.srpo_step import SRPO
from anabranch.trainer.spae_step import SPAE
from anabranch.trainer.spa_step import SPAProgress
from anabranch.trainer.archer_critic import ArcherCritic
from anabranch.trainer.arrol_rollouts import ARRoL
from anabranch.algorithms.deepsearch import DeepSearch
from anabranch.trainer.instruction_population import InstructionPopulation
from anabranch.trainer.latent_flow_step import LatentFlow
from anabranch.trainer.ref_reset import RefReset
from anabranch.trainer.resume import Checkpointer
from anabranch.trainer.rorecomp import RoRecomp
from anabranch.trainer.spear_replay import Spear
from anabranch.trainer.turn_rows import TurnRows
from anabranch.trainer.async_rollouts import AsyncRollouts
from anabranch.trainer.run_dir import RunDir
from anabranch.trainer.curriculum import build_sampler
from anabranch.trainer.mixture_step import mixture_step
from anabranch.trainer.signals import GracefulStop
from anabranch.trainer.step import policy_update


@dataclass
class TrainResult:
    run_dir: Path
    final_model_dir: Path | None
    accuracy_before: float | None
    accuracy_after: float | None
    history: list[dict] = field(default_factory=list)


def train(cfg: Config) -> TrainResult:
    """Run the whole job described by ``cfg`` and return where it wrote its outputs.

    SIGINT/SIGTERM stop it after the current step with a checkpoint, and too many non-finite
    steps in a row stop it too: both raise :class:`~anabranch.trainer.signals.RunStopped`."""
    with GracefulStop() as stop, contextlib.ExitStack() as on_exit:  # on_exit: background threads joined
        return _train(cfg, stop, on_exit)


def _train(cfg: Config, stop: GracefulStop, on_exit: contextlib.ExitStack | None = None) -> TrainResult:
    # Every check load_config runs, again for a Config built in code: refused before any model loads.
    check_whole_config(cfg)
    quiet_libraries()
    dist = Distributed.start(cfg)  # one process: a no-op; under accelerate launch: this rank
    c = build(cfg, mixed_precision=dist.mixed_precision)
    dist.prepare(c)
    run = RunDir(cfg) if dist.is_main else NullRunDir(cfg)
    # PromptSampler as before for one task; a task mixture's sampler (with its curriculum) otherwise.
    sampler = build_sampler(cfg, c.train_rows)
    # Prompt pairing (trainer/prompt_pairing.py): None unless task.pairing; then only the selected
    # (q+, q−) pairs are drawn, chosen by a pre-pass with π_0 (pairing.prepare below).
    pairing = PromptPairing.create(cfg, dist)
    sampler = sampler if pairing is None else pairing.sampler
    # Low-likelihood curation (trainer/curation.py): None unless task.curation; then only the prompts a
    # pre-pass with π_0 finds solved with a low success rate are drawn (curation.prepare below).
    curation = Curation.create(cfg, dist)
    sampler = sampler if curation is None else curation.sampler
    # DPH-RL (trainer/rehearsal.py): None unless algorithm.dph.coef > 0; its buffer's perfect prompts
    # leave the RL prompts (dph.exclude_from_rl) through the wrapped sampler.
    rehearsal = Rehearsal.create(cfg, dist)
    if rehearsal is not None:
        sampler = rehearsal.wrap_sampler(sampler)
    sws = SwS.create(cfg, c, sampler)  # SwS (trainer/sws_synthesis.py): None unless task.sws.enabled
    eva = Eva.create(cfg, c, sampler)  # eva (trainer/eva_evolve.py): None unless task.eva.enabled
    hpt = HPT.create(cfg, dist, c)  # HPT (trainer/hpt_step.py): None unless algorithm.hpt.enabled
    recap = Recap.create(cfg, dist, c)  # RECAP (trainer/recap_step.py): None unless algorithm.recap.enabled
    guide = Guide.create(cfg, dist, c)  # Guide (trainer/guide_step.py): None unless algorithm.guide.enabled
    agent_rlvr = AgentRLVR.create(cfg, dist, c)  # Agent-RLVR (trainer/agent_rlvr_step.py): None unless enabled
    scaffold = Scaffold.create(cfg, dist, c)  # GHPO (trainer/scaffold_step.py): None unless algorithm.scaffold.enabled
    ampo = AMPO.create(cfg, dist, c)  # AMPO (trainer/ampo_step.py): None unless algorithm.ampo.enabled
    scope = Scope.create(cfg, dist, c)  # SCOPE (trainer/scope_rollouts.py): None unless algorithm.scope.enabled
    svs = SvS.create(cfg, dist, c)  # SvS (trainer/svs_step.py): None unless algorithm.svs.enabled
    ssp = SSP.create(cfg, dist, c)  # Search Self-play (trainer/ssp_round.py): None unless algorithm.ssp.enabled
    rl_plus = RLPlus.create(cfg, dist, c)  # RL-PLUS (trainer/rl_plus_step.py): None unless algorithm.rl_plus.enabled
    calibrl = CalibRL.create(cfg, dist, c)  # CalibRL (trainer/calibrl_step.py): None unless algorithm.calibrl.enabled
    kdrl = KDRL.create(cfg, dist, c)  # KDRL (trainer/kdrl_step.py): None unless algorithm.kdrl.teacher
    srpo = SRPO.create(cfg, dist, c)  # SRPO (trainer/srpo_step.py): None unless algorithm.srpo_coef > 0
    spae = SPAE.create(cfg, dist, c)  # SPAE (trainer/spae_step.py): None unless algorithm.spae_coef > 0
    rltf_sd = RLTFSD.create(cfg, dist, c)  # RLTF-SD (trainer/rltf_sd_step.py): None unless algorithm.rltf_sd_coef > 0
    # RLFR (trainer/latent_flow_step.py): None unless algorithm.rlfr.enabled; then c.algo.latent_flow, read by the update
    latent_flow = LatentFlow.create(cfg, dist, c)
    scheduler = torch.optim.lr_scheduler.LambdaLR(c.optimizer, lr_lambda(cfg))
    acc_src = correctness_source(c.rewards)
    eval_tokens = cfg.trainer.eval_max_new_tokens or cfg.rollout.max_new_tokens
    micro_tokens = resolve_micro_batch_tokens(cfg.trainer.micro_batch_tokens, next(c.model.parameters()).device,
                                              c.model.config.vocab_size, dist.sharded)
    # auto on a CUDA GPU: the budget is measured on the run's own updates (trainer/gpu_budget.py)
    gpu_budget = measured_budget(cfg.trainer.micro_batch_tokens, next(c.model.parameters()).device, dist.sharded)
    result = TrainResult(run.path, None, None, None)
    progress = Progress(cfg.trainer.steps, enabled=cfg.trainer.progress and dist.is_main)
    kl_ctl = build_kl_controller(c.algo.cfg)  # fixed or adaptive β; its state goes into checkpoints
    std_filter = build_std_filter(cfg.algorithm)  # RLPR's std filter (None unless dynamic_sampling_filter=std)
    mssr_tracker = attach_mssr(c.algo, dist.active)  # MSSR's per-prompt baseline (None unless advantage=mssr)
    spa = SPAProgress.create(cfg, dist, c)  # SPA-RL's progress head (trainer/spa_step.py): None unless advantage=spa
    archer = ArcherCritic.create(cfg, dist, c)  # ArCHer (trainer/archer_critic.py): None unless advantage=archer
    # The estimators' own hidden-state passes (SPA, ArCHer): the step's token budget in, their metrics out
    estimator_passes = [h for h in (spa, archer) if h is not None]
    ref_reset = RefReset.create(cfg, dist, c)  # ProRL (trainer/ref_reset.py): None unless algorithm.ref_reset_every
    rorecomp = RoRecomp.create(cfg, dist, c)  # RoRecomp (trainer/rorecomp.py): None unless algorithm.rorecomp_fraction
    spear = Spear.create(cfg, dist, c)  # SPEAR (trainer/spear_replay.py): None unless algorithm.spear.enabled
    # WebAgent-R1 (trainer/turn_rows.py): None unless rollout.context_compression.enabled; then one update row per turn
    turn_rows = TurnRows.create(cfg, dist, c)
    arrol = ARRoL.create(cfg, dist, c)  # ARRoL (trainer/arrol_rollouts.py): None unless rollout.arrol.enabled
    deepsearch = DeepSearch.create(cfg, dist, c)  # DeepSearch's solution cache: None unless rollout.mcts.enabled
    # INSPO (trainer/instruction_population.py): None unless task.inspo.enabled; c.inspo draws the instructions
    inspo = InstructionPopulation.create(cfg, dist, c, run)
    # One-step-off-policy rollouts (trainer/async_rollouts.py): None unless trainer.async_rollouts.enabled
    async_ro = AsyncRollouts.create(cfg, dist, c)
    if async_ro is not None and on_exit is not None:
        on_exit.callback(async_ro.close)  # an error in the main thread joins the generation thread

    def evaluate(tag: str, step: int) -> float | None:
        if not c.eval_rows:
            return None
        # No truth source and a reward one greedy answer cannot get (majority_vote's group, ...): no number, rather
        # than a meaningless 0 with counted failures (eval/accuracy.py)
        if (skip := greedy_skip_reason(c.rewards, c.eval_rows, bool(cfg.rollout.environment))) is not None:
            run.write_json(f"eval_{tag}.json", {"skipped": skip})
            if dist.is_main:
                progress.write(f"held-out eval ({tag}) skipped: {skip}")
            return None
        with dist.autocast():
            # SSRL's sim2real: the search tool's loop (rollout/self_search.py); else c.backend itself
            res = greedy_accuracy(evaluation_backend(c.backend), c.eval_prompts, c.eval_rows, c.rewards,
                                  eval_tokens)
        key = "accuracy" if "accuracy" in res else "reward"
        logged = {f"eval/{key}": res[key]}
        if cfg.task.mixture:  # eval/<source>/accuracy (or /reward) next to the overall number
            from anabranch.data.mixture import eval_by_source

            by_source = eval_by_source(c.eval_rows, res["scores"], sampler.labels, key == "accuracy")
            logged.update({f"eval/{label}/{key}": v for label, v in by_source.items()})
        run.log_metrics(step, logged)
        run.write_json(f"eval_{tag}.json", {key: res[key], "n": res["n"], "examples": [
            {"question": str(r["question"]), "answer": r["answer"], "completion": comp, "score": s}
            for r, comp, s in zip(c.eval_rows, res["completions"], res["scores"])]})
        if dist.is_main:
            progress.write(f"held-out {key} ({tag}, greedy, {res['n']} problems): {res[key]:.3f}")
        return res[key]

    ckpt = Checkpointer(cfg, c, run, sampler, scheduler, result, progress, stop,
                        stateful={"kl_controller": kl_ctl,
                                  **({"dph_rehearsal": rehearsal.buffer} if rehearsal is not None else {}),
                                  **({"std_filter": std_filter} if std_filter is not None else {}),
                                  **({"mssr_tracker": mssr_tracker} if mssr_tracker is not None else {}),
                                  **({"spa": spa} if spa is not None else {}),  # SPA's progress head and optimizer
                                  **({"archer": archer} if archer is not None else {}),  # ArCHer's critic and buffer
                                  **({"ref_reset": ref_reset} if ref_reset is not None else {}),
                                  **({"rorecomp": rorecomp} if rorecomp is not None else {}),  # its replay buffer
                                  **({"spear": spear} if spear is not None else {}),  # SPEAR's buffer and baseline
                                  **({"arrol": arrol} if arrol is not None else {}),  # ARRoL's quality head
                                  # DeepSearch's solution cache (algorithms/deepsearch.py; gathered under DDP)
                                  **({"deepsearch": deepsearch} if deepsearch is not None else {}),
                                  **({"inspo": inspo} if inspo is not None else {}),  # INSPO's instructions, scores
                                  # async rollouts: the pending batch's prompts (regenerated on resume)
                                  **({"async_rollouts": async_ro} if async_ro is not None else {}),
                                  # SEELE's stored per-prompt hint ratios (scaffold.schedule=irt, algorithms/hint_irt.py)
                                  **({"scaffold_irt": scaffold.irt} if scaffold is not None and scaffold.irt is not None
                                     else {}),
                                  **({"recap": recap} if recap is not None else {}),  # RECAP's loss histories
                                  **({"sws": sws} if sws is not None else {}),  # SwS's record and new rows
                                  **({"eva": eva} if eva is not None else {}),  # eva's estimates and new rows
                                  # ER/ERV/ERA shaping's EMA baselines (algorithms/er_shaping.py)
                                  **({"er_shaping": c.algo.er_shaping} if c.algo.er_shaping is not None else {}),
                                  # SIREN's entropy anchor (algorithms/siren.py)
                                  **({"siren": c.algo.siren} if c.algo.siren is not None else {}),
                                  # EPO's entropy history (algorithms/epo.py)
                                  **({"epo": c.algo.epo} if c.algo.epo is not None else {}),
                                  # RLFR's flow net, its optimizer and standardizer (trainer/latent_flow_step.py)
                                  **({"rlfr": latent_flow} if latent_flow is not None else {}),
                                  # SAFE's KL tracker and PID state (algorithms/safe.py)
                                  **({"safe": c.algo.safe} if c.algo.safe is not None else {}),
                                  **reward_states(c.rewards)},  # stateful rewards (OLR's label histories)
                        dist=dist)
    start = ckpt.restore()  # 0 unless trainer.resume found a checkpoint
    if pairing is not None:  # pre-pass on a fresh run; a resumed run's pairs came back with the sampler
        with dist.autocast():
            pairing.prepare(c, start)
        run.write_json("prompt_pairs.json", pairing.report(c.train_rows))
        if dist.is_main:
            progress.write(pairing.describe())
    if curation is not None:  # pre-pass on a fresh run; a resumed run's kept prompts came back with the sampler
        with dist.autocast():
            curation.prepare(c, start)
        run.write_json("curation.json", curation.report(c.train_rows))
        if dist.is_main:
            progress.write(curation.describe())
    if rehearsal is not None:  # pre-sampling with π_0 on a fresh run; restored with the checkpoint otherwise
        with dist.autocast():
            stats = rehearsal.prepare(c, start, dist)
        run.write_json("dph_buffer.json", stats)
        if dist.is_main:
            progress.write(Rehearsal.describe(stats))
    progress.bar.update(start)
    if cfg.trainer.eval_before and start == 0:
        result.accuracy_before = evaluate("before", 0)
    for step in range(start + 1, cfg.trainer.steps + 1):
        t0 = time.perf_counter()
        with dist.autocast():  # mixed precision (bf16/fp16 launches) for every forward of the step
            # generate + score (+ DAPO overlong shaping, dynamic sampling); whole prompt groups per rank
            if cfg.rollout.temperature_schedule != "constant":  # EAD's d_s: s = training steps done, exact on resume
                c.backend.schedule_step = step - 1
            if async_ro is None:
                batch = collect_batch(c, dist.rank_sampler(sampler), cfg, dist, group_filter=std_filter, step=step)
            else:  # generated during the last step (one version behind); the next one is launched here
                batch = async_ro.next_batch(step, sampler)
            if inspo is not None:  # INSPO: scores from every rank's rollouts; prune + propose when due
                batch.metrics.update(inspo.step(step))
            # The step's method results, (method, result), folded into the update below: a batch rewriter's
            # .batch, and where present .precomputed(pre), .extra_loss(method, model, dist), .metrics, .pre_correct
            parts = [] if async_ro is None else [(async_ro, async_ro.part)]  # its behaviour log-probs, async/*
            # RECAP: this step's weights (from the steps before), its replay rows, and the RL error measured
            # here, before Guide/scaffolding/AMPO/SCOPE put hinted or teacher rows in the failed rows' places
            if recap is not None:
                parts.append((recap, recap.step(step, batch, c.rewards)))
            # Guide / GHPO scaffolding: all-fail groups sampled again with a hint (Guide trains them for the
            # hint-free prompt, scaffolding in the hinted one); AMPO: the teachers' correct solutions the student
            # finds most likely. Each replaces the groups in place (at most one of them is on).
            for method in (guide, scaffold):
                if method is not None:
                    parts.append((method, method.step(c, batch, step)))
                    batch = parts[-1][1].batch
            if agent_rlvr is not None:  # Agent-RLVR: failed attempts retried with guidance -> DPO pairs; batch as is
                parts.append((agent_rlvr, agent_rlvr.step(c, batch, step)))
            if ampo is not None:
                parts.append((ampo, ampo.step(c, batch, micro_tokens)))
                batch = parts[-1][1].batch
            if scope is not None:  # SCOPE: failed samples rewritten from their first PRM-wrong step, in place
                parts.append((scope, scope.step(c, batch)))
                batch = parts[-1][1].batch
            if svs is not None:  # SvS: synthesis groups and the kept synthesized problems' solve groups appended
                parts.append((svs, svs.step(c, batch, step)))
                batch = parts[-1][1].batch
            if ssp is not None:  # Search Self-play: proposer groups and the valid questions' solver groups appended
                parts.append((ssp, ssp.step(c, batch, step)))
                batch = parts[-1][1].batch
            # DSDR (algorithms/dsdr.py): diversity bonus of correct responses, before the advantages
            dsdr_weight = apply_dsdr(c.algo.cfg, batch, acc_src, dist)
            if spear is not None:  # SPEAR's tool-call reward curriculum (tool_reward.coef > 0), before the advantages
                spear.tool_reward(batch, step)
            rollout, rows, total, per_source, rewards = (batch.rollout, batch.rows, batch.total, batch.per_source,
                                                         batch.rewards)
            t_gen = batch.t_generate
            if gpu_budget is not None:  # this step's budget; its peak-memory measurement starts here
                micro_tokens = gpu_budget.before_update()
            for helper in estimator_passes:  # their hidden-state pass (inside the estimator below): the same budget
                helper.micro_batch_tokens = micro_tokens
            # Advantages from every sample's real reward (a truncated one still counts in its group's
            # mean and std); DAPO's overlong filter then masks truncated samples out of the loss only.
            # (turn rows: the per-token passes run in the update, on the rows, not here on the trajectories)
            adv_algo = c.algo if turn_rows is None else turn_rows.advantage_algo
            adv = compute_advantages(adv_algo, c.model, rollout, rewards,
                                     micro_batch_size=cfg.trainer.micro_batch_size,
                                     temperature=cfg.rollout.temperature, ref_model=c.ref_model, modules=c.modules,
                                     kl_controller=kl_ctl, share_prompt_prefix=cfg.trainer.share_prompt_prefix,
                                     micro_batch_tokens=micro_tokens, dist=dist.active)
            for helper in estimator_passes:  # their fit of this step (spa/*, archer/* metrics), run in the estimator
                adv.metrics.update(helper.metrics)
            # SPAE: probe π_old after each step of each response; step-potential term on the advantages
            adv = adv if spae is None else spae.step(c.model, rollout, rows, adv, micro_tokens)
            train_rollout = filter_overlong(rollout, c.algo.cfg.overlong_filter)
            if cfg.rollout.void_turn_filter:  # SimpleTIR: void-turn trajectories leave the loss, not the advantages
                train_rollout, void_metrics = c.backend.filter_void_turns(train_rollout)
                batch.metrics.update(void_metrics)  # tools/void_turn_frac
            # HPT: groups with accuracy <= gamma leave the RL loss and train on their demonstration instead
            if hpt is not None:
                parts.append((hpt, hpt.step(batch, train_rollout, c.rewards)))
                train_rollout = parts[-1][1].rollout
            # RL-PLUS: each prompt's demonstration, its advantage and π_old, before the update changes the policy
            if rl_plus is not None:
                parts.append((rl_plus, rl_plus.step(batch, train_rollout, c.model)))
            # CalibRL: each prompt's expert solution scored by π_old, its per-token baseline for the update
            if calibrl is not None:
                parts.append((calibrl, calibrl.step(batch, train_rollout, c.model)))
            # RLTF-SD: the retries (attempt k >= 2) of the scored episodes, to train after the prompt alone
            if rltf_sd is not None:
                parts.append((rltf_sd, rltf_sd.step(rollout)))
            # KDRL: the teacher's log-probs of the rollout (no gradient) and each row's β_s·mask, before the update
            if kdrl is not None:
                parts.append((kdrl, kdrl.step(step, batch, rollout, c.rewards, micro_tokens)))
            # SRPO: failed rows' self-teacher log-probs (policy + feedback, no gradient); they leave the GRPO term
            advantages = adv.advantages
            if srpo is not None:
                parts.append((srpo, srpo.step(c.model, batch, rollout, c.rewards, micro_tokens,
                                              trained_mask=train_rollout.trained_mask)))
                advantages = parts[-1][1].advantages(advantages)
            precomputed = with_dsdr(adv.precomputed, dsdr_weight)
            for _, part in parts:  # each method's own keys (KDRL, SRPO, Guide's π_old, AMPO's rows)
                precomputed = part.precomputed(precomputed) if hasattr(part, "precomputed") else precomputed
            update_rewards = rewards
            if rorecomp is not None:  # RoRecomp: the priority rows (+ a due compensation batch) train; the rest wait
                train_rollout, advantages, precomputed, update_rewards = rorecomp.step(
                    batch, train_rollout, advantages, precomputed, rewards, step, micro_tokens)
            if spear is not None:  # SPEAR: this step's rows + due replayed wins (recalibrated, Clip-Cov); wins enter
                train_rollout, advantages, precomputed, update_rewards = spear.step(
                    batch, train_rollout, advantages, precomputed, rewards, step, micro_tokens)
            if turn_rows is not None:  # WebAgent-R1: each turn a row under its own compressed context, M-GRPO's weights
                train_rollout, advantages, precomputed, update_rewards = turn_rows.step(
                    batch, train_rollout, advantages, precomputed, update_rewards)
            # Extra loss terms (DPH-RL, HPT, RL-PLUS, RLTF-SD): under DDP every rank builds each, as they all-reduce
            extra_loss = combine_extra_losses(
                None if rehearsal is None else rehearsal.extra_loss(dist.policy(c.model), step, dist.active),
                *(part.extra_loss(method, dist.policy(c.model), dist.active)
                  for method, part in parts if hasattr(part, "extra_loss")))
            metrics = policy_update(
                dist.policy(c.model), c.optimizer, train_rollout, advantages, update_rewards, c.algo,
                micro_batch_size=cfg.trainer.micro_batch_size, grad_clip=cfg.trainer.grad_clip,
                temperature=cfg.rollout.temperature, max_response_len=cfg.rollout.max_new_tokens,
                ref_model=c.ref_model, modules=c.modules, kl_coef=adv.kl_coef,
                precomputed=precomputed,
                dist=dist.active, micro_batch_tokens=micro_tokens,
                share_prompt_prefix=cfg.trainer.share_prompt_prefix,
                zero_advantage_rows=cfg.trainer.zero_advantage_rows,
                oom_retry=gpu_budget is not None,  # a measured budget that proves too large is halved
                extra_loss=extra_loss,
                rl_loss_scale=1.0 if recap is None else recap.rl_scale,  # RECAP's λ_rl / K
            )
            if spear is not None:  # SPEAR replay_step=separate: the replayed rows' own optimizer step ({} otherwise)
                replay = spear.replay_update(c, dist, cfg, micro_tokens, oom_retry=gpu_budget is not None)
                # a non-finite replay step counts in the non-finite guard (trainer/nonfinite.py) as the update's do
                metrics["skipped_updates"] = metrics.get("skipped_updates", 0.0) + replay.get("spear/replay/skipped", 0)
                batch.metrics.update(replay)
        if gpu_budget is not None:
            gpu_budget.after_update(int(metrics["update/max_micro_batch_tokens"]))
            metrics.update(gpu_budget.metrics())
        with warnings.catch_warnings():
            # A step whose update the non-finite guard skipped never called optimizer.step(); the
            # schedule still advances by one step, which is what torch's warning is about.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            scheduler.step()
        if ref_reset is not None:  # after the optimizer step: π_ref ← π_θ (and a fresh optimizer) on the interval
            metrics.update(ref_reset.after_update(step))
        t_sync = time.perf_counter()
        c.backend.sync_weights(c.model) if async_ro is None else async_ro.after_update(c.model)
        # batch.metrics last: a batch rewriter's .metrics is the batch's at its step (its keys are in the batch's)
        metrics.update({**adv.metrics, **{k: v for _, part in parts for k, v in getattr(part, "metrics", {}).items()},
                        **batch.metrics})
        metrics.update({"time/step_s": time.perf_counter() - t0, "time/generate_s": t_gen,
                        "time/sync_weights_s": time.perf_counter() - t_sync})
        if c.device.type == "cuda":  # this process's peak GPU memory so far (allocated tensors)
            peak = gpu_budget.run_peak() if gpu_budget is not None else torch.cuda.max_memory_allocated(c.device)
            metrics["memory/gpu_peak_gib"] = peak / 2**30
        metrics = dist.mean_metrics(metrics)
        if recap is not None:  # RECAP: the step's tracked losses (averaged over ranks) join the history
            metrics.update(recap.observe(metrics))
        metrics.update(rollout_metrics(*dist.gather_rollout(rewards, per_source, rollout), acc_src))
        if pairing is not None:  # pairing/...: the pairs' pre-pass success rates, this step's q+/q− accuracy
            metrics.update(pairing.step_metrics(batch, c.rewards))
        if curation is not None:  # curation/...: how many prompts the pre-pass kept, their mean success rate
            metrics.update(curation.sampler.stats)
        if sws is not None:  # SwS: the drawn rows' accuracies recorded; on its interval, new rows synthesized
            metrics.update(sws.after_step(batch, step, run))
        if eva is not None:  # eva: the drawn rows' informativeness estimated; on its interval, a creator round
            metrics.update(eva.after_step(batch, step, run))
        if cfg.task.mixture:  # task/<source>/... metrics; the curriculum's update for the next draw
            flags = correct_flags(per_source[acc_src.name]) if acc_src is not None else None
            # Guide, scaffolding, AMPO: each row's own right/wrong, before hinted or teacher rows replaced the
            # failed groups' (task.curriculum, which reads their |advantage|, is refused with them)
            flags = flags if flags is None else next((p.pre_correct for _, p in parts if hasattr(p, "pre_correct")),
                                                     flags)
            metrics.update(mixture_step(sampler, dist, rows, adv.advantages, rollout.trained_mask, total, flags))
        metrics["lr"] = scheduler.get_last_lr()[0]
        ckpt.observe(step, metrics)  # counts and reports NaN/inf steps
        run.log_metrics(step, metrics)
        run.log_samples(step, [{"question": str(rows[i]["question"]), "answer": rows[i]["answer"],
                                "completion": rollout.completions[i], "reward": total[i]}
                               for i in range(min(cfg.trainer.log_samples, len(rows)))])
        result.history.append(metrics)
        progress.update(step, metrics)
        if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0 and step < cfg.trainer.steps:
            evaluate(f"step{step}", step)
        ckpt.after_step(step)  # periodic save; on a signal or NaN streak: save and raise RunStopped
    progress.close()
    # The trained weights reach disk before the held-out eval, which can take minutes: a run killed
    # during it (a scheduler's SIGKILL after its grace period) keeps final/.
    if cfg.trainer.save_final:
        full = full_model_state(dist, c.model)  # a sharded policy's weights, gathered (all ranks)
        if dist.is_main:
            result.final_model_dir = export_hf(c.model, c.tokenizer, run.path / "final", state_dict=full)
    if cfg.trainer.eval_after:
        result.accuracy_after = evaluate("after", cfg.trainer.steps)
    run.write_json("summary.json", {"accuracy_before": result.accuracy_before,
                                    "accuracy_after": result.accuracy_after, "steps": cfg.trainer.steps,
                                    "model_collapse": collapse_report(run.path / "metrics.jsonl",
                                                                      cfg.trainer.collapse_margin)})
    run.close()
    dist.barrier()  # rank 0 has finished writing before any rank returns
    return result


def rollout_metrics(rewards: torch.Tensor, per_source: dict, rollout, acc_src) -> dict:
    lengths = rollout.response_lengths.float()
    groups = rollout.group_index
    # Groups whose rewards are all equal give GRPO no signal.
    same = [bool((rewards[groups == g] == rewards[groups == g][0]).all()) for g in groups.unique()]
    out = {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item() if rewards.numel() > 1 else 0.0,
        "response_length/mean": lengths.mean().item(),
        "response_length/truncated_frac": rollout.truncated.float().mean().item(),
        "groups/all_equal_frac": sum(same) / max(len(same), 1),
        "groups/distinct_answers": group_distinct_answers([extract_answer(c) for c in rollout.completions],
                                                          groups.tolist()),
    }
    for name, values in per_source.items():
        out[f"reward/{name}"] = sum(values) / max(len(values), 1)
    if acc_src is not None:  # the fraction of full-credit samples (eval/accuracy.py)
        flags = correct_flags(per_source[acc_src.name])
        out["accuracy"] = sum(flags) / max(len(flags), 1)
    return out
