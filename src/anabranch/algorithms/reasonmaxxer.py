"""ReasonMaxxer: a contrastive loss only at the base model's high-entropy decision points, with no
policy-gradient ratio (online rollouts each step).

Akgül, Kannan, Prasanna, Neiswanger 2026, "Rethinking RL for LLM Reasoning: It's Sparse Policy Selection,
Not Capability Learning" (arXiv 2605.06241). The paper finds that RL's useful change is a sparse correction
at the positions where the base model is uncertain (high entropy; 1–3% of positions, the promoted token in
the base model's top-5), and proposes ReasonMaxxer: a contrastive loss applied only at entropy-gated
decision points of base-model rollouts, without a policy-gradient loop.

What is implemented, for the samples y_1..y_G of a prompt with rewards r_i:

    H_t  = −Σ_v π_ref(v | y_<t) log π_ref(v | y_<t)     entropy of the frozen reference (initial) model, of its
                                                        logits divided by rollout.temperature T (see below)
    g_t  = 1[H_t ≥ τ]                                   decision gate; τ = reasonmaxxer_entropy_threshold, or
                                                        the k-th largest H over the tokens the update trains,
                                                        k = ⌈ρ·n⌉ (ρ = reasonmaxxer_top_frac; ties kept)
    s_i  = sign(r_i − mean_{j in i's group} r_j)        +1 correct, −1 incorrect, 0 in an all-equal group
    ℓ_t  = −1[s_i > 0]·log π_θ(y_t) − λ·1[s_i < 0]·log(1 − π_θ(y_t))
    L    = agg_{i,t}(g_t · ℓ_t)                         the run's loss_agg_mode over all response tokens

λ = ``algorithm.reasonmaxxer_neg_weight``. Correct samples' gated tokens are made likelier, incorrect
samples' gated tokens less likely; no other token receives gradient. log(1 − π) is computed as
log(−expm1(min(log π, −10⁻⁶))), the cap applied straight-through: its value keeps a token the policy is sure
of finite (at most −log 10⁻⁶ ≈ 13.8 nats), and its gradient is the uncapped one's at the cap, so a confidently
wrong token (π > 1 − 10⁻⁶), the one that most needs it, still gets pushed down.

The gate and the labels are computed once per update over the whole step batch (``reasonmaxxer_precompute``,
the objective's ``precompute`` hook, called by trainer/step.py), so neither depends on how the update splits
the batch into micro-batches: labels from every sample's reward (a truncated one still counts in its group's
mean, as for the advantages), the gate's top-ρ over the tokens the update trains (after DAPO's overlong filter,
SimpleTIR's void-turn filter and HPT have masked their rows out). Under DDP the top-ρ threshold is global: the
k-th largest entropy over every rank's trained tokens (algorithms/global_top_fraction.py), so a 2-process update is
the one-process update of the union batch (labels are per group, and a group never leaves its rank).

Confirmed from the paper (abstract and summaries; the method section could not be read): the gate is the
base model's own entropy, the loss is contrastive between the base model's right and wrong rollouts of a
prompt, only at the gated positions, with no RL loop. Assumed (stated in docs/algorithms.md too): the
contrast is a likelihood term on correct samples plus an unlikelihood term −log(1 − π) on incorrect ones
(bounded, so wrong tokens are not pushed to −∞; Welleck et al. 2019's unlikelihood form), with weight λ = 1;
"correct" means above its group's mean reward; the gate takes the top ρ = 0.2 of the batch's tokens by
entropy (the paper's exact threshold was not found; 0.2 follows Wang et al. 2025's forking tokens); no KL
anchor unless ``algorithm.kl_coef > 0``. The rollouts come from the current policy each step (this library
trains online); on the first step that is the base model, as in the paper. The reference entropies come
from the rollout's no-grad reference pass (trainer/advantage_pass.py), which divides the logits by
rollout.temperature as for the KL's reference log-probs: at T = 1 (the default) H is the base model's own
entropy; with T ≠ 1 it is the tempered distribution's, and a threshold in nats refers to that one.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from anabranch.algorithms.global_top_fraction import global_top_fraction_mask
from anabranch.algorithms.registries import OBJECTIVES, RECIPES

NAME = "reasonmaxxer"
# Keys whose only readers are the advantage estimators (grpo.py, ngrpo.py: norm_adv_by_std, adv_epsilon,
# ngrpo_max_reward; advantages.py: gamma, psr/nsr weights, positive_threshold; ppo_value.py: lam, vf_*) or other
# objectives (grpo.py's ppo_clip and its relatives: clip_ratio_*; ace.py: ace_alpha; cov_control.py: cov_*).
# The other estimators' keys (canon_*, mssr_*, weighted_grpo_neg_weight) are refused by their own checks.
_INERT_KEYS = ("norm_adv_by_std", "adv_epsilon", "ngrpo_max_reward", "gamma", "lam", "psr_weight", "nsr_weight",
               "positive_threshold", "vf_coef", "vf_clip", "vf_lr_multiplier", "clip_ratio_low", "clip_ratio_high",
               "clip_ratio_c", "ace_alpha", "cov_clip_ratio", "cov_clip_low", "cov_clip_high", "cov_kl_ratio",
               "cov_kl_coef")


def check_reasonmaxxer(cfg) -> str | None:
    """The keys' ranges, and what cannot act with loss=reasonmaxxer. An error message or None. The keys set
    without loss=reasonmaxxer are refused by config_checks._GATED, the options that reshape advantages by
    resolve.check_ranges (registries.ADVANTAGE_OPTIONS, for every loss that ignores advantages)."""
    frac, thr, lam = cfg.reasonmaxxer_top_frac, cfg.reasonmaxxer_entropy_threshold, cfg.reasonmaxxer_neg_weight
    if not (isinstance(frac, (int, float)) and 0 < frac <= 1):
        return (f"algorithm.reasonmaxxer_top_frac must be in (0, 1], the share of the batch's response tokens with the "
                f"highest base-model entropy that the loss trains (got {frac!r})")
    if thr is not None and not (isinstance(thr, (int, float)) and 0 <= thr < math.inf):
        return (f"algorithm.reasonmaxxer_entropy_threshold must be null or a finite entropy >= 0 in nats "
                f"(got {thr!r})")
    if not (isinstance(lam, (int, float)) and 0 <= lam < math.inf):
        return f"algorithm.reasonmaxxer_neg_weight must be a finite number >= 0 (got {lam!r})"
    defaults = {f.name: f.default for f in dataclasses.fields(type(cfg)) if f.default is not dataclasses.MISSING}
    if cfg.loss != NAME:
        return None
    if thr is not None and frac != defaults["reasonmaxxer_top_frac"]:
        return ("algorithm.reasonmaxxer_entropy_threshold and algorithm.reasonmaxxer_top_frac both pick the gated "
                "positions; set only one (a threshold replaces the top fraction)")
    if cfg.advantage != "grpo":
        return (f"algorithm.advantage={cfg.advantage!r} with algorithm.loss={NAME}: the loss never reads the "
                f"advantages (its labels are each sample's reward against its group's mean); use "
                f"algorithm.advantage=grpo (as algorithm.name={NAME} sets), which makes the trainer require "
                f"rollout.n >= 2")
    if cfg.ppo_epochs > 1:
        return (f"algorithm.ppo_epochs={cfg.ppo_epochs} with algorithm.loss={NAME}: the loss has no ratio to π_old "
                f"and no clip, so further epochs would only repeat the same unclipped step (and compute π_old "
                f"for nothing); leave algorithm.ppo_epochs at 1")
    if cfg.ref_reset_every > 0:
        return (f"algorithm.ref_reset_every={cfg.ref_reset_every} with algorithm.loss={NAME}: the gate is the base "
                f"model's entropy, read from the reference model, which the reset would replace by the policy; "
                f"leave algorithm.ref_reset_every at 0")
    if cfg.kl_coef > 0 and cfg.kl_in == "reward":
        return (f"algorithm.kl_in=reward with algorithm.loss={NAME}: the loss never reads rewards shaped per token "
                f"(its labels are the sequence rewards), so the KL would do nothing; use algorithm.kl_in=loss")
    for key in _INERT_KEYS:
        # RL-PLUS's demonstration advantage (trainer/rl_plus_step.py) does read GRPO's normalization.
        if cfg.rl_plus.enabled and key in ("norm_adv_by_std", "adv_epsilon"):
            continue
        if getattr(cfg, key) != defaults[key]:
            return (f"algorithm.{key}={getattr(cfg, key)!r} with algorithm.loss={NAME}: only the advantage estimators "
                    f"or other losses read it (ReasonMaxxer has no advantage, ratio or clip), so it would do "
                    f"nothing; leave algorithm.{key} at its default {defaults[key]!r}")
    return None


@torch.no_grad()
def decision_gate(ref_entropy: torch.Tensor, mask: torch.Tensor, top_frac: float,
                  threshold: float | None = None, dist=None) -> torch.Tensor:
    """g[B, T] in {0, 1}: response tokens whose reference entropy is >= ``threshold``, or (threshold None)
    >= the k-th largest entropy of the ``mask``ed tokens, k = ⌈top_frac · #tokens⌉. Ties at the cutoff are
    all kept (the gate is a threshold, not a count). ``dist`` (data parallel): the k-th largest over every
    rank's masked tokens, k from their total (a collective that every rank calls); None: this batch's."""
    if threshold is not None:
        return ((mask > 0) & (ref_entropy >= threshold)).float()
    return global_top_fraction_mask(ref_entropy, mask > 0, top_frac, dist).float()


def contrast_labels(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """s_i = sign(r_i − mean of i's group): +1 above the mean (correct), −1 below, 0 in an all-equal group."""
    _, inverse = torch.unique(group_index, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    r = rewards.to(torch.float32)
    zeros = torch.zeros(n_groups, dtype=r.dtype, device=r.device)
    mean = zeros.index_add(0, inverse, r) / zeros.index_add(0, inverse, torch.ones_like(r))
    diff = r - mean[inverse]
    # Exact float equality marks an all-equal group; a tolerance keeps rounding in the mean from labelling it.
    return torch.where(diff.abs() <= 1e-6 * (1 + r.abs()), torch.zeros_like(diff), torch.sign(diff))


def reasonmaxxer_precompute(cfg, pre: dict, response_mask: torch.Tensor, rewards: torch.Tensor,
                            group_index: torch.Tensor, dist=None) -> dict:
    """The objective's ``precompute`` hook (trainer/step.py, once per update, before the micro-batches): the
    gate over the tokens the update trains (``response_mask``; under DDP, ``dist``, over every rank's) and each
    row's label over the whole batch, as per-row tensors that the update slices per micro-batch."""
    ent = pre.get("ref_entropy")
    if ent is None:
        raise RuntimeError("loss=reasonmaxxer needs the reference model's entropies from the rollout pass "
                           "(trainer/advantage_pass.py), but none were given")
    device = response_mask.device
    gate = decision_gate(ent.to(device), response_mask, cfg.reasonmaxxer_top_frac,
                         cfg.reasonmaxxer_entropy_threshold, dist)
    return {"reasonmaxxer_gate": gate, "reasonmaxxer_label": contrast_labels(rewards.to(device), group_index.to(device))}


def log1m_exp_capped(log_prob: torch.Tensor, cap: float = -1e-6) -> torch.Tensor:
    """log(1 − e^x) at x = min(log_prob, cap), the cap straight-through (value capped, gradient of the capped
    point, never 0): −π/(1 − π) per unit of log π, ≈ −10⁶ for a token the policy is sure of."""
    x = log_prob.float()
    capped = x - (x - cap).clamp(min=0).detach()
    return torch.log(-torch.expm1(capped))


def reasonmaxxer_needs(cfg) -> tuple[str, ...]:
    # The reference model's forward, whose entropies give the gate (computed over the whole batch by precompute).
    return ("ref_log_prob", "ref_entropy")


# ignores_advantages: its labels are the rewards against the group mean (SPAE and TRLOO are refused with it).
@OBJECTIVES.register(NAME, needs=reasonmaxxer_needs, precompute=reasonmaxxer_precompute, ignores_advantages=True)
def reasonmaxxer_loss(log_prob, old_log_prob, advantages, response_mask, ctx):
    gate, labels = ctx.extras.get("reasonmaxxer_gate"), ctx.extras.get("reasonmaxxer_label")
    if gate is None or labels is None:
        raise RuntimeError("loss=reasonmaxxer needs the entropy gate and the labels of its precompute hook "
                           "(reasonmaxxer_precompute, called by trainer/step.py), but none were given")
    m = response_mask.to(log_prob.dtype)
    g = gate.to(log_prob.dtype) * m
    s = labels.to(log_prob.dtype)[:, None]
    pos, neg = g * (s > 0), g * (s < 0)
    unlikely = log1m_exp_capped(log_prob).to(log_prob.dtype)
    # Ungated tokens hold exact zeros (a 0 weight times a finite log), so they get no gradient.
    per_token = -(pos * log_prob + ctx.cfg.reasonmaxxer_neg_weight * neg * unlikely)
    loss = ctx.aggregate(per_token, m)
    with torch.no_grad():
        n_tok = m.sum().clamp(min=1.0)
        lp = log_prob.detach()
        metrics = {
            "reasonmaxxer/gate_frac": (g.sum() / n_tok).item(),
            "reasonmaxxer/pos_frac": (pos.sum() / n_tok).item(),
            "reasonmaxxer/neg_frac": (neg.sum() / n_tok).item(),
            # Mean log π of the gated tokens of correct (resp. incorrect) samples: up resp. down as it learns.
            "reasonmaxxer/pos_log_prob": ((lp * pos).sum() / pos.sum().clamp(min=1.0)).item(),
            "reasonmaxxer/neg_log_prob": ((lp * neg).sum() / neg.sum().clamp(min=1.0)).item(),
        }
    return loss, metrics


# grpo: its advantages are not read, but a group estimator makes the trainer require rollout.n >= 2.
RECIPES.register(NAME)({"advantage": "grpo", "loss": NAME})
