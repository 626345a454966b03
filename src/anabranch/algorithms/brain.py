"""BRAIn: distil the reward-conditioned posterior with a self-normalized baseline.

Pandey, Nandwani, Naseem, Mishra, Xu, Raghu, Joshi, Munawar, Fernandez Astudillo 2024, "BRAIn:
Bayesian Reward-conditioned Amortized Inference for natural language generation from feedback"
(ICML 2024, arXiv 2402.02479). The prior is the reference (SFT) model and the target is its
posterior given that the output is good (G = 1), by Bayes' rule:

    p(y|x, G=1) ∝ π_ref(y|x) · p(G=1|x,y),   p(G=1|x,y) ∝ exp(r(x,y)/β)

(for a Bradley–Terry reward this posterior is the KL-regularized / PPO-optimal policy
π_ref·exp(r/β)/Z, which the paper generalizes). π_θ is trained toward it from n samples y_1..y_n of a
prompt drawn from a proposal q (here the policy that sampled the batch, π_old). Per group:

    α_i = softmax_i( log π_ref(y_i) + r_i/β − log q(y_i) )     self-normalized posterior weights (detached)
    γ_i = softmax_i( log π_θ(y_i) − log q(y_i) )               π_θ's own self-normalized weights
    L_x = −Σ_i α_i · log γ_i                                     (cross-entropy of γ against α)
    ∇L_x = −Σ_i (α_i − γ_i) · ∇ log π_θ(y_i)                     (Σα = 1: the −Σγ∇log π term is the baseline)

The gradient is BRAIn's: the DPG/importance-sampled posterior term α_i∇log π_θ(y_i) minus the
self-normalized baseline γ_i∇log π_θ(y_i), which the paper introduces to cut the variance and which
makes the objective contrastive: with n = 2 and α put on the better sample (argmax instead of
softmax), L_x = −log σ((log π_θ − log q)(y_w) − (log π_θ − log q)(y_l)), DPO with q = π_sft as its
reference (the paper's "DPO-sft" special case). L_x's value minus the entropy of α is the
self-normalized KL Σ α log(α/γ) on the samples, 0 iff γ = α (logged as ``brain/self_norm_kl``).

- Sequence level, as in the paper: log π_θ, log π_ref and log q are sums over the response tokens.
  The softmaxes run in float64 in log space, so sequence log-probs of −hundreds are harmless.
- r is read back from the recipe's advantage (``advantage=grpo``, ``norm_adv_by_std=false``: r minus
  its group mean on every token). A per-prompt shift cancels inside the softmax, so α is exactly the
  posterior with the raw reward; ``norm_adv_by_std=true`` instead tilts by (r − mean_g)/(std_g·β).
- ``algorithm.brain_beta`` = β, the temperature of the reward likelihood (the KL coefficient of the
  PPO problem whose optimum the posterior is); the default 0.1 is an assumption (not from the paper).
- q = π_old: with ``ppo_epochs=1`` it is π_θ before the step (γ = 1/n in value, its gradient still the
  baseline); later epochs are off-policy, which BRAIn's self-normalized weights are built for (the paper
  samples from the SFT model), so no importance cap is needed.
- The loss per group is a group statistic: the trainer keeps each group in one micro-batch
  (``whole_groups``). Each sequence carries −n_g·α_i·log γ_i and the step's sequence mean then is the
  mean over prompts of L_x (weighted by group size when sizes differ). Sequences with no response token
  in the loss (overlong filter) get α = γ = 0 and stay out of both softmaxes.
- ``algorithm.kl_coef > 0`` is refused (π_ref is already the prior of the target); other advantage
  estimators are refused (α needs r up to a per-prompt shift); rollout.n >= 2 is required by grpo's
  group registration (trainer/components.py). ``rollout.extra_rollouts=cure`` is refused at load
  (``trainer.cure_rollouts.check_config``, as for FlowRL and f-DPG): its branch rows are an original's prefix plus a re-sampled rest, not draws from
  q = π_old(y|x), so the self-normalized α would weight them wrongly. DARS's extra samples are plain draws
  from q for their prompt and are accepted (the group is just larger).
- Added terms, accepted as the user's choice: ``entropy_coef``, ``siren_coef`` and KDRL
  (``algorithm.kdrl.teacher``) add their own gradient to the loss, so training no longer stops at the
  posterior but at the optimum of L_x plus that regularizer (α itself is unchanged). DSDR's coefficients
  are refused for every reward-reading loss (resolve.py).
- Dynamic sampling (``algorithm.dynamic_sampling``) is accepted and changes the prompt distribution: an
  all-equal group has α = softmax(log π_ref − log q), whose gradient pulls π_θ toward π_ref on that
  prompt (0 only while π_θ = π_old = π_ref). DAPO drops such groups, so the posterior is fitted on the
  prompts with mixed rewards only and the prior's pull on solved/unsolved prompts is lost (a data choice
  like task.curation, not a biased estimator on the prompts kept).
- Metrics: the per-prompt ones (self_norm_kl, cross_entropy, alpha_ess, alpha_max) are means over the
  micro-batch's live groups, those with at least one row in the loss.
"""

from __future__ import annotations

import math

import torch

from anabranch.algorithms.aggregation import group_logsumexp
from anabranch.algorithms.registries import OBJECTIVES, RECIPES
from anabranch.config import AlgorithmConfig, ConfigError


def check_brain(cfg: AlgorithmConfig) -> str | None:
    """brain_beta's range (resolve.check_ranges); config_checks._GATED refuses it with another loss."""
    if not (cfg.brain_beta > 0 and math.isfinite(cfg.brain_beta)):
        return f"algorithm.brain_beta must be positive and finite, the temperature of exp(r/β) (got {cfg.brain_beta!r})"
    return None


def brain_needs(cfg: AlgorithmConfig) -> tuple[str, ...]:
    """The inputs BRAIn reads; refuses what would change its target (checked at config resolution)."""
    if cfg.advantage != "grpo":
        raise ConfigError(f"algorithm.advantage={cfg.advantage!r} is not supported for loss='brain': BRAIn reads the "
                          "reward back from the advantage and needs it up to a per-prompt shift (advantage=grpo with "
                          "algorithm.norm_adv_by_std=false, as algorithm.name=brain sets)")
    if cfg.kl_coef > 0:
        raise ConfigError(
            f"algorithm.kl_coef={cfg.kl_coef} (kl_in={cfg.kl_in!r}) is not supported for loss='brain': its target "
            "π_ref·exp(r/β)/Z already has the reference model as its prior, so a KL penalty would count π_ref a "
            "second time; set algorithm.kl_coef=0 and choose the strength of the prior with algorithm.brain_beta")
    return ("ref_log_prob", "whole_groups")


def group_log_softmax(x: torch.Tensor, group_index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """log softmax of ``x`` within each group over its ``valid`` entries (differentiable; 0 elsewhere)."""
    return torch.where(valid, x - group_logsumexp(x, group_index, valid), torch.zeros_like(x))


def brain_weights(log_pi, log_q, log_ref, reward, group_index, valid, beta: float):
    """(α, log γ): the detached posterior weights and π_θ's self-normalized log-weights (float64)."""
    log_q = log_q.detach().double()
    log_alpha = group_log_softmax(log_ref.detach().double() + reward.detach().double() / beta - log_q,
                                  group_index, valid)
    alpha = torch.where(valid, torch.exp(log_alpha), torch.zeros_like(log_alpha))
    log_gamma = group_log_softmax(log_pi.double() - log_q, group_index, valid)
    return alpha, log_gamma


@OBJECTIVES.register("brain", needs=brain_needs, advantage_is_reward=True)
def brain_loss(log_prob, old_log_prob, advantages, response_mask, ctx):
    if ctx.ref_log_prob is None:
        raise RuntimeError("loss=brain needs reference log-probs but none were computed")
    m = response_mask.to(log_prob.dtype)
    length = m.sum(-1)
    valid = length > 0
    reward = (advantages * m).sum(-1) / length.clamp(min=1.0)  # the recipe's advantage is r − mean_g on every token
    log_pi = (log_prob * m).sum(-1)  # whole-sequence log-probs, as in the paper
    log_q = (old_log_prob.detach() * m).sum(-1)
    log_ref = (ctx.ref_log_prob * m).sum(-1)
    alpha, log_gamma = brain_weights(log_pi, log_q, log_ref, reward, ctx.group_index, valid, ctx.cfg.brain_beta)

    _, inverse = torch.unique(ctx.group_index, return_inverse=True)
    size = torch.zeros(int(inverse.max()) + 1, dtype=alpha.dtype, device=alpha.device)
    size = size.index_add(0, inverse, valid.to(alpha.dtype))[inverse]
    # n_g·α_i·log γ_i: the step's sequence mean (over n_g samples per prompt) is then the mean over prompts of L_x.
    per_seq = -(size * alpha * log_gamma).to(log_prob.dtype)
    loss = ctx.aggregate(per_seq[:, None].expand_as(m), m, mode="seq-mean-token-mean")
    with torch.no_grad():
        gamma = torch.exp(log_gamma) * valid
        keep = valid if bool(valid.any()) else torch.ones_like(valid)
        ent_alpha = -torch.where(alpha > 0, alpha * torch.log(alpha.clamp(min=1e-300)), torch.zeros_like(alpha))
        n_groups = max(int(inverse.max()) + 1, 1)

        def per_group(v):  # the sum over each group's rows
            return torch.zeros(n_groups, dtype=v.dtype, device=v.device).index_add(0, inverse, v)

        # Live groups only: a group whose rows all left the loss (overlong filter, HPT) has α = 0, and would
        # give 1/Σα² = 1/0 and a cross-entropy of 0 that drags the means down. No live group: metrics are 0.
        live = per_group(valid.to(alpha.dtype)) > 0

        def live_mean(v):
            return v[live].mean().item() if bool(live.any()) else 0.0

        cross = per_group(-alpha * log_gamma)
        self_kl = cross - per_group(ent_alpha)
        ess = 1.0 / per_group(alpha.square()).clamp(min=1e-300)  # effective sample size of α, in [1, n]
        alpha_max = torch.zeros(n_groups, dtype=alpha.dtype, device=alpha.device).scatter_reduce(
            0, inverse, alpha, "amax")
        metrics = {
            "brain/self_norm_kl": live_mean(self_kl),  # Σ α log(α/γ) per prompt: 0 iff π_θ matches the posterior
            "brain/cross_entropy": live_mean(cross),
            "brain/alpha_ess": live_mean(ess),
            "brain/alpha_max": live_mean(alpha_max),  # how far the posterior is from uniform
            "brain/weight_absmean": (alpha - gamma)[keep].abs().mean().item(),  # |α − γ|, the gradient's coefficients
            "brain/log_ratio_ref_old_mean": (log_ref - log_q).detach()[keep].mean().item(),
            "brain/log_prob_mean": log_pi.detach()[keep].mean().item(),
        }
    return loss, metrics


# r − group mean (a per-prompt shift cancels in α's softmax); the loss is a mean over prompts (recorded for the dump).
RECIPES.register("brain")({"advantage": "grpo", "loss": "brain", "norm_adv_by_std": False,
                           "loss_agg_mode": "seq-mean-token-mean"})
