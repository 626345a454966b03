"""Outcome-reward advantage estimators besides GRPO: RLOO, REINFORCE++ and PSR/NSR.

All share the registry signature ``fn(rewards[B], group_index[B], response_mask[B,T], cfg,
**extra) -> advantages[B,T]``. ``rewards`` is the sequence reward (minus the summed KL when
``algorithm.kl_in=reward``); ``extra["token_rewards"]`` holds the per-token rewards (the score on
the last response token, −β·KL_t on every token) for the token-level estimators; inputs from outside
the rollout come from ``Algorithm.advantage_inputs`` (prompt pairing's ``group_role`` for weighted_grpo).
"""

from __future__ import annotations

import torch

from anabranch.algorithms.grpo import group_stats
from anabranch.algorithms.registries import ADVANTAGES, RECIPES


def token_level_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Put each sequence's reward on its last response token (the last masked one: with tool
    outputs inside a response, the mask has gaps, so its sum is not that position)."""
    mask = response_mask.to(torch.float32)
    last = (mask * torch.arange(1, mask.shape[1] + 1, dtype=torch.float32)).argmax(-1)
    out = torch.zeros_like(mask)
    out[torch.arange(mask.shape[0]), last] = rewards.to(torch.float32) * (mask.sum(-1) > 0)
    return out


def discounted_returns(token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = Σ_{s≥t} γ^{s−t} r_s over the response tokens; s and t count masked tokens only, so
    tool outputs inside a response (mask gaps) are not discounted steps."""
    mask = response_mask.to(torch.float32)
    out = torch.zeros_like(mask)
    running = torch.zeros(mask.shape[0])
    for t in reversed(range(mask.shape[1])):
        running = torch.where(mask[:, t] > 0, token_rewards[:, t] + gamma * running, running)
        out[:, t] = running
    return out * mask


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, shift_mean: bool = True) -> torch.Tensor:
    """(x − mean) / std over the masked entries of the whole batch (unbiased std)."""
    mask = mask.to(x.dtype)
    n = mask.sum().clamp(min=1.0)
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / (n - 1).clamp(min=1.0)
    out = (x - mean) if shift_mean else x
    return out * torch.rsqrt(var + eps) * mask


@ADVANTAGES.register("rloo", group=True)
def rloo_advantage(rewards, group_index, response_mask, cfg, **_):
    """RLOO: Â_i = r_i − (1/(G−1)) Σ_{j≠i} r_j = G/(G−1) · (r_i − mean_j r_j).

    Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et al. 2024,
    "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in
    LLMs". Groups of one get Â = 0.
    """
    rewards = rewards.to(torch.float32)
    mean, _ = group_stats(rewards, group_index)
    _, inverse = torch.unique(group_index, return_inverse=True)
    n = torch.bincount(inverse).to(torch.float32)[inverse]
    adv = torch.where(n > 1, (rewards - mean) * n / (n - 1).clamp(min=1.0), torch.zeros_like(rewards))
    return adv[:, None] * response_mask.to(adv.dtype)


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp_advantage(rewards, group_index, response_mask, cfg, token_rewards=None, **_):
    """REINFORCE++: Â_t = whiten_batch(G_t), G_t = Σ_{s≥t} γ^{s−t} r_s with per-token rewards
    r_s = −β·KL_s + [s = last]·r (the KL term when ``kl_in=reward``).

    Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models".
    The whitening (mean and std over every response token of the batch) replaces a critic.
    """
    mask = response_mask.to(torch.float32)
    if token_rewards is None:
        token_rewards = token_level_rewards(rewards, mask)
    return whiten(discounted_returns(token_rewards, mask, cfg.gamma), mask)


@ADVANTAGES.register("reinforce_pp_baseline", group=True)
def reinforce_pp_baseline_advantage(rewards, group_index, response_mask, cfg, **_):
    """REINFORCE++ with a group baseline: Â_i = whiten_batch(r_i − mean_group(r)), broadcast to tokens.

    Hu 2025 ("REINFORCE++-baseline"): the group mean removes the prompt's difficulty, the batch
    normalization (not the group std) sets the scale.
    """
    rewards = rewards.to(torch.float32)
    mean, _ = group_stats(rewards, group_index)
    mask = response_mask.to(torch.float32)
    return whiten((rewards - mean)[:, None] * mask, mask)


@ADVANTAGES.register("psr_nsr")
def psr_nsr_advantage(rewards, group_index, response_mask, cfg, **_):
    """Positive and negative sample reinforcement: Â_i = +λ_P if r_i > τ else −λ_N.

    Zhu et al. 2025, "The Surprising Effectiveness of Negative Reinforcement in LLM Reasoning":
    L = −λ_P Σ_{correct} log π(y) + λ_N Σ_{wrong} log π(y). PSR only: λ_N = 0; NSR only: λ_P = 0;
    W-REINFORCE: λ_P = 0.1, λ_N = 1. λ_P = ``psr_weight``, λ_N = ``nsr_weight``,
    τ = ``positive_threshold``. No baseline, as in the paper.
    """
    positive = rewards.to(torch.float32) > cfg.positive_threshold
    adv = torch.where(positive, torch.tensor(cfg.psr_weight), torch.tensor(-cfg.nsr_weight))
    return adv[:, None] * response_mask.to(torch.float32)


RECIPES.register("dr_grpo")({"advantage": "grpo", "loss": "ppo_clip", "norm_adv_by_std": False,
                             "loss_agg_mode": "seq-mean-token-sum-norm"})
RECIPES.register("rloo")({"advantage": "rloo", "loss": "ppo_clip", "loss_agg_mode": "seq-mean-token-mean"})
RECIPES.register("reinforce_pp")({"advantage": "reinforce_pp", "loss": "ppo_clip", "loss_agg_mode": "token-mean",
                                  "kl_in": "reward", "kl_coef": 0.01, "kl_estimator": "k1"})
RECIPES.register("reinforce_pp_baseline")({"advantage": "reinforce_pp_baseline", "loss": "ppo_clip",
                                           "loss_agg_mode": "token-mean", "kl_coef": 0.01, "kl_estimator": "k2"})
RECIPES.register("w_reinforce")({"advantage": "psr_nsr", "loss": "ppo_clip", "psr_weight": 0.1, "nsr_weight": 1.0})
RECIPES.register("psr")({"advantage": "psr_nsr", "loss": "ppo_clip", "psr_weight": 1.0, "nsr_weight": 0.0})
RECIPES.register("nsr")({"advantage": "psr_nsr", "loss": "ppo_clip", "psr_weight": 0.0, "nsr_weight": 1.0})

# TRLOO (algorithms/trloo.py): turn-level leave-one-out advantages of multi-attempt episodes; registered on import.
from anabranch.algorithms import trloo  # noqa: E402,F401
