"""STEER: token reweighting by the estimated entropy change of the update.

Hao, Wang, Liu, Luo, Yu, Dong, Lin, Wang, Chen 2025, "Rethinking Entropy Interventions in RLVR: An
Entropy Change Perspective" (arXiv 2510.10150; STEER = Stabilizing Token-level Entropy-changE via
Reweighting). The paper derives a first-order estimate Ω of how much one token's policy-gradient
update changes the policy entropy, governed by four factors (clipping, advantage, token probability,
token entropy), and damps the tokens whose |Ω| is large, so that no few tokens move the entropy by a
lot in one step. Per response token t, with π = π_θ(y_t) (detached), π_old = π_old(y_t) and H_t the
entropy of π_θ(·|context) at t (detached):

    Ω_t = (Â_t / π_old) · π(1 − π) · (log π + H_t)
    λ_t = exp(−k·|Ω_t|),   k = −ln(λ_min) / max(max_t |Ω_t|, Ω_floor)      (steer_mapping=exp)
    L   = agg( λ_t · max(−ρ_t·Â_t, −clip(ρ_t, 1 − ε_low, 1 + ε_high)·Â_t) )  (the PPO clipped loss, dual-clip if on)

The max runs over the micro-batch's response tokens, so the token with the largest |Ω| gets exactly
λ_min and a token with Ω = 0 keeps weight 1 (λ ∈ [λ_min, 1]); while max |Ω| < Ω_floor the scale is
capped and every weight stays above λ_min. λ is a constant (no gradient). ``steer_mapping=linear``
instead maps |Ω| linearly from [min |Ω|, max |Ω|] onto [λ_max, λ_min] (all tokens get (λ_min+λ_max)/2
when the |Ω| are all equal). Because λ > 0 multiplies the whole clipped term, it equals the PPO loss
with advantages λ·Â: the clip decisions are unchanged and the gradient of a token is λ_t times GRPO's.

Keys: ``steer_weight_min`` λ_min (0.8), ``steer_weight_max`` λ_max (1.0, only acts with the linear
mapping), ``steer_mapping`` (exp), ``steer_omega_floor`` Ω_floor (0.02, only acts with exp). The
recipe ``algorithm.name=steer`` sets the authors' run: GRPO advantage, token-mean, clip 0.2 / 0.28,
dual-clip c = 10. Metrics: ``steer/weight_mean``, ``steer/omega_mean`` (token means) and
``steer/weight_min_mb_mean``, ``steer/abs_omega_max_mb_mean``: the trainer averages metrics over micro-batches
and ranks by token share, so these are the share-weighted means of each micro-batch's min λ / max |Ω|, not the
batch's extremes.

What is confirmed and what is assumed:
- Confirmed from the authors' released code (github.com/zz-haooo/STEER, ``compute_token_weights`` and the
  ``entropy_control`` policy loss, read not copied): Ω's form with π and H from the training forward and
  π_old from the rollout's log-probs (both clamped to [1e-8, 1]; non-finite Ω set to 0), |Ω| only (its sign
  is not used), the exp mapping with k from the batch max and the 0.02 floor, the clamp to [λ_min, 1], the
  linear alternative, the weight on the dual-clipped PPO loss, and the run's λ_min = 0.8, λ_max = 1.0, exp.
- Confirmed from the paper's summary: λ = exp(−k|Ω|) keeps the per-step entropy change in a moderate band.
- Not read: the paper's derivation text. A first-order expansion where only the sampled token's logit
  moves gives ΔH_t ≈ −η·(Â_t/π_old)·π²(1 − π)(log π + H_t), one factor π more than the code's Ω; we follow
  the code. Either way ΔH_t has the sign of −Ω_t (a rewarded token more likely than typical, log π > −H,
  lowers the entropy), which STEER does not use.
- The max over tokens is per micro-batch, as in the authors' code (veRL, each micro-batch of 8 sequences
  per GPU sets its own k); under data parallelism each rank's micro-batches set their own k. Like Clip-Cov,
  it is therefore not registered as inert at zero advantage (leaving rows out would change the max).
"""

from __future__ import annotations

import math

import torch

from anabranch.algorithms.aggregation import masked_mean
from anabranch.algorithms.grpo import ppo_surrogate
from anabranch.algorithms.registries import OBJECTIVES, RECIPES
from anabranch.config import AlgorithmConfig

MAPPINGS = ("exp", "linear")


def entropy_change_estimate(log_prob: torch.Tensor, old_log_prob: torch.Tensor, entropy: torch.Tensor,
                            advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Ω_t ([B, T], detached, 0 outside the mask and where it is not finite)."""
    with torch.no_grad():
        p = log_prob.detach().exp().clamp(1e-8, 1.0 - 1e-8)
        p_old = old_log_prob.detach().exp().clamp(1e-8, 1.0)
        omega = advantages.detach() / p_old * p * (1.0 - p) * (p.log() + entropy.detach())
        keep = mask.bool() & torch.isfinite(omega)  # padding may hold anything (nan entropy, junk log-probs)
        return torch.where(keep, omega, torch.zeros_like(omega))


def steer_weights(omega: torch.Tensor, mask: torch.Tensor, weight_min: float, weight_max: float = 1.0,
                  mapping: str = "exp", omega_floor: float = 0.02) -> torch.Tensor:
    """λ_t ([B, T], 0 outside the mask) from |Ω_t| over the masked tokens (see the module docstring)."""
    valid = mask.bool()
    size = omega.abs()
    weights = torch.zeros_like(size)
    if not valid.any():
        return weights
    picked = size[valid]
    top = picked.max()
    if mapping == "exp":
        k = -math.log(weight_min) / torch.clamp(top, min=omega_floor)
        w = torch.exp(-k * picked).clamp(weight_min, 1.0)
    else:
        low = picked.min()
        if top > low:
            w = weight_max - (picked - low) * ((weight_max - weight_min) / (top - low))
        else:
            w = torch.full_like(picked, (weight_min + weight_max) / 2)
        w = w.clamp(weight_min, weight_max)
    weights[valid] = w
    return weights


def check_steer(cfg: AlgorithmConfig) -> str | None:
    """The config error of STEER's keys, or None: their ranges, and each set with the other mapping, where it does
    nothing (resolve.check_ranges). The keys set with another loss are refused by config_checks._GATED."""
    if cfg.loss != "steer":
        return None
    lo, hi = cfg.steer_weight_min, cfg.steer_weight_max
    if cfg.steer_mapping not in MAPPINGS:
        return f"algorithm.steer_mapping must be one of {MAPPINGS} (got {cfg.steer_mapping!r})"
    if cfg.steer_mapping == "exp":
        if not 0 < lo <= 1:  # ln(λ_min) must exist; λ_min = 1 is plain GRPO
            return f"algorithm.steer_weight_min must be in (0, 1] with steer_mapping=exp, the weight of the token with the largest |Ω| (got {lo!r})"
        if hi != AlgorithmConfig.steer_weight_max:
            return (f"algorithm.steer_weight_max={hi!r} has no effect with steer_mapping=exp (its weights are at most 1); "
                    "set algorithm.steer_mapping=linear or leave steer_weight_max at 1.0")
        if not (cfg.steer_omega_floor > 0 and math.isfinite(cfg.steer_omega_floor)):
            return f"algorithm.steer_omega_floor must be positive and finite (got {cfg.steer_omega_floor!r})"
        return None
    if not (0 <= lo <= hi and math.isfinite(hi) and hi > 0):
        return f"algorithm.steer_weight_min/steer_weight_max must satisfy 0 <= min <= max, max > 0 and finite (got {lo!r}, {hi!r})"
    if cfg.steer_omega_floor != AlgorithmConfig.steer_omega_floor:
        return (f"algorithm.steer_omega_floor={cfg.steer_omega_floor!r} has no effect with steer_mapping=linear (its "
                "scale is the batch's min and max |Ω|); set algorithm.steer_mapping=exp or leave it at 0.02")
    return None


@OBJECTIVES.register("steer", needs=())  # the update's forward always returns the entropies (ctx.entropy)
def steer_loss(log_prob, old_log_prob, advantages, response_mask, ctx):
    cfg = ctx.cfg
    if ctx.entropy is None:
        raise RuntimeError("loss=steer needs the token entropies of the update's forward (ctx.entropy)")
    loss_mat, was_clipped, log_ratio = ppo_surrogate(log_prob, old_log_prob, advantages, cfg)
    omega = entropy_change_estimate(log_prob, old_log_prob, ctx.entropy, advantages, response_mask)
    weights = steer_weights(omega, response_mask, cfg.steer_weight_min, cfg.steer_weight_max, cfg.steer_mapping,
                            cfg.steer_omega_floor)
    loss = ctx.aggregate(loss_mat * weights, response_mask)
    with torch.no_grad():
        valid = response_mask.bool()
        w = weights[valid]
        # The trainer averages each metric over the micro-batches (and ranks) by their token share, which gives the
        # batch's token mean for a mean; a micro-batch's min / max becomes the share-weighted mean of those extremes
        # (each micro-batch's own k is set by its own max, so that is the quantity STEER acts on), named _mb_mean.
        metrics = {"clip_frac": masked_mean(was_clipped.float(), response_mask).item(),
                   "approx_kl": masked_mean(-log_ratio, response_mask).item(),
                   "steer/weight_mean": w.mean().item() if w.numel() else 1.0,
                   "steer/weight_min_mb_mean": w.min().item() if w.numel() else 1.0,
                   "steer/abs_omega_max_mb_mean": omega.abs().max().item(),
                   # mean Ω over the tokens: > 0 says the step's estimated entropy change is a decrease
                   "steer/omega_mean": masked_mean(omega, response_mask).item()}
    return loss, metrics


RECIPES.register("steer")({"advantage": "grpo", "loss": "steer", "loss_agg_mode": "token-mean",
                           "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 10.0})
