"""f-DPG: distribution matching by minimizing an f-divergence to the target, beside FlowRL.

Go, Korbak, Kruszewski, Rozen, Ryu, Dymetman 2023, "Aligning Language Models with Preferences
through f-divergence Minimization" (ICML 2023, arXiv 2302.08215). The target is FlowRL's

    p(y|x) = a(y)/Z(x),   a(y) = π_ref(y|x) · exp(β · r̂(x,y))

and the policy minimizes D_f(π_θ || p) = E_{y~p}[ f(π_θ(y)/p(y)) ] (the paper's convention: the
ratio is t = π_θ/p and the expectation is under p). Its gradient (the paper's Theorem 1) is a policy
gradient under the policy's own samples, with a *pseudo-reward* R_θ = −f′(t) that f′ is not
differentiated through:

    ∇_θ D_f(π_θ || p) = E_{y~π_θ}[ f′(π_θ(y)/p(y)) · ∇_θ log π_θ(y) ]

On the samples y_1..y_n of a prompt, drawn from q = π_old (the policy that sampled the batch):

    log Ẑ(x)  = logsumexp_j( log a(y_j) − log q(y_j) ) − log n        (importance sampling)
    log t_i   = log π_θ(y_i) − log a(y_i) + log Ẑ(x)                   (detached)
    R_i       = −f′(t_i),   w_i = min(π_θ(y_i)/q(y_i), is_max)         (both detached)
    b(x)      = Σ_j w_j R_j / Σ_j w_j                                   (group baseline)
    L         = −(1/B) Σ_i w_i · (R_i − b(x)) · log π_θ(y_i)

``algorithm.fdpg.divergence`` picks f (the four the paper compares; f′ as in the authors' library
naver/disco):

    rkl  f(t) = t log t           KL(π_θ || p)     R = −log t − 1
    kl   f(t) = −log t            KL(p || π_θ)     R = 1/t = p/π_θ   (DPG)
    js   f(t) = t log(2t/(1+t)) + log(2/(1+t))   R = log((1+t)/(2t)) = softplus(−log t) − log 2
    tv   f(t) = ½|t − 1|          total variation  R = −½ sign(t − 1)

(js is 2 × the ½-weighted Jensen–Shannon divergence: a constant factor on the gradient.)

- Reverse KL is KL-regularized RL: R_i = β·r̂_i − (log π_θ(y_i) − log π_ref(y_i)) − log Ẑ − 1, and
  log Ẑ + 1 is the same for every sample of a prompt, so with the group baseline the gradient is
  exactly that of E[β·r̂] − KL(π_θ || π_ref) with a group-mean baseline (tested).
- Sequence level, as in the paper: log π_θ, log π_ref and log q are sums over the response tokens
  (not length-normalized, unlike FlowRL's default), so they reach −hundreds. Everything is kept in
  log space (logsumexp for Ẑ, softplus for js) and computed in float64, with |log t| and |log w|
  capped at 600 only so that their exp stays a finite float64. With the self-normalized Ẑ,
  w_i·R_i = p(y_i)/q(y_i) = n·softmax_i(log a − log q) ≤ n for kl, although R_i alone can be e^500
  for a sample the policy has left; js and tv are bounded; rkl is linear in the log-probabilities
  (as large as the KL-regularized reward). The per-sequence coefficient w·(R − b) is formed in
  float64 before it meets the float32 graph. No pseudo-reward clipping (the paper has none).
- r̂ and the groups are FlowRL's: r̂ is GRPO's group-normalized reward (``advantage=grpo``) read back
  as the per-sequence mean of the ``advantages``; groups are ``ctx.group_index``. Ẑ and the baseline
  are group statistics, so the trainer never splits a group across micro-batches (``whole_groups``).
  Sequences with no response token in the loss (overlong filter) stay out of both.
- ``algorithm.fdpg.baseline``: ``group`` (default) b(x) = the self-normalized importance-weighted
  mean of R over the prompt's samples, an estimate of E_{π_θ}[R]; on-policy (w = 1) the plain group
  mean. The paper subtracts a baseline without fixing it; the authors' library uses a moving average
  of R over the last 1024 samples, for which the per-prompt mean stands in here (one target per
  prompt). It includes the sample itself (as GRPO's mean): on-policy, (n − 1)/n times the
  leave-one-out baseline's gradient. ``none``: b = 0.
- w: the paper's importance ratio π_θ/q for off-policy samples; with ``ppo_epochs=1`` it is 1. The
  cap ``is_max`` (as FlowRL's ``clamp_max``) is an addition for later epochs; 0 leaves it raw.
- ``algorithm.kl_coef > 0`` is refused: π_ref is already in the target (reverse KL is already the
  KL-regularized objective with coefficient 1/β), so a KL penalty in the reward would count it again
  inside r̂ (as for FlowRL) and one in the loss would change the target to another power of π_ref.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from anabranch.algorithms.aggregation import group_logsumexp
from anabranch.algorithms.flowrl import group_mean
from anabranch.algorithms.registries import OBJECTIVES, RECIPES
from anabranch.config import AlgorithmConfig, ConfigError

BASELINES = ("group", "none")
# |log t| and |log w| are capped here so that exp of either is a finite float64 (e^709 is the largest).
LOG_CAP = 600.0


def _f_prime_rkl(log_t):
    return log_t + 1.0


def _f_prime_kl(log_t):
    return -torch.exp(-log_t)


def _f_prime_js(log_t):
    return math.log(2.0) - F.softplus(-log_t)


def _f_prime_tv(log_t):
    return 0.5 * torch.sign(log_t)


def _f_over_t_rkl(log_t):
    return log_t


def _f_over_t_kl(log_t):
    return -log_t * torch.exp(-log_t)


def _f_over_t_js(log_t):
    # f(t)/t = log(2t/(1+t)) + log(2/(1+t))/t, each log as a softplus so a huge |log t| stays finite.
    return (math.log(2.0) - F.softplus(-log_t)) + torch.exp(-log_t) * (math.log(2.0) - F.softplus(log_t))


def _f_over_t_tv(log_t):
    return 0.5 * (1.0 - torch.exp(-log_t)).abs()


# name -> (f′(t), f(t)/t), both as functions of log t. E_{π_θ}[f(t)/t] = D_f(π_θ || p) is logged.
DIVERGENCES = {
    "rkl": (_f_prime_rkl, _f_over_t_rkl),
    "kl": (_f_prime_kl, _f_over_t_kl),
    "js": (_f_prime_js, _f_over_t_js),
    "tv": (_f_prime_tv, _f_over_t_tv),
}


def fdpg_needs(cfg: AlgorithmConfig) -> tuple[str, ...]:
    """The inputs f-DPG reads (its options are checked here, at config resolution)."""
    f = cfg.fdpg
    if f.divergence not in DIVERGENCES:
        raise ConfigError(f"algorithm.fdpg.divergence {f.divergence!r} is not one of {', '.join(DIVERGENCES)}")
    if f.baseline not in BASELINES:
        raise ConfigError(f"algorithm.fdpg.baseline {f.baseline!r} is not one of {', '.join(BASELINES)}")
    if not (f.beta > 0 and math.isfinite(f.beta)):  # β·r̂ is the target's reward term
        raise ConfigError(f"algorithm.fdpg.beta must be positive and finite (got {f.beta})")
    if f.is_max < 0:
        raise ConfigError(f"algorithm.fdpg.is_max must be >= 0 (0: uncapped importance weights; got {f.is_max})")
    if cfg.kl_coef > 0:
        where = ("in the reward it would be subtracted from r before r̂ is formed, counting π_ref a second time "
                 "inside r̂ (scaled by β/std of each group)" if cfg.kl_in == "reward" else
                 "in the loss it would add kl_coef·∇KL(π_θ||π_ref) to the f-divergence gradient, so the policy "
                 "would no longer move toward π_ref·exp(β·r̂)/Z")
        raise ConfigError(
            f"algorithm.kl_coef={cfg.kl_coef} (kl_in={cfg.kl_in!r}) is not supported for loss='fdpg': its target "
            f"π_ref·exp(β·r̂)/Z already contains the reference model; {where}. Set algorithm.kl_coef=0 and "
            "choose the strength of the prior with algorithm.fdpg.beta")
    return ("ref_log_prob", "whole_groups")


def group_log_z(log_w: torch.Tensor, group_index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each sample's log Ẑ = log mean_j exp(log_w_j) over its group's valid samples (log space)."""
    _, inverse = torch.unique(group_index, return_inverse=True)
    counts = torch.zeros(int(inverse.max()) + 1 if inverse.numel() else 0, dtype=log_w.dtype,
                         device=log_w.device).index_add(0, inverse, valid.to(log_w.dtype))
    return group_logsumexp(log_w, group_index, valid) - torch.log(counts.clamp(min=1.0))[inverse]


def pseudo_rewards(log_pi, log_q, log_ref, r_hat, group_index, valid, divergence: str, beta: float):
    """(R, log t, log Ẑ) per sequence, from whole-sequence log-probs (float64, detached)."""
    log_pi, log_q, log_ref, r_hat = (x.detach().double() for x in (log_pi, log_q, log_ref, r_hat))
    log_a = log_ref + beta * r_hat
    log_z = group_log_z(log_a - log_q, group_index, valid)
    log_t = (log_pi - log_a + log_z).clamp(-LOG_CAP, LOG_CAP)  # exp(±LOG_CAP) is still a float64
    f_prime, _ = DIVERGENCES[divergence]
    return -f_prime(log_t), log_t, log_z


@OBJECTIVES.register("fdpg", needs=fdpg_needs, advantage_is_reward=True)
def fdpg_loss(log_prob, old_log_prob, advantages, response_mask, ctx):
    f = ctx.cfg.fdpg
    if ctx.ref_log_prob is None:
        raise RuntimeError("loss=fdpg needs reference log-probs but none were computed")
    m = response_mask.to(log_prob.dtype)
    length = m.sum(-1)
    valid = length > 0
    r_hat = (advantages * m).sum(-1) / length.clamp(min=1.0)  # the recipe's advantage is r̂ on every token
    log_pi = (log_prob * m).sum(-1)  # whole-sequence log-probs, as in the paper
    log_q = (old_log_prob.detach() * m).sum(-1)
    log_ref = (ctx.ref_log_prob * m).sum(-1)

    reward, log_t, log_z = pseudo_rewards(log_pi, log_q, log_ref, r_hat, ctx.group_index, valid, f.divergence, f.beta)
    # In float64, with the log-ratio only kept off exp's overflow: w·R stays finite even where R alone
    # is huge (kl's R = p/π_θ for a sample the policy has left: w·R = p/q is at most n).
    raw_w = torch.exp((log_pi.detach().double() - log_q.double()).clamp(-LOG_CAP, LOG_CAP))
    w = raw_w.clamp(max=f.is_max) if f.is_max > 0 else raw_w
    if f.baseline == "group":
        # E_{π_θ}[R] of the prompt, self-normalized over q's samples: the plain group mean on-policy (w = 1).
        weight = group_mean(w, ctx.group_index, valid).clamp(min=1e-300)
        baseline = group_mean(w * reward, ctx.group_index, valid) / weight
    else:
        baseline = torch.zeros_like(reward)
    adv = reward - baseline
    coef = torch.where(valid, w * adv, torch.zeros_like(adv)).to(log_prob.dtype)
    per_seq = -coef * log_pi
    # Sequence mean over the whole step batch, whatever loss_agg_mode says (the paper's mean over samples).
    loss = ctx.aggregate(per_seq[:, None].expand_as(m), m, mode="seq-mean-token-mean")
    with torch.no_grad():
        keep = valid if bool(valid.any()) else torch.ones_like(valid)
        _, f_over_t = DIVERGENCES[f.divergence]
        metrics = {
            # E_{π_θ}[R], self-normalized over q's samples (R alone can be e^500 off-policy, w·R cannot).
            "fdpg/pseudo_reward_mean": ((w * reward)[keep].sum() / w[keep].sum().clamp(min=1e-300)).item(),
            "fdpg/advantage_absmean": coef[keep].abs().mean().item(),  # |w·(R − b)|
            "fdpg/advantage_absmax": coef[keep].abs().max().item(),
            "fdpg/log_z_mean": log_z[keep].mean().item(),
            "fdpg/log_ratio_mean": log_t[keep].mean().item(),  # log π_θ/p: a reverse-KL estimate
            "fdpg/divergence": f_over_t(log_t[keep]).mean().item(),  # D_f(π_θ || p), self-normalized
            "fdpg/is_weight_mean": w[keep].mean().item(),
            "fdpg/is_clip_frac": (w != raw_w)[keep].float().mean().item(),
            "fdpg/log_prob_mean": log_pi.detach()[keep].mean().item(),
        }
    return loss, metrics


# r̂ is GRPO's group-normalized reward (FlowRL's); the loss is a sequence mean (recorded for the config dump).
RECIPES.register("fdpg")({"advantage": "grpo", "loss": "fdpg", "loss_agg_mode": "seq-mean-token-mean"})
