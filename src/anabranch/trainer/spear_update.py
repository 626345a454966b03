"""SPEAR's ``replay_step=separate``: the replayed rows' own optimizer step after the on-policy update.

SPEAR (Qin et al. 2025, arXiv 2509.22601; formulas and what is confirmed vs assumed in algorithms/spear.py). In the
authors' released actor the self-imitation loss is a second update: after the on-policy mini-batches, the replayed
rows alone run their own forward/backward passes and optimizer step (same gradient clipping), with the run's policy
loss and ``loss_agg_mode`` over the replayed tokens only, the entropy bonus kept, no KL term, and the whole loss
times the warm-up coefficient c_k. Here that step is :func:`trainer.step.policy_update` called a second time on the
replayed chunk, so the update's machinery is the main one's: micro-batches, normalizers over the (global, under DDP)
replayed tokens, DDP's gradient all-reduce on the last pass, ``Distributed.clip_grad_norm``, the non-finite guard.

Left out of the replay step (they hold batch-level state that the on-policy update already advanced this step, or
are terms the authors' replay loss does not have): the KL to the reference (``kl_coef=0``), extra loss terms, and
the in-update controllers EPO, SAFE, SIREN, ER shaping and RLFR. It is one optimizer step whatever
``algorithm.ppo_epochs`` (the on-policy update's epochs are its own).

c_k > 0 throughout a run (steps start at 1, ``coef > 0`` is required, and rows never replay in the step that sampled
them); the guard that takes no step at c_k = 0 only protects direct calls (under Adam(W) a zero gradient still moves
the weights: the on-policy step's first moment, and weight decay a second time). For small c_k > 0 that momentum step
remains, as in the authors' code (its replay ``_optimizer_step`` runs whatever c_k): early in the warm-up the replay
step is mostly a second, smaller step along the on-policy direction.

Under DDP every rank takes the step when any rank has its ⌈K/W⌉ rows due (trainer/spear_replay.py); a rank with no
row due trains :func:`empty_rows`, one row with no trained token: an exactly zero gradient and nothing in the
global normalizers, so that its passes meet the others' collectives (trainer/inert_rows.py: its forced backward).
"""

from __future__ import annotations

import dataclasses

import torch

from anabranch.algorithms.spear import covariance_keep
from anabranch.trainer.advantage_pass import rollout_forward
from anabranch.trainer.replay import Chunk, mark_rows
from anabranch.trainer.step import policy_update

# policy_update's keys that describe the machinery, not the replay loss: not repeated under spear/replay/.
_SKIP = ("time/", "update/", "micro_batches", "skipped_updates")


def replay_algorithm(algo):
    """``algo`` without its stateful in-update passes and with one epoch (module docstring); the objective and its
    aux losses stay."""
    return dataclasses.replace(algo, cfg=dataclasses.replace(algo.cfg, ppo_epochs=1), er_shaping=None, siren=None,
                               epo=None, safe=None, latent_flow=None)


def empty_rows(step_rows: Chunk) -> Chunk:
    """One row of ``step_rows`` (this step's batch) with no trained token: what a DDP rank with no replayed row due
    trains in the replay step (loss and gradient exactly 0; no token or sequence in the global normalizers)."""
    row = step_rows.take([0])
    ro = row.rollout
    row.rollout = dataclasses.replace(ro, loss_mask=torch.zeros_like(ro.response_mask))
    row.advantages = torch.zeros_like(row.advantages)
    mark_rows(row, None)
    return row


def replay_advantages(sp, chunk: Chunk, adv_row: torch.Tensor, micro_tokens: int) -> tuple[torch.Tensor, float]:
    """[k, T] Â_i on the replayed tokens with Clip-Cov's detached tokens at 0 (π_θ now, after the on-policy update;
    Â unscaled, as the authors' Clip-Cov sees it: c_k scales the loss), and the detached fraction."""
    mask = chunk.rollout.trained_mask.cpu().float()
    adv = adv_row.float()[:, None].expand(-1, mask.shape[1]).clone()
    keep = torch.ones_like(adv)
    s = sp.s
    if s.cov_clip_ratio > 0 and sp.model is not None and mask.any():  # empty_rows: no token to select among
        with torch.no_grad():
            lp, _ = rollout_forward(sp.model, chunk.rollout, sp.micro, sp.temperature, share_prefix=sp.share_prefix,
                                    micro_batch_tokens=micro_tokens)
        keep = covariance_keep(lp.float().cpu(), chunk.precomputed["behaviour_log_prob"].float(), adv, mask,
                               sp.algo_cfg, s.cov_clip_ratio, s.cov_clip_low, s.cov_clip_high)
    frac = float(((1 - keep) * mask).sum()) / max(float(mask.sum()), 1.0)
    return (adv * keep).to(chunk.advantages.dtype), frac


def separate_update(sp, chunk: Chunk, adv_row: torch.Tensor, coef: float, c, dist, cfg, micro_tokens: int = 0,
                    oom_retry: bool = False) -> dict:
    """One optimizer step of c_k·L_SIL on ``chunk`` (the replayed rows, marked with their behaviour log-probs).
    ``c``: model, optimizer, algo, ref_model, modules (trainer/components); ``dist``: the loop's Distributed.
    Returns the spear/replay/... metrics and ``spear/cov_clipped_frac``; {} and no step when c_k = 0 (never in a run:
    c_k > 0 throughout; the guard only protects direct calls)."""
    if coef == 0:  # Adam(W) would still move the weights on a zero gradient (module docstring); c_k is global
        return {}
    adv, frac = replay_advantages(sp, chunk, adv_row, micro_tokens)
    m = policy_update(dist.policy(c.model), c.optimizer, chunk.rollout, adv, chunk.rewards, replay_algorithm(c.algo),
                      micro_batch_size=cfg.trainer.micro_batch_size, grad_clip=cfg.trainer.grad_clip,
                      temperature=cfg.rollout.temperature, max_response_len=cfg.rollout.max_new_tokens,
                      ref_model=c.ref_model, modules=c.modules, kl_coef=0.0, precomputed=dict(chunk.precomputed),
                      dist=dist.active, micro_batch_tokens=micro_tokens,
                      share_prompt_prefix=cfg.trainer.share_prompt_prefix,
                      zero_advantage_rows=cfg.trainer.zero_advantage_rows, oom_retry=oom_retry,
                      rl_loss_scale=coef)  # c_k on the whole replay loss (entropy term included), as released
    out = {f"spear/replay/{k}": v for k, v in m.items() if not k.startswith(_SKIP)}
    out["spear/replay/skipped"] = m.get("skipped_updates", 0.0)
    out["spear/cov_clipped_frac"] = frac
    return out
