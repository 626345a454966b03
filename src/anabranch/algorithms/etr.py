"""ETR: the PPO clipped surrogate with a per-sample clip range set by |Â| and by the group's reward variance.

Zhang, Zhang, Gu, Guo, Guo, Liu, Jiang, Wang 2026, "ETR: Outcome-Guided Elastic Trust Regions for
Policy Optimization" (arXiv 2601.03723). GRPO clips every sample's ratio to the same [1 − ε_low,
1 + ε_high]; ETR makes the trust region "elastic" at two levels:

- micro level: the clip bounds grow with the advantage magnitude, so a high-confidence signal
  (large |Â|) may move the policy further in one update;
- macro level: the group's reward variance sets the update budget, so prompts in the "optimal
  learning zone" (success rate near 1/2, the largest variance of a 0/1 reward) get a wider region
  than almost-solved or almost-hopeless ones.

Formula used here, per token t of sample i in group g (ρ = π_θ/π_old, as ``ppo_clip``):

    v_g        = 4·σ_g²                  σ_g² the population variance of the group's rewards
                                          (4p(1−p) ∈ [0, 1] for 0/1 rewards with success rate p)
    s_{i,t}    = (1 + α·|Â_{i,t}|)·(1 + β·v_g)
    ε^hi_{i,t} = ε_high·s_{i,t},   ε^lo_{i,t} = min(ε_low·s_{i,t}, 1)
    L_t        = −min(ρ_t·Â_t, clip(ρ_t, 1 − ε^lo_{i,t}, 1 + ε^hi_{i,t})·Â_t)

α = ``algorithm.etr_adv_coef``, β = ``algorithm.etr_var_coef``; α = β = 0 gives ``ppo_clip``
exactly. ε^lo is capped at 1 so the ratio's floor never goes below 0.

What is assumed (the paper's method section could not be read; its abstract and summaries were):
the abstract fixes the two mechanisms (bounds "scaled based on advantage magnitude"; "group
variance ... allocate larger update budgets to tasks in the optimal learning zone"), not their
functional form. The linear scale 1 + α·|Â|, the multiplicative combination with 1 + β·v_g, the
normalization of the variance to v_g = 4σ_g² (1 at p = 1/2), scaling both bounds alike, and the
defaults α = 0.2, β = 0.5 are this library's choices, not the paper's.

Why the objective needs whole groups and is not "inert at zero advantage": v_g is computed from
``ctx.rewards`` over each group's samples in the micro-batch, so no micro-batch may hold part of a
group (``whole_groups``), and a row with Â = 0 (a reward equal to its group's mean) must still be
present for its group's variance to be right. With β = 0 neither is needed.

With ``ppo_epochs = 1`` the whole batch is one optimizer step, every ratio is exactly 1 and no clip
range can act (ETR would be GRPO): the recipe sets ``ppo_epochs = 2`` and resolution refuses 1.
"""

from __future__ import annotations

import math

import torch

from anabranch.algorithms.aggregation import masked_mean
from anabranch.algorithms.registries import OBJECTIVES, RECIPES

NAME = "etr"
_DEFAULTS = {"etr_adv_coef": 0.2, "etr_var_coef": 0.5}


def check_etr(cfg) -> str | None:
    """``algorithm.etr_adv_coef`` / ``etr_var_coef``: finite and >= 0, changed only with loss=etr, and
    loss=etr only with more than one pass over the batch (else the clip never acts)."""
    for key in _DEFAULTS:
        value = getattr(cfg, key)
        if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
            return f"algorithm.{key} must be a finite number >= 0 (0 turns that part of ETR's scaling off; got {value!r})"
        # Set while loss != etr: config_checks._GATED (run first by resolve.check_algorithm).
    if cfg.loss == NAME and cfg.clip_ratio_c > 0:
        return (f"algorithm.clip_ratio_c={cfg.clip_ratio_c} (dual-clip) is not part of loss={NAME}; leave it at 0 "
                "(ETR's elastic bounds replace the fixed clip range)")
    if cfg.loss == NAME and cfg.ppo_epochs < 2:
        return (f"algorithm.loss={NAME} with algorithm.ppo_epochs={cfg.ppo_epochs}: with one pass over the batch every "
                "ratio π_θ/π_old is 1 and no clip range acts, so ETR would be plain GRPO; set algorithm.ppo_epochs >= 2 "
                "(the etr recipe uses 2)")
    return None


def etr_needs(cfg) -> tuple[str, ...]:
    # The group variance is read over each group's rows of the micro-batch (module docstring).
    return ("whole_groups",) if cfg.etr_var_coef > 0 else ()


def group_variance(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Each sample's population variance of its group's rewards (0 for a group of one)."""
    rewards = rewards.to(torch.float32)
    _, inverse = torch.unique(group_index, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    zeros = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device)
    n = zeros.index_add(0, inverse, torch.ones_like(rewards))
    mean = zeros.index_add(0, inverse, rewards) / n
    var = zeros.index_add(0, inverse, (rewards - mean[inverse]) ** 2) / n
    return var[inverse]


def elastic_scale(advantages: torch.Tensor, variance: torch.Tensor | None, alpha: float, beta: float) -> torch.Tensor:
    """s_{i,t} = (1 + α·|Â_{i,t}|)·(1 + β·4σ_g²) for ``advantages[B,T]`` and per-sample ``variance[B]``."""
    scale = 1.0 + alpha * advantages.detach().abs()
    if beta > 0:
        scale = scale * (1.0 + beta * 4.0 * variance.to(scale.dtype))[:, None]
    return scale


@OBJECTIVES.register(NAME, needs=etr_needs)
def etr_loss(log_prob, old_log_prob, advantages, response_mask, ctx):
    cfg = ctx.cfg
    variance = None
    if cfg.etr_var_coef > 0:
        if ctx.rewards is None or ctx.group_index is None:
            raise RuntimeError("loss=etr with etr_var_coef > 0 needs each sample's reward and group, but none were given")
        variance = group_variance(ctx.rewards, ctx.group_index)
    scale = elastic_scale(advantages, variance, cfg.etr_adv_coef, cfg.etr_var_coef)
    eps_high = cfg.clip_ratio_high * scale
    eps_low = (cfg.clip_ratio_low * scale).clamp(max=1.0)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.minimum(torch.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
    loss_mat = torch.maximum(unclipped, clipped)
    loss = ctx.aggregate(loss_mat, response_mask)
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((clipped > unclipped).float(), response_mask).item(),
            "approx_kl": masked_mean(-log_ratio, response_mask).item(),
            # How far the elastic regions stretch GRPO's: the mean scale and the widest upper bound.
            "etr/scale_mean": masked_mean(scale, response_mask).item(),
            "etr/eps_high_max": (eps_high * response_mask).max().item() if response_mask.numel() else 0.0,
        }
        if variance is not None:
            metrics["etr/group_var_mean"] = variance.mean().item() if variance.numel() else 0.0
    return loss, metrics


# The clip only acts from the second pass over a batch (module docstring), hence ppo_epochs = 2.
RECIPES.register(NAME)({"advantage": "grpo", "loss": NAME, "loss_agg_mode": "token-mean", "ppo_epochs": 2})
