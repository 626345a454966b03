"""One policy update on a batch of rollouts: the only place where gradients are taken.

The objective comes from the registry; this function computes exactly the inputs it declared
(`needs`), accumulates gradients over micro-batches with full-batch loss normalizers, adds the
shared KL-to-reference and entropy terms when their coefficients are non-zero, and skips the
optimizer step when the gradient is not finite.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional

import torch

from anabranch.algorithms.aggregation import aggregate, batch_scale, masked_mean
from anabranch.algorithms.diagnostics import finish_diagnostics, update_diagnostics
from anabranch.algorithms.dsdr import dsdr_local_loss
from anabranch.algorithms.kdrl import kd_loss
from anabranch.algorithms.srpo import distill_loss
from anabranch.algorithms.kl import kl_penalty
from anabranch.algorithms.lp_reg import lp_reg_loss
from anabranch.algorithms.rover import response_vocab_mean
from anabranch.algorithms.exploration import shape_advantages
from anabranch.algorithms.guide import behaviour_old_log_prob
from anabranch.algorithms.off_policy_split import off_policy_inputs, shaped_objective
from anabranch.algorithms.calibrl import calibrl_loss
from anabranch.algorithms.decoupled_ppo import decoupled_advantages
from anabranch.algorithms.alp import alp_context, alp_metrics
from anabranch.algorithms.resolve import Algorithm
from anabranch.models.shared_prefix import supports_shared_prefix
from anabranch.rollout.base import Rollout
from anabranch.rollout.importance import sampler_correction
from anabranch.trainer.inert_rows import inert_rows, plan_passes
from anabranch.trainer.microbatch import forward_micro_batch, micro_batches, plan_micro_batches, plan_rows  # noqa: F401


@dataclass
class LossContext:
    """Everything an objective may read besides its four positional tensors."""

    cfg: Any
    aggregate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ref_log_prob: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    hidden: Optional[torch.Tensor] = None
    rewards: Optional[torch.Tensor] = None
    group_index: Optional[torch.Tensor] = None
    prompt_mask: Optional[torch.Tensor] = None
    modules: dict = field(default_factory=dict)  # extra trainable heads (log Z, value)
    extras: dict = field(default_factory=dict)   # per-sample rollout tensors (values, returns) of this micro-batch


@torch.no_grad()
def no_grad_log_probs(model, rollout: Rollout, micro: int, temperature: float, plan=None,
                      share_prefix: bool = False) -> torch.Tensor:
    width = rollout.response_ids.shape[1]
    plan = plan or plan_micro_batches(rollout.prompt_mask, rollout.response_mask, micro)
    device = next(model.parameters()).device
    ids, mask = rollout.input_ids.to(device), rollout.attention_mask.to(device)
    full = torch.zeros(ids.shape[0], width, device=device)
    for mb in plan:
        full[mb.rows.to(device)] = forward_micro_batch(model, mb, ids, mask, temperature,
                                                       share_prefix=share_prefix).log_probs
    return full


def policy_update(model, optimizer, rollout: Rollout, advantages: torch.Tensor, rewards: torch.Tensor,
                  algo: Algorithm, *, micro_batch_size: int, grad_clip: float, temperature: float,
                  max_response_len: int, ref_model=None, modules: dict | None = None,
                  params: list | None = None, precomputed: dict | None = None,
                  kl_coef: float | None = None, dist=None, micro_batch_tokens: int = 0,
                  share_prompt_prefix: bool = True, zero_advantage_rows: str = "forward",
                  extra_loss: Callable[[], dict] | None = None, oom_retry: bool = False,
                  rl_loss_scale: float = 1.0) -> dict[str, float]:
    """``micro_batch_tokens > 0`` packs micro-batches by a token budget (trainer/microbatch.py);
    ``share_prompt_prefix`` runs each prompt once for the rows that share it, where the model
    allows (models/shared_prefix.py; same results, fewer tokens computed);
    ``zero_advantage_rows`` (``forward``, ``skip``, ``train``): what is run for sequences whose loss
    terms are exactly zero (trainer/inert_rows.py);
    ``precomputed`` holds rollout tensors computed before the update (old/ref log-probs,
    values, returns: see ``advantage_pass``); ``kl_coef`` overrides ``cfg.kl_coef`` (adaptive KL);
    ``dist`` (a :class:`~anabranch.trainer.distributed.Distributed`): data parallel, with the
    global batch's normalizers and the launcher's backward and gradient clipping;
    ``extra_loss``: a term outside the rollout batch (DPH-RL's rehearsal, trainer/rehearsal.py; HPT's SFT,
    RL-PLUS's external term and RLTF-SD's self-distillation), called once per epoch before clipping, after the micro-batches (one
    process) or, under DDP, inside no_sync before the last one so that its gradient joins the
    all-reduce; it runs its own forward and backward (into the same gradient, for the same optimizer
    step), already scaled for DDP's average over ranks, and returns its metrics;
    ``oom_retry``: on a CUDA out-of-memory error in an epoch's passes, run the epoch again in
    micro-batches of half the largest one's tokens (one process; trainer/gpu_budget.py's auto budget);
    ``rl_loss_scale``: a factor on the batch's loss in its backward only (RECAP's λ_rl / K,
    trainer/recap_step.py; the logged loss stays unscaled)."""
    cfg = algo.cfg
    pre = precomputed or {}
    kl_coef = cfg.kl_coef if kl_coef is None else kl_coef
    device = next(model.parameters()).device
    rollout_ids = rollout.input_ids.to(device)
    rollout_mask = rollout.attention_mask.to(device)
    resp_mask = rollout.trained_mask.to(device).float()  # tool outputs are context, not trained
    advantages = advantages.to(device)
    if dist is not None:
        scale = dist.batch_scale(resp_mask, max_response_len)
    else:
        scale = batch_scale(resp_mask, max_response_len)
    agg = partial(aggregate, mode=cfg.loss_agg_mode, scale=scale)

    share_prefix = share_prompt_prefix and supports_shared_prefix(model)
    plan_args = dict(group_index=rollout.group_index, share_prefix=share_prefix,
                     whole_groups="whole_groups" in algo.needs)
    plan = plan_micro_batches(rollout.prompt_mask, rollout.response_mask, micro_batch_size, micro_batch_tokens,
                              **plan_args)
    # (micro-batch, takes a backward pass, counts in the metrics). Sequences with no share in the
    # gradient get a forward pass without gradient for the metrics, or none (trainer/inert_rows.py).
    inert = inert_rows(algo, advantages, resp_mask, kl_coef, zero_advantage_rows,
                       dist is not None and not dist.allows_inert_rows(model))
    metric_tokens = scale.total_tokens  # the response tokens the metrics' means are over
    # DDP: every rank runs exactly one backward outside no_sync, its last pass (plan_passes).
    must_train = dist is not None and dist.world_size > 1
    skip_metrics = True  # skip mode: whether the forced pass's metrics (at weight 0) keep the keys
    if inert is not None:
        inert = inert.cpu()
        if zero_advantage_rows == "skip":
            live_tokens = resp_mask[~inert.to(device)].sum().item()
            if dist is None:
                metric_tokens = max(live_tokens, 1.0)
            else:  # the global batch's trained tokens, over W as in batch_scale (every rank calls this)
                live_tokens = dist.all_reduce_sum(torch.tensor([live_tokens], dtype=torch.float64))[0].item()
                metric_tokens = max(live_tokens, 1.0) / dist.world_size
            # No rank trains a sequence: the metrics are left out everywhere, as in one process;
            # otherwise a rank that trains none still logs the keys (its forced pass, at weight 0):
            # mean_metrics averages a key over the ranks that log it, and the share_r token weights
            # give the global token mean only when all W ranks count in that mean.
            skip_metrics = live_tokens > 0
    passes = plan_passes(plan, inert, zero_advantage_rows, must_train,
                         lambda rows: plan_rows(rows, rollout.prompt_mask, rollout.response_mask, micro_batch_size,
                                                micro_batch_tokens, **plan_args))
    ref_lp = pre.get("ref_log_prob")
    if ref_lp is not None:
        ref_lp = ref_lp.to(device)
    elif "ref_log_prob" in algo.needs:
        if ref_model is None:
            raise RuntimeError("this algorithm needs reference log-probs but no reference model was loaded")
        ref_lp = no_grad_log_probs(ref_model, rollout, micro_batch_size, temperature, plan, share_prompt_prefix)
    # With one pass over the batch, π_old = π_θ exactly, so that forward pass is skipped.
    old_lp = pre.get("old_log_prob")
    if old_lp is not None:
        old_lp = old_lp.to(device)
    elif "old_log_prob" in algo.needs:
        old_lp = no_grad_log_probs(model, rollout, micro_batch_size, temperature, plan, share_prefix)
    extras = {k: v.to(device) for k, v in pre.items() if k in ("values", "returns", "old_vocab_mean", "value_heads")}
    if algo.precompute is not None:  # the objective's batch-wide inputs, over the tokens this update trains
        # dist: a hook may reduce over every rank's batch (ReasonMaxxer's global gate); a collective on every rank.
        extras.update(algo.precompute(cfg, pre, resp_mask, rewards, rollout.group_index, dist=dist))
    # DSDR's local term (algorithms/dsdr.py): per-row weights γ_i/N_C from the rollout's scoring.
    dsdr_w = pre.get("dsdr_weight") if cfg.dsdr_local_coef != 0 else None
    # KDRL (algorithms/kdrl.py, trainer/kdrl_step.py): the teacher's log-probs and each row's β_s·w_i.
    kd_lp, kd_w = pre.get("teacher_log_prob"), pre.get("kdrl_weight")
    # Rows trained against their own behaviour policy's log-probs (algorithms/guide.py:behaviour_old_log_prob):
    # Guide's guided rows, log π_old(o_t | q, h, o_<t) (trainer/guide_step.py); RoRecomp's replayed rows, π_old
    # of the step that sampled them (trainer/rorecomp.py), which also stay out of this step's sampler correction.
    behaviour_lp, behaviour_rows = pre.get("behaviour_log_prob"), pre.get("behaviour_rows")
    stale_rows = pre.get("stale_rows")
    # Async rollouts (trainer/async_rollouts.py): the behaviour policy's log-probs, (cap, mode) of AReaL's weight.
    dec_lp, dec_cap = pre.get("decoupled_behaviour_log_prob"), pre.get("decoupled_weight_cap")
    # AMPO's injected teacher rows ([B], trainer/ampo_step.py) or SCOPE's rectifier tokens ([B, R],
    # trainer/scope_rollouts.py), trained with the shaped term (algorithms/off_policy_split.py); else None.
    off_split = off_policy_inputs(pre, cfg)
    # CalibRL (algorithms/calibrl.py, trainer/calibrl_step.py): each row's expert baseline b_t ([B, T]).
    calib_b = pre.get("calibrl_baseline")
    if kd_lp is not None:
        kd_lp, kd_w = kd_lp.to(device), kd_w.to(device)
    # SRPO (algorithms/srpo.py, trainer/srpo_step.py): the self-teacher's log-probs and each token's β·ω (failed rows).
    sr_lp, sr_w = pre.get("srpo_teacher_log_prob"), pre.get("srpo_weight")
    if sr_lp is not None:
        sr_lp, sr_w = sr_lp.to(device), sr_w.to(device)
    # EPO (algorithms/epo.py): the token entropy held in a band around its historical mean (the pass is made here,
    # before entropy_grad: its penalty needs the entropy's gradient once there is a history).
    epo_pass = None if getattr(algo, "epo", None) is None else algo.epo.begin()
    # SAFE (algorithms/safe.py): β·g from the previous steps' statistics on a KL that keeps its gradient.
    safe_pass = None if getattr(algo, "safe", None) is None else algo.safe.begin(rewards)
    entropy_grad = (cfg.entropy_coef != 0 or "entropy" in algo.needs or dsdr_w is not None
                    or (epo_pass is not None and epo_pass.active))
    lp_reg = (cfg.lp_reg_kappa, cfg.lp_reg_tau) if cfg.lp_reg_coef > 0 else None  # Lp-Reg's proxy, only when on
    # ER/ERV/ERA shaping (algorithms/er_shaping.py): each row's bonus from its first forward of this update.
    er_state = getattr(algo, "er_shaping", None)
    er_pass = None if er_state is None else er_state.begin(rollout.response_ids.shape[0])
    # RLFR (trainer/latent_flow_step.py): each row's flow term from the latents its layer hook catches in this forward.
    lf_state = getattr(algo, "latent_flow", None)
    lf_pass = None if lf_state is None else lf_state.begin(*rollout.response_ids.shape, rewards)
    # SIREN (algorithms/siren.py): the top-p entropy from a second, chunked head pass, toward the anchor.
    siren_state = getattr(algo, "siren", None)
    siren_pass = None if siren_state is None else siren_state.begin(scale.total_seqs)
    siren_top_p = None if siren_pass is None else siren_state.top_p
    if params is None:
        params = [p for g in optimizer.param_groups for p in g["params"]]

    totals: dict[str, float] = {}
    skipped = 0
    # Out of GPU memory in a pass: redo the epoch in smaller micro-batches (one process only: under
    # data parallelism the other ranks would wait in the gradient all-reduce).
    retry_oom = oom_retry and (dist is None or dist.world_size == 1)
    # Wall time of the forward+backward passes and of clipping + the optimizer step. On CUDA the
    # `.item()` calls below wait for the queued kernels, so each span holds its own work.
    t_fwd_bwd = t_opt = 0.0
    # DDP with several ranks: ``extra_loss`` runs inside no_sync just before the last pass, whose
    # synced backward all-reduces the whole accumulated gradient, the extra term's included; run
    # after that backward, its gradient would stay on its rank and the replicas would drift apart.
    # One process: after the passes, as before (same numbers).
    extra_early = extra_loss is not None and must_train

    def run_epoch() -> tuple[dict, float, bool]:
        """One pass over the batch (forward + backward of every micro-batch and ``extra_loss``):
        its metric sums, its summed loss, and whether any backward ran."""
        ep: dict[str, float] = {}
        epoch_loss, backward_ran = 0.0, False
        extra: dict = {}
        for i, (mb, trains, counts) in enumerate(passes):  # fixed-size (whole groups) in input order, or packed by tokens
            if extra_early and i == len(passes) - 1:
                with dist.micro_batch_context(model, False):  # no_sync: its gradient waits for the last pass's
                    extra = extra_loss()
            sync = contextlib.nullcontext() if dist is None else dist.micro_batch_context(model, i == len(passes) - 1)
            grad_mode = contextlib.nullcontext() if trains else torch.no_grad()
            # A pass without autograd never goes through DDP's wrapper (Distributed.forward_only).
            fwd_model = model if trains or dist is None else dist.forward_only(model)
            # ALP (algorithms/alp.py): layer noise in this pass's forward and backward (recompute) only; off: a no-op.
            perturb = alp_context(modules, model, dist)
            with sync, grad_mode, perturb:  # DDP: no gradient all-reduce before the last micro-batch's backward
                sl = mb.rows.to(device)
                fo = forward_micro_batch(fwd_model, mb, rollout_ids, rollout_mask, temperature, share_prefix=share_prefix,
                                         entropy=True, entropy_grad=entropy_grad, hidden="hidden" in algo.needs,
                                         lp_reg=lp_reg, siren_top_p=siren_top_p)
                m = resp_mask[sl]
                ctx = LossContext(cfg=cfg, aggregate=agg, ref_log_prob=None if ref_lp is None else ref_lp[sl],
                                  entropy=fo.entropy, hidden=fo.hidden, rewards=rewards.to(device)[sl],
                                  group_index=rollout.group_index[mb.rows].to(device),
                                  prompt_mask=rollout.prompt_mask[mb.rows].to(device), modules=modules or {},
                                  extras={k: v[sl] for k, v in extras.items()})
                if "vocab_mean" in algo.needs:  # ROVER's next-state Q (algorithms/rover.py), without gradient
                    ctx.extras["vocab_mean"] = response_vocab_mean(model, fo.hidden, rollout.prompt_ids.shape[1],
                                                                   m.shape[1], temperature)
                old = fo.log_probs.detach() if old_lp is None else old_lp[sl]
                if behaviour_lp is not None:  # Guide's hinted context / RoRecomp's replayed rows' own step
                    old = behaviour_old_log_prob(old, behaviour_lp[mb.rows], behaviour_rows[mb.rows])
                sample_lp = None if rollout.sample_log_probs is None else rollout.sample_log_probs[mb.rows].to(device)
                # Rollouts from another engine (vLLM): log the mismatch, optionally correct it (TIS).
                adv, mismatch = sampler_correction(old, sample_lp, m, advantages[sl], cfg.tis_cap,
                                                   None if stale_rows is None else stale_rows[mb.rows])
                if dec_lp is not None:  # decoupled PPO (algorithms/decoupled_ppo.py): Â·w, w = π_prox/π_behav capped
                    adv, dec_metrics = decoupled_advantages(adv, old, dec_lp[mb.rows], m, *dec_cap)
                    mismatch.update(dec_metrics)
                if er_pass is not None:  # before the entropy controls: its |Â|/κ clip reads the estimator's Â
                    adv = er_pass.shape(adv, fo.hidden, m, mb.rows, rollout.prompt_ids.shape[1])
                if lf_pass is not None:  # RLFR: Â + the flow reward's reward-to-go (online fit of the correct rows)
                    adv = lf_pass.shape(adv, m, mb)
                adv, metrics = shape_advantages(adv, fo.entropy, m, cfg)
                metrics.update(mismatch)
                if off_split is None:
                    loss, obj_metrics = algo.objective(fo.log_probs, old, adv, m, ctx)
                else:  # AMPO / SCOPE: the objective on the on-policy tokens, −f(π_θ)·Â on the off-policy ones
                    off, gamma, metric = off_split
                    loss, obj_metrics = shaped_objective(algo.objective, fo.log_probs, old, adv, m, ctx, off[mb.rows],
                                                         gamma, agg, metric)
                metrics.update(obj_metrics)
                for aux_loss in algo.aux_losses:
                    aux, aux_metrics = aux_loss(ctx, m)
                    loss = loss + aux
                    metrics.update(aux_metrics)
                if ref_lp is not None and kl_coef > 0 and cfg.kl_in == "loss":
                    kl = kl_penalty(fo.log_probs, ref_lp[sl], cfg.kl_estimator)
                    loss = loss + kl_coef * agg(kl, m)
                    metrics["kl_ref"] = masked_mean(kl.detach(), m).item()
                if kd_lp is not None:  # KDRL: β_s·KL(π_θ ‖ π_teacher) on the same forward, beside the reference KL
                    kd, kd_metrics = kd_loss(fo.log_probs, kd_lp[sl], m, kd_w[sl], cfg.kdrl.estimator, agg)
                    loss = loss + kd
                    metrics.update(kd_metrics)
                if sr_lp is not None:  # SRPO: failed rows distilled toward the feedback-conditioned self-teacher
                    sd, sd_metrics = distill_loss(fo.log_probs, sr_lp[sl], m, sr_w[sl], agg)
                    loss = loss + sd
                    metrics.update(sd_metrics)
                if calib_b is not None:  # CalibRL: |Â|·LeakyReLU_α(−sign(Â)(log π_θ − b)) beside the RL loss
                    cr = cfg.calibrl
                    cl, cl_metrics = calibrl_loss(fo.log_probs, calib_b[mb.rows].to(device), adv, m, cr.coef,
                                                  cr.negative_slope, agg)
                    loss = loss + cl
                    metrics.update(cl_metrics)
                if lp_reg is not None:  # Lp-Reg (algorithms/lp_reg.py): protect the low-probability sparks
                    lp_loss, lp_metrics = lp_reg_loss(fo.log_probs, fo.proxy_log_prob, adv, m, cfg, agg)
                    loss = loss + lp_loss
                    metrics.update(lp_metrics)
                if siren_pass is not None:  # SIREN: selected top-p entropy pulled toward its anchor
                    siren_loss, siren_metrics = siren_pass.loss(fo.top_p_entropy, m, mb.rows)
                    loss = loss + siren_loss
                    metrics.update(siren_metrics)
                if epo_pass is not None:  # EPO: entropy outside its historical band penalized
                    epo_loss, epo_metrics = epo_pass.loss(fo.entropy, m, mb.rows, agg)
                    loss = loss + epo_loss
                    metrics.update(epo_metrics)
                if safe_pass is not None:  # SAFE: the entropy-gated KL to the reference
                    safe_loss, safe_metrics = safe_pass.loss(fo.log_probs, ref_lp[sl], fo.entropy, m, mb.rows, agg)
                    loss = loss + safe_loss
                    metrics.update(safe_metrics)
                if cfg.entropy_coef != 0:
                    loss = loss - cfg.entropy_coef * agg(fo.entropy, m)
                if dsdr_w is not None:  # DSDR: length-invariant entropy of correct responses only
                    loss = loss - cfg.dsdr_local_coef * dsdr_local_loss(fo.entropy, m, dsdr_w.to(device)[sl])
                if trains:
                    scaled = loss if rl_loss_scale == 1.0 else loss * rl_loss_scale  # RECAP's λ_rl / K
                    scaled.backward() if dist is None else dist.backward(scaled)
                    backward_ran = True
            share = m.sum().item() / metric_tokens  # weight of this micro-batch in the means
            metrics["loss"] = loss.item()
            epoch_loss += metrics["loss"]
            for key, value in update_diagnostics(fo.log_probs.detach(), old, adv, fo.entropy.detach(), m).items():
                metrics.setdefault(key, value)  # an objective's own clip_frac/approx_kl win
            if not counts and not skip_metrics:
                continue
            for key, value in metrics.items():
                # "loss" already carries the full-batch normalizer: it adds up, others average. A
                # pass that only keeps DDP's ranks in step adds nothing but its keys.
                value = (value if key == "loss" else value * share) if counts else 0.0
                ep[key] = ep.get(key, 0.0) + value
        if extra_loss is not None and not (extra_early and passes):  # its gradient joins this epoch's step,
            extra = extra_loss()                                      # even when no RL row trained
        for key, value in extra.items():
            ep[key] = ep.get(key, 0.0) + value
        return ep, epoch_loss, backward_ran

    def smaller_passes(current: list) -> list | None:
        """The passes re-planned with half the largest micro-batch's computed tokens as the budget, or
        None when that makes no micro-batch smaller."""
        tokens = lambda ps: max((mb.computed_tokens(rollout.group_index, share_prefix) for mb, _, _ in ps), default=0)  # noqa: E731
        budget = max(tokens(current) // 2, 1)
        replanned = plan_passes(
            plan_micro_batches(rollout.prompt_mask, rollout.response_mask, micro_batch_size, budget, **plan_args),
            inert, zero_advantage_rows, must_train,
            lambda rows: plan_rows(rows, rollout.prompt_mask, rollout.response_mask, micro_batch_size, budget,
                                   **plan_args))
        return replanned if tokens(replanned) < tokens(current) else None

    oom_retries = 0
    for _epoch in range(cfg.ppo_epochs):
        t0 = time.perf_counter()
        while True:
            optimizer.zero_grad(set_to_none=True)
            try:
                ep, epoch_loss, backward_ran = run_epoch()
                break
            except torch.cuda.OutOfMemoryError:
                smaller = smaller_passes(passes) if retry_oom else None
                if smaller is None:  # off, or nothing left to split (single rows, or whole groups)
                    raise
            # Outside the except block the failed attempt's tensors are released: free them, then
            # run the epoch again in micro-batches of at most half the largest one's tokens.
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            oom_retries += 1
            passes = smaller
        for key, value in ep.items():
            totals[key] = totals.get(key, 0.0) + value
        if not backward_ran:
            # No sequence had a share in the gradient: it is zero, as a backward pass would have
            # left it, and the optimizer steps on it as before (Adam's moments still decay).
            for p in params:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        t1 = time.perf_counter()
        clip = torch.nn.utils.clip_grad_norm_ if dist is None else dist.clip_grad_norm
        grad_norm = clip(params, grad_clip if grad_clip > 0 else float("inf"))
        # A NaN/inf loss or gradient must not reach the weights or the Adam moments.
        if torch.isfinite(grad_norm) and math.isfinite(epoch_loss):
            optimizer.step()
        else:
            skipped += 1
            optimizer.zero_grad(set_to_none=True)
        totals["grad_norm"] = float(grad_norm)
        t_fwd_bwd, t_opt = t_fwd_bwd + t1 - t0, t_opt + time.perf_counter() - t1
    n_epochs = cfg.ppo_epochs
    out = {k: (v / n_epochs if k != "grad_norm" else v) for k, v in totals.items()}
    out["skipped_updates"] = float(skipped)
    if er_pass is not None:  # the step's ER/ERV/ERA means (global under DDP) fold into the EMA baselines
        out.update(er_pass.finish(dist))
    if lf_pass is not None:  # RLFR: the flow's online step (gradient summed over ranks under DDP)
        out.update(lf_pass.finish(dist))
    if siren_pass is not None:  # the first step's batch value (global under DDP) sets SIREN's anchor
        out.update(siren_pass.finish(dist))
    if epo_pass is not None:  # the step's batch entropy (global under DDP) joins EPO's history
        out.update(epo_pass.finish(dist))
    if safe_pass is not None:  # the step's KL, entropy and reward (global under DDP) update SAFE's controller
        out.update(safe_pass.finish(dist))
    if inert is not None:  # sequences without a share in the gradient (Â = 0 everywhere, or no loss token)
        out["update/zero_advantage_frac"] = inert.float().mean().item()
    out["micro_batches"] = float(len(passes))  # per pass over the batch (trainer.micro_batch_tokens / _size)
    # The largest micro-batch that took a backward pass: what trainer/gpu_budget.py divides its memory by.
    out["update/max_micro_batch_tokens"] = float(max(
        (mb.computed_tokens(rollout.group_index, share_prefix) for mb, trains, _ in passes if trains), default=0))
    if retry_oom:
        out["update/oom_retries"] = float(oom_retries)
    out["time/forward_backward_s"], out["time/optimizer_s"] = t_fwd_bwd, t_opt
    out.update(alp_metrics(modules))  # ALP's σ_l after the step (empty while off)
    finish_diagnostics(out)
    return out
