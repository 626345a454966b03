"""Weighted GRPO: prompt pairing's role-weighted group advantage (q+ and q− of a pair).

Sheng, Li, Pang, Peng, Ma (2026), "Beyond Variance: Prompt-Efficient RLVR via Rare-Event
Amplification and Bidirectional Pairing" (arXiv 2602.03452). Every update trains on a pair: q+, a
hard-but-solvable prompt (rare successes), and q−, an easy-but-brittle one (rare failures); see
trainer/prompt_pairing.py. Weighted GRPO "reweights binary outcomes at the pair level and uses
group-normalized advantages" so that a rare success on q+ becomes a sharp positive signal and a rare
failure on q− a strong negative one.

Formula (G samples per prompt, r_i ∈ {0, 1} the outcome of sample i of group g, role(g) ∈ {q+, q−}):

    μ_g = mean_{j∈g} r_j,   σ_g = std_{j∈g} r_j (unbiased, as GRPO's)
    Â_i = w(role(g)) · (r_i − μ_g) / (σ_g + ε)          (÷ (σ_g + ε) only with algorithm.norm_adv_by_std)
    w(q+) = 1,   w(q−) = λ_neg = algorithm.weighted_grpo_neg_weight

Equivalently, the outcomes are first mapped at the pair level, q+: success → +1, failure → 0;
q−: success → 0, failure → −λ_neg (the informative, rare event of each prompt carries the weight),
then centred by their group's mean and divided by the std of the unweighted outcomes. A success on a
q+ with p̂ = 1/G gets (1 − 1/G)/σ = (G−1)/√G (σ = 1/√G); a failure on a q− with p̂ = 1 − 1/G gets
−λ_neg·(G−1)/√G.
λ_neg = 1 is GRPO on the pair.

Where this comes from, and what is assumed. The paper's method section could not be read; what was
found: its abstract (the sentences quoted above) and a secondary summary of its method ("Weighted
GRPO maps outcomes to +1 or −λ_neg before group normalization, so rare successes on q+ and rare
failures on q− both get large advantages"). Assumed here:
  - the weight applies per role and *after* the division by σ_g. A map of binary outcomes to
    {+1, −λ_neg} applied to every sample before a mean/std normalization is an affine map
    (r̃ = (1+λ_neg)·r − λ_neg), which a z-score cancels exactly; the paper's λ_neg can only have an
    effect if it weighs q−'s signal against q+'s, which is what w(q−) = λ_neg does;
  - the default λ_neg = 1.0 (plain GRPO on the pair): the paper's value was not found;
  - non-binary rewards (e.g. a format bonus) are centred and weighted the same way (the paper's
    outcomes are binary).
The role of each group comes from the prompt-pairing sampler (``group_role``: +1 for q+, −1 for
q−, per sample), so this estimator is refused without ``task.pairing=true``.
"""

from __future__ import annotations

import math

import torch

from anabranch.algorithms.grpo import group_stats
from anabranch.algorithms.registries import ADVANTAGES, RECIPES
from anabranch.config import ConfigError

ROLE_PLUS, ROLE_MINUS = 1, -1
NAME = "weighted_grpo"


def check_weighted_grpo(cfg) -> str | None:
    """``algorithm.weighted_grpo_neg_weight``: λ_neg > 0 and finite, and only with the estimator that reads it."""
    lam = cfg.weighted_grpo_neg_weight
    if not (isinstance(lam, (int, float)) and 0 < lam < math.inf):
        return (f"algorithm.weighted_grpo_neg_weight must be a positive finite number, the weight λ_neg of the q− "
                f"prompt's advantages in Weighted GRPO (1: plain GRPO; got {lam!r})")
    if lam != 1.0 and cfg.advantage != NAME:
        return (f"algorithm.weighted_grpo_neg_weight={lam} has no effect with algorithm.advantage={cfg.advantage!r}; "
                f"set algorithm.advantage={NAME} (or algorithm.name={NAME}) with task.pairing=true, or leave it at 1")
    return None


def check_needs_pairing(cfg) -> None:
    """Whole-config check (``cfg``: Config): Weighted GRPO needs the q+/q− roles of prompt pairing."""
    if cfg.algorithm.advantage == NAME and not cfg.task.pairing:
        raise ConfigError(f"algorithm.advantage={NAME} weighs each prompt by its role in a (q+, q−) pair, which "
                          "only prompt pairing knows: set task.pairing=true (see task.pairing_*) or choose another "
                          "algorithm.advantage (e.g. grpo)")


@ADVANTAGES.register(NAME, group=True)
def weighted_grpo_advantage(rewards, group_index, response_mask, cfg, group_role=None, **_):
    """Â_i = w(role) · (r_i − μ_g) / (σ_g + ε), w(q+) = 1, w(q−) = λ_neg (module docstring)."""
    if group_role is None:
        raise ConfigError(f"algorithm.advantage={NAME} needs each group's q+/q− role from prompt pairing "
                          "(task.pairing=true); none was given")
    role = torch.as_tensor(group_role).reshape(-1)
    if role.shape[0] != rewards.shape[0] or not bool(((role == ROLE_PLUS) | (role == ROLE_MINUS)).all()):
        raise ValueError(f"weighted_grpo: group_role must hold +1 (q+) or -1 (q−) for each of the {rewards.shape[0]} "
                         f"samples (got shape {tuple(role.shape)})")
    rewards = rewards.to(torch.float32)
    mean, std = group_stats(rewards, group_index)
    adv = rewards - mean
    if cfg.norm_adv_by_std:
        adv = adv / (std + cfg.adv_epsilon)
    weight = torch.where(role == ROLE_PLUS, torch.tensor(1.0), torch.tensor(float(cfg.weighted_grpo_neg_weight)))
    return (weight * adv)[:, None] * response_mask.to(adv.dtype)


RECIPES.register(NAME)({"advantage": NAME, "loss": "ppo_clip", "loss_agg_mode": "token-mean"})
