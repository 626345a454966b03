"""PACS: RLVR as supervised learning, the verifier's reward as the label of a policy-parameterized score.

Li, Chen, Gong, Chen, Wang, He, Luo, Yang 2025, "Implicit Actor Critic Coupling via a Supervised
Learning Framework for RLVR" (arXiv 2509.02522). For the G samples y_1..y_G of a prompt x with
rewards r_i ∈ {0, 1}:

    r̂_i = β · Σ_t (log π_θ(y_{i,t}) − log π_old(y_{i,t}))       reward proxy (sequence log-ratio)
    ψ_i  = r̂_i − (1/(G−1)) Σ_{j≠i} r̂_j                          score: RLOO advantage of r̂
    L_i  = −w_i · [r_i log σ(ψ_i) + (1 − r_i) log(1 − σ(ψ_i))]    binary cross-entropy, label r_i
    L    = (1/N) Σ_i L_i                                          mean over the batch's sequences

β = ``algorithm.pacs_beta``. The gradient is ∂L_i/∂ψ_i = w_i·(σ(ψ_i) − r_i)/N: the policy's own
log-ratio plays the critic (σ(ψ) predicts the reward) while the same log-probs are the actor, and a
correct sample (r = 1) is pushed up, a wrong one down, less so as σ(ψ) already predicts its label.
With one pass over the batch (π_old = π_θ) ψ = 0 and the gradient on sample k's log-likelihood is
β·(mean_{j≠k} r_j − r_k)·w/N: RLOO's policy gradient on the raw rewards.

w_i (``algorithm.pacs_class_balance``): the authors' runs weight each group's samples by their
class, w = G / (K·n_c) for a sample of class c (n_c samples of it, K distinct rewards in the group,
K ≥ 2; w = 1 in a group with one reward), so a group's rare outcome weighs as much as its common
one ("balanced" class weights per question); false gives w = 1.

What the sources fix and what is assumed: the BCE on σ(ψ) with the outcome reward as label, the
RLOO score and the reward proxy from the log-probability ratio are the paper's (abstract and its
framework figure). The exact proxy follows the authors' code (github.com/ritzz-ai/PACS, read for
the definitions only): the ratio is to π_old (the policy that sampled the batch; not the frozen
reference model, which PACS therefore never loads), summed over the response tokens (not
length-normalized), β = 1 (their scripts: 1 and 2), class-balanced weights on, the BCE averaged
over sequences whatever ``loss_agg_mode`` says. The advantages the estimator computes are not read:
options that reshape them are refused (resolve.check_ranges). Rewards must lie in [0, 1] (the label of a cross-entropy).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from anabranch.algorithms.registries import OBJECTIVES, RECIPES

NAME = "pacs"
# What PACS refuses beyond the options every loss that ignores the advantages refuses (registries.ADVANTAGE_OPTIONS,
# resolve.check_ranges): DAPO's overlong punishment makes rewards negative, no longer a label in [0, 1].
_LABEL_BREAKING_OPTIONS = (("overlong_buffer", lambda c: c.overlong_buffer > 0),)


def check_pacs(cfg) -> str | None:
    """``algorithm.pacs_beta`` > 0 and finite; no option that breaks its label (the advantage options are
    refused for every loss that ignores them, in resolve.check_ranges)."""
    beta = cfg.pacs_beta
    if not (isinstance(beta, (int, float)) and 0 < beta < math.inf):
        return f"algorithm.pacs_beta must be a positive finite number, PACS's scale β of the score (got {beta!r})"
    if not isinstance(cfg.pacs_class_balance, bool):
        return f"algorithm.pacs_class_balance must be true or false (got {cfg.pacs_class_balance!r})"
    if cfg.loss != NAME:  # its keys set while off: config_checks._GATED (run first by resolve.check_algorithm)
        return None
    for key, on in _LABEL_BREAKING_OPTIONS:
        if on(cfg):
            return (f"algorithm.{key}={getattr(cfg, key)!r} with algorithm.loss={NAME}: PACS's label is the reward in "
                    f"[0, 1] (its score the policy's log-ratio), and this option would break the label; leave "
                    f"algorithm.{key} at its default")
    return None


# Rewards whose values leave [0, 1]: shaping (penalties, bonuses on top of 1) and the label-free
# intrinsic scores (log-probabilities and entropies, ≤ 0 or unbounded). A user's module:function
# reward is not known here; the update's own check stops it on the first value outside [0, 1].
_SHAPING_REWARDS = ("overlong_penalty", "target_length", "laser", "laser_d", "self_certainty", "neg_entropy",
                    "trajectory_log_prob")


def check_pacs_rewards(cfg) -> None:
    """ConfigError unless the trained reward is one verifier with weight in (0, 1]: PACS's label must lie in
    [0, 1], so a sum of rewards, a weight above 1 or a shaping reward is refused before any model loads
    (``math_verify*0``-style entries, weight 0, only log and are allowed)."""
    from anabranch.config import ConfigError

    live = [f for f in cfg.reward.functions if f.weight != 0]
    if len(live) != 1 or not 0 < live[0].weight <= 1 or live[0].name in _SHAPING_REWARDS:
        names = ", ".join(f"{f.name}*{f.weight:g}" for f in live) or "none"
        raise ConfigError(f"algorithm.loss={NAME} uses the reward as the label of a cross-entropy, so it must lie in "
                          f"[0, 1]: reward.functions must hold exactly one verifier with a weight in (0, 1] and no "
                          f"shaping reward ({', '.join(_SHAPING_REWARDS)}); other entries may have weight 0 "
                          f"(got {names})")


def rloo_score(seq_value: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """ψ_i = x_i − mean_{j≠i, j in i's group} x_j for ``seq_value[B]`` (differentiable)."""
    _, inverse = torch.unique(group_index, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    zeros = torch.zeros(n_groups, dtype=seq_value.dtype, device=seq_value.device)
    n = zeros.index_add(0, inverse, torch.ones_like(seq_value))
    if bool((n < 2).any()):
        raise RuntimeError("loss=pacs compares each sample with the rest of its group: every group needs at least 2 "
                           "samples (set rollout.n >= 2)")
    total = zeros.index_add(0, inverse, seq_value)[inverse]
    return seq_value - (total - seq_value) / (n[inverse] - 1)


def class_weights(labels: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """w_i = G / (K·n_c) within each group with K ≥ 2 distinct labels, else 1 (balanced class weights)."""
    w = torch.ones_like(labels, dtype=torch.float32)
    for g in torch.unique(group_index):
        rows = (group_index == g).nonzero(as_tuple=True)[0]
        values, inverse, counts = torch.unique(labels[rows], return_inverse=True, return_counts=True)
        if values.numel() > 1:
            w[rows] = rows.numel() / (values.numel() * counts[inverse].to(torch.float32))
    return w


def pacs_needs(cfg) -> tuple[str, ...]:
    # ψ is a leave-one-out comparison inside each group: no micro-batch may split one.
    return ("whole_groups",)


# ignores_advantages: its label is the reward, its score the log-ratio (SPAE and TRLOO are refused with it).
@OBJECTIVES.register(NAME, needs=pacs_needs, ignores_advantages=True)
def pacs_loss(log_prob, old_log_prob, advantages, response_mask, ctx):
    cfg = ctx.cfg
    if ctx.rewards is None or ctx.group_index is None:
        raise RuntimeError("loss=pacs needs each sample's reward (its label) and group, but none were given")
    labels = ctx.rewards.to(log_prob.dtype)
    if bool(((labels < 0) | (labels > 1)).any()):
        raise ValueError(f"loss=pacs uses the reward as the label of a cross-entropy, so it must lie in [0, 1] (got "
                         f"rewards in [{float(labels.min()):g}, {float(labels.max()):g}]); use a 0/1 correctness reward "
                         "(reward.functions) without bonuses or penalties")
    m = response_mask.to(log_prob.dtype)
    r_hat = cfg.pacs_beta * ((log_prob - old_log_prob) * m).sum(-1)
    psi = rloo_score(r_hat, ctx.group_index)
    weight = class_weights(labels, ctx.group_index).to(psi.dtype) if cfg.pacs_class_balance else torch.ones_like(psi)
    per_seq = weight * F.binary_cross_entropy_with_logits(psi, labels, reduction="none")
    # Mean over the step batch's sequences, as the authors' code (BCE averaged over samples).
    loss = ctx.aggregate(per_seq[:, None].expand_as(m), m, mode="seq-mean-token-mean")
    with torch.no_grad():
        prob = torch.sigmoid(psi)
        metrics = {
            "pacs/score_mean": psi.mean().item(),
            "pacs/score_abs_mean": psi.abs().mean().item(),
            # How well σ(ψ), the implicit critic, predicts the verifier: accuracy at 1/2 and mean |σ − r|.
            "pacs/critic_acc": ((prob > 0.5).to(labels.dtype) == (labels > 0.5).to(labels.dtype)).float().mean().item(),
            "pacs/critic_err": (prob - labels).abs().mean().item(),
            # The balanced weights average 1 in every group; their largest is the rare outcome's.
            "pacs/weight_max": weight.max().item(),
            "approx_kl": ((-(log_prob - old_log_prob) * m).sum() / m.sum().clamp(min=1.0)).item(),
        }
    return loss, metrics


# rloo: the estimator's advantages are not read, but a group estimator makes the trainer require
# rollout.n >= 2. KL to a reference model stays off (the authors' runs use none).
RECIPES.register(NAME)({"advantage": "rloo", "loss": NAME, "loss_agg_mode": "seq-mean-token-mean"})
