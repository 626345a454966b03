"""Rollout/trainer log-prob mismatch and truncated importance sampling (TIS).

A fast inference engine samples from π_sampler, which differs slightly from the trainer's π_θ
(other kernels, precision, batch order). Per response token the mismatch is measured as

    Δ_t = log π_sampler(y_t) − log π_θ(y_t)
    mismatch/kl       = mean_t Δ_t                    (k1 estimate of KL(π_sampler ‖ π_θ))
    mismatch/abs_mean = mean_t |Δ_t|

over the tokens of ``mask`` only (the response tokens the loss covers, EOS included), and optionally
corrected with the truncated importance weight of Yao et al. (2025), "Your Efficient
RL Framework Secretly Brings You Off-Policy RL Training":

    w_t = min(π_θ_old(y_t) / π_sampler(y_t), C)

which multiplies each token's policy-gradient term. For the objectives here, whose per-token loss
is linear in the advantage with a non-negative factor (PG, PPO-clip), scaling the advantage by the
detached ``w_t`` is the same as scaling the token's loss, so the correction is applied that way.

π_sampler is the distribution the engine drew from (vLLM's ``processed_logprobs``: after the
temperature, top-k / top-p renormalization and the min-tokens EOS mask), π_θ the trainer's at the
same temperature without those filters. With the defaults (top_k=0, top_p=1, min_new_tokens=0)
they are the same policy and Δ is numerical noise; with top-k / top-p, Δ_t = −log(kept mass) ≥ 0 is
added on every token (tests/test_rollout_vllm_contract.py), so ``mismatch/kl`` grows and TIS weights
fall below 1 by that much.
"""

from __future__ import annotations

import torch


def mismatch_metrics(trainer_lp: torch.Tensor, sampler_lp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    m = mask.bool()
    if not m.any():
        return {}
    delta = (sampler_lp - trainer_lp.detach())[m]
    return {"mismatch/kl": delta.mean().item(), "mismatch/abs_mean": delta.abs().mean().item()}


def tis_weights(old_lp: torch.Tensor, sampler_lp: torch.Tensor, cap: float) -> torch.Tensor:
    """``min(exp(old − sampler), cap)``, detached."""
    return torch.exp(old_lp.detach() - sampler_lp).clamp(max=cap)


def sampler_correction(old_lp: torch.Tensor, sampler_lp: torch.Tensor | None, mask: torch.Tensor,
                       advantages: torch.Tensor, cap: float,
                       stale_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Mismatch metrics, and the advantages scaled by TIS weights when ``cap > 0``.

    ``stale_rows`` ([B] bool, optional): rows sampled at an earlier step (RoRecomp's replayed rows,
    trainer/rorecomp.py). They are left out of the metrics and keep weight 1: what is measured and
    corrected here is the engine-vs-trainer mismatch of this step's own samples."""
    if sampler_lp is None:
        return advantages, {}
    sampler_lp = sampler_lp.to(old_lp.device)
    fresh = None if stale_rows is None else ~stale_rows.to(old_lp.device).bool()[:, None]
    if fresh is not None:
        mask = mask * fresh
    metrics = mismatch_metrics(old_lp, sampler_lp, mask)
    if cap > 0:
        w = tis_weights(old_lp, sampler_lp, cap)
        if fresh is not None:
            w = torch.where(fresh, w, torch.ones_like(w))
        m = mask.bool()
        if m.any():
            metrics["mismatch/tis_weight_mean"] = w[m].mean().item()
            metrics["mismatch/tis_clipped_frac"] = (w[m] >= cap).float().mean().item()
        advantages = advantages * w
    return advantages, metrics
