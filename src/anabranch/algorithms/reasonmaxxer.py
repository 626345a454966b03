"""ReasonMaxxer: an RL-free contrastive loss only at the base model's high-entropy decision points.

Akgül, Kannan, Prasanna, Neiswanger 2026, "Rethinking RL for LLM Reasoning: It's Sparse Policy Selection,
Not Capability Learning" (arXiv 2605.06241). The paper finds that RL's useful change is a sparse correction
at the positions where the base model is uncertain (high entropy; 1–3% of positions, the promoted token in
the base model's top-5), and proposes ReasonMaxxer: a contrastive loss applied only at entropy-gated
decision points of base-model rollouts, without a policy-gradient loop.

What is implemented, for the samples y_1..y_G of a prompt with rewards r_i:

    H_t  = −Σ_v π_ref(v | y_<t) log π_ref(v | y_<t)     entropy of the frozen reference (initial) model
    g_t  = 1[H_t ≥ τ]                                   decision gate; τ = reasonmaxxer_entropy_threshold, or
                                                        the (1 − ρ)-quantile of H over the step batch's
                                                        response tokens (ρ = reasonmaxxer_top_frac)
    s_i  = sign(r_i − mean_{j in i's group} r_j)        +1 correct, −1 incorrect, 0 in an all-equal group
    ℓ_t  = −1[s_i > 0]·log π_θ(y_t) − λ·1[s_i < 0]·log(1 − π_θ(y_t))
    L    = agg_{i,t}(g_t · ℓ_t)                         the run's loss_agg_mode over all response tokens

λ = ``algorithm.reasonmaxxer_neg_weight``. Correct samples' gated tokens are made likelier, incorrect
samples' gated tokens less likely; no other token receives gradient.

Confirmed from the paper (abstract and summaries; the method section could not be read): the gate is the
base model's own entropy, the loss is contrastive between the base model's right and wrong rollouts of a
prompt, only at the gated positions, with no RL loop. Assumed (stated in docs/algorithms.md too): the
contrast is a likelihood term on correct samples plus an unlikelihood term −log(1 − π) on incorrect ones
(bounded, so wrong tokens are not pushed to −∞; Welleck et al. 2019's unlikelihood form), with weight λ = 1;
"correct" means above its group's mean reward; the gate takes the top ρ = 0.2 of the batch's tokens by
entropy (the paper's exact threshold was not found; 0.2 follows Wang et al. 2025's forking tokens); no KL
anchor unless ``algorithm.kl_coef > 0``. The rollouts come from the current policy each step (this library
trains online); on the first step that is the base model, as in the paper. The gate is computed from the
reference model in the rollout's no-grad pass (trainer/advantage_pass.py), over each rank's own batch.
"""

from __future__ import annotations

import math

import torch

from anabranch.algorithms.registries import ADVANTAGES, OBJECTIVES, RECIPES

NAME = "reasonmaxxer"
_DEFAULTS = {"reasonmaxxer_top_frac": 0.2, "reasonmaxxer_entropy_threshold": None, "reasonmaxxer_neg_weight": 1.0}
# Options that reshape advantages (or route rows by them): ReasonMaxxer reads rewards, never advantages.
_ADVANTAGE_OPTIONS = (("tis_cap", lambda c: c.tis_cap > 0), ("entropy_adv_alpha", lambda c: c.entropy_adv_alpha > 0),
                      ("entropy_top_rho", lambda c: c.entropy_top_rho < 1), ("ucas", lambda c: bool(c.ucas)),
                      ("progrpo_alpha", lambda c: c.progrpo_alpha > 0), ("lp_reg_coef", lambda c: c.lp_reg_coef > 0),
                      ("ppl_shaping_coef", lambda c: c.ppl_shaping_coef > 0),
                      ("position_shaping_coef", lambda c: c.position_shaping_coef > 0),
                      ("er_shaping_coef", lambda c: c.er_shaping_coef > 0), ("srpo_coef", lambda c: c.srpo_coef > 0),
                      ("dsdr_local_coef", lambda c: c.dsdr_local_coef > 0))


def check_reasonmaxxer(cfg) -> str | None:
    """The keys' ranges; keys only with loss=reasonmaxxer; what cannot act with it. An error message or None."""
    frac, thr, lam = cfg.reasonmaxxer_top_frac, cfg.reasonmaxxer_entropy_threshold, cfg.reasonmaxxer_neg_weight
    if not (isinstance(frac, (int, float)) and 0 < frac <= 1):
        return (f"algorithm.reasonmaxxer_top_frac must be in (0, 1], the share of the batch's response tokens with the "
                f"highest base-model entropy that the loss trains (got {frac!r})")
    if thr is not None and not (isinstance(thr, (int, float)) and 0 <= thr < math.inf):
        return (f"algorithm.reasonmaxxer_entropy_threshold must be null or a finite entropy >= 0 in nats "
                f"(got {thr!r})")
    if not (isinstance(lam, (int, float)) and 0 <= lam < math.inf):
        return f"algorithm.reasonmaxxer_neg_weight must be a finite number >= 0 (got {lam!r})"
    if cfg.loss != NAME:
        for key, default in _DEFAULTS.items():
            if getattr(cfg, key) != default:
                return (f"algorithm.{key}={getattr(cfg, key)!r} has no effect with algorithm.loss={cfg.loss!r}; set "
                        f"algorithm.name={NAME} (or algorithm.loss={NAME}) or leave it at {default}")
        return None
    if thr is not None and frac != _DEFAULTS["reasonmaxxer_top_frac"]:
        return ("algorithm.reasonmaxxer_entropy_threshold and algorithm.reasonmaxxer_top_frac both pick the gated "
                "positions; set only one (a threshold replaces the top fraction)")
    if not ADVANTAGES.meta(cfg.advantage).get("group"):
        return (f"algorithm.loss={NAME} contrasts the right and wrong samples of each prompt, so it needs a group "
                f"advantage estimator (e.g. grpo, which also makes the trainer require rollout.n >= 2), not "
                f"algorithm.advantage={cfg.advantage!r}")
    if cfg.ref_reset_every > 0:
        return (f"algorithm.ref_reset_every={cfg.ref_reset_every} with algorithm.loss={NAME}: the gate is the base "
                f"model's entropy, read from the reference model, which the reset would replace by the policy; "
                f"leave algorithm.ref_reset_every at 0")
    if cfg.kl_coef > 0 and cfg.kl_in == "reward":
        return (f"algorithm.kl_in=reward with algorithm.loss={NAME}: the loss never reads rewards shaped per token "
                f"(its labels are the sequence rewards), so the KL would do nothing; use algorithm.kl_in=loss")
    for key, on in _ADVANTAGE_OPTIONS:
        if on(cfg):
            return (f"algorithm.{key}={getattr(cfg, key)!r} with algorithm.loss={NAME}: ReasonMaxxer never reads the "
                    f"advantages (its labels are each sample's reward against its group's mean), so this option "
                    f"would do nothing; leave algorithm.{key} at its default")
    return None


@torch.no_grad()
def decision_gate(ref_entropy: torch.Tensor, mask: torch.Tensor, top_frac: float,
                  threshold: float | None = None) -> torch.Tensor:
    """g[B, T] in {0, 1}: response tokens whose reference entropy is >= ``threshold``, or (threshold None)
    >= the k-th largest entropy of the batch's response tokens, k = ceil(top_frac · #tokens). Ties at the
    cutoff are all kept (the gate is a threshold, not a count)."""
    valid = mask > 0
    if threshold is not None:
        return (valid & (ref_entropy >= threshold)).float()
    values = ref_entropy[valid]
    k = math.ceil(top_frac * values.numel())
    if k == 0:
        return torch.zeros_like(ref_entropy, dtype=torch.float32)
    cutoff = torch.topk(values, k).values.min()
    return (valid & (ref_entropy >= cutoff)).float()


def gate_inputs(cfg, ref_entropy: torch.Tensor, mask: torch.Tensor) -> dict:
    """What the advantage pass stores for the update: the gate over the whole step batch (so ``top_frac``
    does not depend on how the update splits it into micro-batches)."""
    gate = decision_gate(ref_entropy, mask, cfg.reasonmaxxer_top_frac, cfg.reasonmaxxer_entropy_threshold)
    return {"reasonmaxxer_gate": gate}


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


def reasonmaxxer_needs(cfg) -> tuple[str, ...]:
    # The reference model's forward (its entropies give the gate); labels are group statistics: whole groups.
    return ("ref_log_prob", "ref_entropy", "whole_groups")


@OBJECTIVES.register(NAME, needs=reasonmaxxer_needs)
def reasonmaxxer_loss(log_prob, old_log_prob, advantages, response_mask, ctx):
    gate = ctx.extras.get("reasonmaxxer_gate")
    if gate is None:
        raise RuntimeError("loss=reasonmaxxer needs the reference model's entropy gate from the rollout pass "
                           "(trainer/advantage_pass.py), but none was given")
    if ctx.rewards is None or ctx.group_index is None:
        raise RuntimeError("loss=reasonmaxxer needs each sample's reward and group, but none were given")
    m = response_mask.to(log_prob.dtype)
    g = gate.to(log_prob.dtype) * m
    labels = contrast_labels(ctx.rewards, ctx.group_index).to(log_prob.dtype)[:, None]
    pos, neg = g * (labels > 0), g * (labels < 0)
    # log(1 − π) from log π; π is kept below 1 so that a token the policy is sure of gives a finite loss.
    unlikely = torch.log1p(-log_prob.exp().clamp(max=1 - 1e-6))
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
