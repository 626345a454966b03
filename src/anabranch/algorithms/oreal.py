"""OREAL: behaviour cloning on the correct samples, pass-rate-reshaped policy gradient on the wrong ones, and
optional token weights from a learned token-level reward head.

Lyu, Gao, Gu, Zhang, Gao, Liu, Wang, Li, Zhao, Huang, Cao, Liu, Liu, Liu, Zhang, Lin, Chen 2025, "Exploring the
Limit of Outcome Reward for Learning Mathematical Reasoning" (arXiv 2502.06781). The paper proves that behaviour
cloning on the positive samples of best-of-N sampling learns the KL-regularized optimal policy under a binary
reward, that the rewards of the negative samples must then be reshaped so that their gradient is consistent with
the positives', and adds a token-level reward model that weights the tokens of each trajectory.

For the n samples y_1..y_n of a prompt, with outcome o_i = +1 if r_i > τ (``algorithm.positive_threshold``) else
−1, k of them correct:

    A_i  = o_i − (1/(n−1)) Σ_{j≠i} o_j            RLOO reshaping: A = 2(n−k)/(n−1) on a correct sample and
                                                   A = −2k/(n−1) = −2·p̂_{−i} on a wrong one, p̂_{−i} = k/(n−1)
                                                   the pass rate of the prompt's other samples
    L+   = (1/T+) Σ_{i: o_i=+1} Σ_t a_i · ω⁺_{i,t} · (−log π_θ(y_{i,t}))         behaviour cloning (NLL)
    L−   = (η/T−) Σ_{i: o_i=−1} Σ_t |A_i| · ω⁻_{i,t} · π_θ(y_{i,t}) / π_old(y_{i,t})
    L    = L+ + L−  (+ the run's KL term, kl_in=loss)

T+ / T− = the update's response tokens of correct / wrong samples (each half has its own token mean), a_i = A_i
with ``algorithm.oreal_pos_mult_adv`` (the default) and 1 without (plain BC), η = ``algorithm.oreal_neg_weight``.
The wrong sample's gradient is η·|A_i|·ω⁻/T− · ∇log π_θ: it pushes the sample down in proportion to how often
the prompt's other samples succeed, so a wrong answer on an easy prompt is penalized more than on a hard one, and
a prompt with no correct sample (k = 0) gives none (there is no BoN positive to be consistent with). All-correct
groups have A = 0 (nothing to learn with a_i = A_i; plain BC clones them).

Token weights (``algorithm.oreal_token_rm``): a linear head w = u·h on the policy's last hidden state (detached:
the head never trains the policy) scores each response token, and is trained beside the policy by the
sequence-level cross-entropy BCE(σ(mean_t w_t), 1[o_i = +1]), averaged over the update's sequences (``token_rm_loss``,
the objective's auxiliary loss). With q_t = σ(mean_{s≤t} w_s), the cumulative mean up to token t (detached),

    ω⁺_t = clamp((q_t − ½)/½, 0, 1),    ω⁻_t = clamp((½ − q_t)/½, 0, 1)

so a correct sample's tokens that the head already judges likely-correct are cloned, a wrong sample's tokens it
judges likely-wrong are penalized, and the rest get no gradient. Without the head ω⁺ = ω⁻ = 1.

Sources. Confirmed from the abstract: BC on BoN positives, reshaped negatives for gradient consistency, a
token-level reward model that picks the important tokens. Confirmed from the authors' released training code
and config (github.com/InternLM/OREAL, read for the definitions only, nothing copied): the ±1 outcome, the RLOO
reshaping (reward_shaping_type=rloo), the separate token means T+ / T− ("per_token"), the BC term multiplied by
the advantage (pos_mult_adv=True), η = 0.5 (negative_loss_factor), the importance ratio on the negatives, the
reward model's sequence logit as the mean of its token logits with BCE against the outcome, the cumulative-mean
probability and the 0.5 threshold rescaling of the weights, one pass over each batch, KL coef 0.01 with the
non-negative k3 estimator to the reference. The paper's method text itself could not be read here.

Differences from the authors' setup (assumed or simplified): their token-level RM is a whole copy of the policy
with a linear head, trained with a 4× learning rate and with the actor frozen for the first 10 steps; here it is
a linear head on the policy's own hidden state (``oreal_token_rm_lr_multiplier``, default 4, the ratio of their
learning rates), zero-initialized, so q = ½ and ω = 0 until it has learned: the policy term then starts at zero
and grows as the head separates right from wrong (the role of their freeze). They also keep one correct and one
wrong trajectory per prompt (filter_trajectory) after computing A on all 16; here every sample of the group is
trained. The reference-model KL, ``algorithm.kl_coef``, is the library's (the recipe sets the authors' 0.01, k3).

Code vs paper on the positives. The paper reshapes the rewards of the **negative** samples only: the positives get
plain behaviour cloning (a_i = 1), and an author reply on the OREAL repository (reported to this library's review;
not re-read here) says so. The authors' released config sets pos_mult_adv=True, which also multiplies the
positives' cloning by A_i = 2(n−k)/(n−1): more weight on a correct sample of a hard prompt, none on an all-correct
group. The default here, ``oreal_pos_mult_adv=true``, follows the released code, since that is what trained the
published models; ``oreal_pos_mult_adv=false`` is the paper's plain BC. Plain BC is refused with
``algorithm.dynamic_sampling=true``: it is meant to clone all-correct groups too, and dynamic sampling drops them.

The coefficients (A, 1/T±, the head's 1/N) are computed once per update over the whole batch (``oreal_precompute``,
the objective's precompute hook), so micro-batch splits give the single-pass gradient; under DDP T+, T− and N are
summed over the ranks and divided by the world size (DDP averages gradients), as for ``token-mean``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from anabranch.algorithms.advantages import rloo_advantage
from anabranch.algorithms.registries import OBJECTIVES, RECIPES

NAME = "oreal"
TOKEN_RM = "oreal_token_rm"  # the head's name in the trainer's modules (saved in checkpoints, never exported)


def check_oreal(cfg) -> str | None:
    """The keys' ranges and what cannot act with loss=oreal (resolve.check_ranges). An error message or None.
    The keys set without loss=oreal (or the head's learning rate without the head) are refused by
    config_checks._GATED, the options that reshape advantages by resolve.check_ranges (ignores_advantages)."""
    eta, lr_mult = cfg.oreal_neg_weight, cfg.oreal_token_rm_lr_multiplier
    if not (isinstance(eta, (int, float)) and 0 <= eta < math.inf):
        return f"algorithm.oreal_neg_weight must be a finite number >= 0, the weight η of the wrong samples' term (got {eta!r})"
    if not (isinstance(lr_mult, (int, float)) and 0 < lr_mult < math.inf):
        return (f"algorithm.oreal_token_rm_lr_multiplier must be a positive finite number, the token reward head's "
                f"learning rate over the policy's (got {lr_mult!r})")
    for key in ("oreal_pos_mult_adv", "oreal_token_rm"):
        if not isinstance(getattr(cfg, key), bool):
            return f"algorithm.{key} must be true or false (got {getattr(cfg, key)!r})"
    if cfg.loss != NAME:
        return None
    if cfg.loss_agg_mode != "token-mean":
        return (f"algorithm.loss_agg_mode={cfg.loss_agg_mode!r} with algorithm.loss={NAME}: OREAL takes its own token "
                f"means, over the correct samples' tokens and over the wrong samples' tokens, so another mode would "
                f"change only the KL and entropy terms; use algorithm.loss_agg_mode=token-mean (as algorithm.name={NAME} sets)")
    if cfg.ppo_epochs > 1:
        return (f"algorithm.ppo_epochs={cfg.ppo_epochs} with algorithm.loss={NAME}: its ratio on the wrong samples is "
                f"unclipped and its behaviour cloning unbounded, made for one pass over each batch (as the authors "
                f"train); leave algorithm.ppo_epochs at 1")
    if not cfg.oreal_pos_mult_adv and cfg.dynamic_sampling:
        # Plain BC gives an all-correct group's samples weight 1/T+, but dynamic sampling (either filter: such a
        # group's rewards are all equal, its std 0) removes the group before the loss sees it.
        return ("algorithm.oreal_pos_mult_adv=false with algorithm.dynamic_sampling=true: plain behaviour cloning "
                "clones every correct sample, those of all-correct groups included, but dynamic sampling drops those "
                "groups before the loss, so they would never be cloned; set algorithm.dynamic_sampling=false, or keep "
                "algorithm.oreal_pos_mult_adv=true (then an all-correct group has A = 0 and dropping it changes nothing)")
    if cfg.kl_coef > 0 and cfg.kl_in == "reward":
        return (f"algorithm.kl_in=reward with algorithm.loss={NAME}: the loss reads each sample's outcome, never the "
                f"per-token shaped rewards, so the KL would do nothing; use algorithm.kl_in=loss (as the recipe sets)")
    return None


class TokenRewardHead(nn.Module):
    """w = u·h, a scalar score per token from the last hidden state; u starts at 0 (q = ½ everywhere)."""

    def __init__(self, hidden_size: int, lr_multiplier: float = 1.0):
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1, bias=False)  # no bias, as the authors' head
        nn.init.zeros_(self.proj.weight)
        self.lr_multiplier = lr_multiplier  # read by the optimizer builder (trainer/components.py)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden.to(self.proj.weight.dtype)).squeeze(-1)


def make_token_rm(model_config, cfg) -> TokenRewardHead:
    return TokenRewardHead(model_config.hidden_size, cfg.oreal_token_rm_lr_multiplier)


def token_scores(modules: dict, hidden: torch.Tensor, width: int) -> torch.Tensor:
    """w [B, T] from the (detached) hidden states in which each response token was sampled, as the value head reads
    them (algorithms/ppo_value.py) and as the authors align their reward logits with the log-probs."""
    return modules[TOKEN_RM](hidden[:, -(width + 1):-1].detach())


def cumulative_mean(w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """mean_{s≤t} w_s over the masked tokens up to t (0 before a row's first one)."""
    m = mask.to(w.dtype)
    return (w * m).cumsum(-1) / m.cumsum(-1).clamp(min=1.0)


def token_weights(w: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ω⁺, ω⁻) from the head's scores: q = σ(cumulative mean), rescaled above / below ½ into [0, 1] (detached)."""
    q = torch.sigmoid(cumulative_mean(w.detach().float(), mask))
    return ((q - 0.5) / 0.5).clamp(0.0, 1.0), ((0.5 - q) / 0.5).clamp(0.0, 1.0)


def reshaped_outcomes(rewards: torch.Tensor, group_index: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, A): the ±1 outcome of each sample and its RLOO-reshaped value (groups of one: A = 0)."""
    o = torch.where(rewards.float() > cfg.positive_threshold, 1.0, -1.0)
    return o, rloo_advantage(o, group_index, torch.ones(o.shape[0], 1), cfg)[:, 0]


def oreal_precompute(cfg, pre: dict, response_mask: torch.Tensor, rewards: torch.Tensor, group_index: torch.Tensor,
                     dist=None) -> dict:
    """The objective's ``precompute`` hook (trainer/step.py, once per update): each row's sign (+1 cloned, −1
    penalized, 0 out of the loss) and coefficient, a_i/T+ or η·|A_i|/T−, and the head's 1/N, over the tokens the
    update trains (``response_mask``); under DDP (``dist``) the counts are every rank's over the world size."""
    device = response_mask.device
    o, adv = reshaped_outcomes(rewards.to(device), group_index.to(device), cfg)
    tokens = response_mask.float().sum(-1)
    live = tokens > 0
    pos, neg = live & (o > 0), live & (o < 0)
    local = torch.tensor([tokens[pos].sum().item(), tokens[neg].sum().item(), float(live.sum())], dtype=torch.float64)
    if dist is not None:  # a collective that every rank calls
        local = dist.all_reduce_sum(local) / dist.world_size
    t_pos, t_neg, n_seq = (max(float(v), 1e-12) for v in local)
    a_pos = adv if cfg.oreal_pos_mult_adv else torch.ones_like(adv)
    coef = torch.where(pos, a_pos / t_pos, torch.where(neg, cfg.oreal_neg_weight * adv.abs() / t_neg, 0.0))
    sign = torch.where(pos, 1.0, torch.where(neg, -1.0, 0.0))
    return {"oreal_sign": sign, "oreal_coef": coef, "oreal_rm_weight": live.float() / n_seq,
            "oreal_rm_label": (o > 0).float()}


def oreal_needs(cfg) -> tuple[str, ...]:
    # π_old for the ratio is the detached forward (ppo_epochs = 1); the head reads the update's hidden states.
    return ("hidden",) if cfg.oreal_token_rm else ()


def oreal_modules(cfg) -> dict:
    return {TOKEN_RM: make_token_rm} if cfg.oreal_token_rm else {}


# The head's scores w of one micro-batch, kept on its LossContext by the objective for the aux loss (the head
# runs once per micro-batch, not twice).
SCORES_KEY = "oreal_token_scores"


def _extras(ctx) -> tuple[torch.Tensor, torch.Tensor]:
    sign, coef = ctx.extras.get("oreal_sign"), ctx.extras.get("oreal_coef")
    if sign is None or coef is None:
        raise RuntimeError("loss=oreal needs the per-row signs and coefficients of its precompute hook "
                           "(oreal_precompute, called by trainer/step.py), but none were given")
    return sign, coef


def token_rm_loss(ctx, response_mask):
    """The head's auxiliary loss: BCE(σ(mean_t w_t), 1[correct]) per sequence, times 1/N of the batch (precompute),
    so the micro-batches sum to the mean over the update's sequences. Only the head gets its gradient."""
    if not ctx.cfg.oreal_token_rm:
        return torch.zeros((), device=response_mask.device), {}
    m = response_mask.float()
    w = ctx.extras.pop(SCORES_KEY, None)  # the objective's forward of the head on this micro-batch, if it ran
    if w is None:
        w = token_scores(ctx.modules, ctx.hidden, m.shape[1])
    w = w.float()
    seq_logit = (w * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    label, weight = ctx.extras["oreal_rm_label"].float(), ctx.extras["oreal_rm_weight"].float()
    bce = F.binary_cross_entropy_with_logits(seq_logit, label, reduction="none")
    with torch.no_grad():
        live = weight > 0
        acc = ((seq_logit > 0).float() == label).float()[live].mean().item() if bool(live.any()) else 0.0
        metrics = {"oreal/rm_bce": bce[live].mean().item() if bool(live.any()) else 0.0, "oreal/rm_acc": acc}
    return (bce * weight).sum(), metrics


# aux_loss: the token reward head's BCE (0 when oreal_token_rm is off).
@OBJECTIVES.register(NAME, needs=oreal_needs, modules=oreal_modules, precompute=oreal_precompute,
                     aux_loss=token_rm_loss, ignores_advantages=True)
def oreal_loss(log_prob, old_log_prob, advantages, response_mask, ctx):
    sign, coef = _extras(ctx)
    m = response_mask.to(log_prob.dtype)
    if ctx.cfg.oreal_token_rm:
        w = token_scores(ctx.modules, ctx.hidden, m.shape[1])
        ctx.extras[SCORES_KEY] = w  # with its graph: token_rm_loss (the aux loss, same ctx) trains the head on it
        w_pos, w_neg = token_weights(w, m)
        w_pos, w_neg = w_pos.to(log_prob.dtype), w_neg.to(log_prob.dtype)
    else:
        w_pos = w_neg = torch.ones_like(m)
    pos = (sign > 0).to(log_prob.dtype)[:, None] * m
    neg = (sign < 0).to(log_prob.dtype)[:, None] * m
    c = coef.to(log_prob.dtype)[:, None]
    ratio = torch.exp((log_prob - old_log_prob.detach()).clamp(max=20.0))  # 1 in value on the first (only) pass
    # Coefficients already hold 1/T± of the whole batch: summing the micro-batches gives the batch's loss.
    per_token = pos * c * w_pos * (-log_prob) + neg * c * w_neg * ratio
    loss = per_token.sum()
    with torch.no_grad():
        lp = log_prob.detach()

        def mean(x, on):
            return ((x * on).sum() / on.sum().clamp(min=1.0)).item()

        metrics = {"oreal/pos_token_frac": (pos.sum() / m.sum().clamp(min=1.0)).item(),
                   "oreal/pos_nll": mean(-lp, pos),  # down as the correct samples are cloned
                   "oreal/neg_log_prob": mean(lp, neg),  # down as the wrong samples are pushed away
                   "oreal/neg_coef_mean": mean(c.expand_as(m), neg),
                   "oreal/pos_weight_mean": mean(w_pos, pos), "oreal/neg_weight_mean": mean(w_neg, neg)}
    return loss, metrics


# rloo: a group estimator (the trainer then requires rollout.n >= 2); its advantages are not read. The authors'
# KL to the reference: coefficient 0.01, the non-negative k3 estimator, in the loss.
RECIPES.register(NAME)({"advantage": "rloo", "loss": NAME, "loss_agg_mode": "token-mean", "kl_coef": 0.01,
                        "kl_in": "loss", "kl_estimator": "k3"})
