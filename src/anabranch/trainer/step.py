"""One policy update on a batch of rollouts: the only place where gradients are taken.

The objective comes from the registry; this function computes exactly the inputs it declared
(`needs`), accumulates gradients over micro-batches with full-batch loss normalizers, adds the
shared KL-to-reference and entropy terms when their coefficients are non-zero, and skips the
optimizer step when the gradient is not finite.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional

import torch

from anabranch.algorithms.aggregation import BatchScale, aggregate, masked_mean
from anabranch.algorithms.kl import kl_penalty
from anabranch.algorithms.resolve import Algorithm
from anabranch.models.logprobs import response_forward
from anabranch.rollout.base import Rollout
from anabranch.rollout.importance import sampler_correction
from anabranch.trainer.microbatch import forward_micro_batch, plan_micro_batches


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


def micro_batches(batch_size: int, micro: int) -> list[slice]:
    return [slice(s, min(s + micro, batch_size)) for s in range(0, batch_size, micro)]


@torch.no_grad()
def no_grad_log_probs(model, rollout: Rollout, micro: int, temperature: float, plan=None) -> torch.Tensor:
    ids, mask, width = rollout.input_ids, rollout.attention_mask, rollout.response_ids.shape[1]
    if plan is None:
        out = [response_forward(model, ids[s], mask[s], width, temperature).log_probs
               for s in micro_batches(ids.shape[0], micro)]
        return torch.cat(out)
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    full = torch.zeros(ids.shape[0], width, device=device)
    for mb in plan:
        full[mb.rows.to(device)] = forward_micro_batch(model, mb, ids, mask, temperature).log_probs
    return full


def policy_update(model, optimizer, rollout: Rollout, advantages: torch.Tensor, rewards: torch.Tensor,
                  algo: Algorithm, *, micro_batch_size: int, grad_clip: float, temperature: float,
                  max_response_len: int, ref_model=None, modules: dict | None = None,
                  params: list | None = None, micro_batch_tokens: int = 0) -> dict[str, float]:
    cfg = algo.cfg
    device = next(model.parameters()).device
    rollout_ids = rollout.input_ids.to(device)
    rollout_mask = rollout.attention_mask.to(device)
    resp_mask = rollout.response_mask.to(device).float()
    advantages = advantages.to(device)
    width = rollout.response_ids.shape[1]
    scale = BatchScale(total_tokens=resp_mask.sum().clamp(min=1.0).item(), total_seqs=float(resp_mask.shape[0]),
                       max_response_len=max_response_len)
    agg = partial(aggregate, mode=cfg.loss_agg_mode, scale=scale)

    plan = plan_micro_batches(rollout.prompt_mask, rollout.response_mask, micro_batch_size, micro_batch_tokens)
    ref_lp = None
    if "ref_log_prob" in algo.needs:
        if ref_model is None:
            raise RuntimeError("this algorithm needs reference log-probs but no reference model was loaded")
        ref_lp = no_grad_log_probs(ref_model, rollout, micro_batch_size, temperature, plan)
    # With one pass over the batch, π_old = π_θ exactly, so that forward pass is skipped.
    old_lp = no_grad_log_probs(model, rollout, micro_batch_size, temperature, plan) if "old_log_prob" in algo.needs else None
    entropy_grad = cfg.entropy_coef != 0 or "entropy" in algo.needs
    if params is None:
        params = [p for g in optimizer.param_groups for p in g["params"]]

    totals: dict[str, float] = {}
    skipped = 0
    for _epoch in range(cfg.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        for mb in plan:  # fixed-size in input order, or packed by token budget (trainer/microbatch.py)
            sl = mb.rows.to(device)
            fo = forward_micro_batch(model, mb, rollout_ids, rollout_mask, temperature,
                                     entropy=True, entropy_grad=entropy_grad, hidden="hidden" in algo.needs)
            m = resp_mask[sl]
            ctx = LossContext(cfg=cfg, aggregate=agg, ref_log_prob=None if ref_lp is None else ref_lp[sl],
                              entropy=fo.entropy, hidden=fo.hidden, rewards=rewards.to(device)[sl],
                              group_index=rollout.group_index[mb.rows].to(device),
                              prompt_mask=rollout.prompt_mask[mb.rows].to(device), modules=modules or {})
            old = fo.log_probs.detach() if old_lp is None else old_lp[sl]
            sample_lp = None if rollout.sample_log_probs is None else rollout.sample_log_probs[mb.rows]
            adv, mismatch = sampler_correction(old, sample_lp, m, advantages[sl], cfg.tis_cap)
            loss, metrics = algo.objective(fo.log_probs, old, adv, m, ctx)
            metrics.update(mismatch)
            if ref_lp is not None and cfg.kl_coef > 0:
                kl = kl_penalty(fo.log_probs, ref_lp[sl], cfg.kl_estimator)
                loss = loss + cfg.kl_coef * agg(kl, m)
                metrics["kl_ref"] = masked_mean(kl.detach(), m).item()
            if cfg.entropy_coef != 0:
                loss = loss - cfg.entropy_coef * agg(fo.entropy, m)
            loss.backward()
            share = m.sum().item() / scale.total_tokens  # weight of this micro-batch in the means
            metrics["loss"] = loss.item()
            metrics["entropy"] = masked_mean(fo.entropy.detach(), m).item()
            for key, value in metrics.items():
                # "loss" already carries the full-batch normalizer: it adds up, others average.
                totals[key] = totals.get(key, 0.0) + (value if key == "loss" else value * share)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
        if torch.isfinite(grad_norm):
            optimizer.step()
        else:
            skipped += 1
            optimizer.zero_grad(set_to_none=True)
        totals["grad_norm"] = float(grad_norm)
    n_epochs = cfg.ppo_epochs
    out = {k: (v / n_epochs if k != "grad_norm" else v) for k, v in totals.items()}
    out["skipped_updates"] = float(skipped)
    return out
