"""SAFE's double soft-min critic for the PPO value path (``algorithm.vf_double_critic``).

Paper: Dipan Maity, "SAFE: Stable Alignment Finetuning with Entropy-Aware Predictive Control for RLHF" (2026,
arXiv:2602.04651; code: github.com/ryyzn9/SAFE, ``notebooks/mainD.py``); SAFE's KL gate is algorithms/safe.py.
Two value heads V1, V2 on the policy's last hidden state (V1 the PPO critic's head, algorithms/ppo_value.py; V2 a
second one, small and random at the start) and their soft minimum, a pessimistic value against over-estimation:

    V_soft = −α·log(½e^{−V1/α} + ½e^{−V2/α})        (α = ``vf_soft_min_alpha``, 0.3)

min(V1, V2) ≤ V_soft ≤ ½(V1 + V2); V_soft → min(V1, V2) as α → 0, and V1 = V2 = v gives v. The estimator reads
V_soft wherever it reads V: GAE's δ_t = r_t + γ·V_soft,t+1 − V_soft,t, R_t = Â_t + V_soft,t (ppo_value.gae; HiPER's
turn values too). Each head is regressed on the same R_t with the PPO critic's clipped loss against its own value
at rollout time:

    L_V = vf_coef · agg(ℓ(V1, V1_old) + ℓ(V2, V2_old)),   ℓ(V, V_old) = ½·max((V − R)², (V_old + clip(V − V_old, ±ε_v) − R)²)

(each head gets the gradient it would get alone). Metrics: ``value/v1_mean``, ``value/v2_mean``,
``value/soft_min_mean`` (the update's forward, over the trained tokens), ``value/head_gap`` (mean |V1 − V2|);
``critic/vf_loss`` is the heads' mean loss ½(ℓ1 + ℓ2), ``critic/value_mean`` V_soft's mean.

Confirmed (the abstract's and the paper summary's formula for V_soft, the released ``DoubleCritic``: two
independent heads, ``soft_min`` as above, α = 0.3 in its config): the soft-min and α, two independently
initialized heads on the same hidden state, the soft-min value as the critic's value (the advantage's baseline).
Different from the released code, on purpose (the method text beyond the abstract was not available to us):

* the released loss regresses V_soft itself on the target (Huber, δ = 0.5, the unclipped and the clipped V_soft's
  losses summed), so the heads learn only through the soft-min's weights; here each head is regressed on R
  (as clipped double-Q learning does: V_soft of two fitted heads is then pessimistic; V_soft fitted directly
  would not be), with the library's squared, max-clipped PPO loss (``vf_clip`` per head, against its own old value);
* the released critic is sequence-level (the last token's state, target the normalized reward, advantage
  r − V_soft); here V_soft is per token and enters the library's GAE (``gamma``, ``lam``);
* the released heads are two-layer MLPs behind a LayerNorm, both with PyTorch's default random init; here both
  are the library's linear head on the raw last hidden state (V1 zero-initialized as the single critic, so the
  option off changes nothing), V2 with a small random weight, w_j ~ N(0, (ε/√H)²), ε = :data:`SECOND_HEAD_INIT`
  (0.02), bias 0: its initial value has standard deviation ε·rms(h), about 0.04 on SmolLM2-135M's final-norm
  states (rms ≈ 2), a few hundredths of a 0/1 reward. Two zero heads would get identical gradients and never
  differ; PyTorch's default ``nn.Linear`` init (std 1/√(3H), so an initial |V2| ≈ 0.58·rms(h), about 0.5 on
  SmolLM2) would make the early V_soft ≈ min(0, V2) a pessimistic baseline whose size is set by the model's
  hidden-state norm, not by the returns. Not the authors' LayerNorm on the input either: V1 reads the raw state
  (it is the single critic), and a normalized input for V2 alone would make the two heads learn at different
  speeds (Adam moves each weight by about the learning rate, so a head's value moves with its input's scale).
  V2's draw uses a fixed seed (:data:`SECOND_HEAD_SEED`; the same on every DDP rank, the run's RNG untouched), not
  ``trainer.seed``: a ``modules`` factory receives the model's config and the algorithm section only
  (algorithms/registries.py), so a run's ``trainer.seed`` does not change the critic's init (V1 is 0 anyway);
* the released polyak target critic (τ = 0.05) is updated but never read, so it is left out.

Both heads are ``modules`` of the algorithm: in the optimizer (the head's ``vf_lr_multiplier``), in checkpoints
(state and Adam moments), and under DDP their gradients averaged over ranks as the single head's are
(``Distributed.clip_grad_norm``'s extra parameters).
"""

from __future__ import annotations

import math

import torch

from anabranch.algorithms.aggregation import masked_mean
from anabranch.algorithms.ppo_value import VALUE_HEAD, VALUE_HEAD2, ValueHead, clipped_value_error
from anabranch.algorithms.registries import ADVANTAGES
from anabranch.algorithms.safe import soft_min
from anabranch.range_checks import is_number
from anabranch.trainer.aux_head import seeded

SECOND_HEAD_SEED = 20260204  # V2's init: fixed, so every rank and every resume builds the same head
SECOND_HEAD_INIT = 0.02  # ε: V2's weights ~ N(0, (ε/√H)²), an initial V2 of std ε·rms(h) (module docstring)


def make_second_value_head(model_config, cfg) -> ValueHead:
    """V2: the critic's head with a small random weight (V1 starts at 0; module docstring), the soft-min's α on it
    (``response_values`` reads the heads alone)."""
    def build() -> ValueHead:
        size = model_config.hidden_size
        head = ValueHead(size, cfg.vf_lr_multiplier)  # bias 0, weight 0: V2 must start elsewhere
        torch.nn.init.normal_(head.proj.weight, std=SECOND_HEAD_INIT / math.sqrt(size))
        return head

    head = seeded(build, SECOND_HEAD_SEED)
    head.soft_min_alpha = float(cfg.vf_soft_min_alpha)
    return head


def head_values(modules: dict, hidden: torch.Tensor, response_len: int) -> torch.Tensor:
    """(V_soft, V1, V2) stacked on the last dimension, [B, R, 3], for the states each response token was sampled in."""
    h = hidden[:, -(response_len + 1):-1]
    v1, second = modules[VALUE_HEAD](h), modules[VALUE_HEAD2]
    v2 = second(h)
    return torch.stack([soft_min(v1, v2, second.soft_min_alpha), v1, v2], -1)


def double_value_loss(ctx, response_mask: torch.Tensor):
    """``vf_coef·agg(ℓ1 + ℓ2)`` (module docstring) from ``ctx.hidden``, the rollout's per-head values and the returns."""
    cfg = ctx.cfg
    old, returns = ctx.extras["value_heads"], ctx.extras["returns"]
    vals = head_values(ctx.modules, ctx.hidden, returns.shape[1])
    l1, c1 = clipped_value_error(vals[..., 1], old[..., 0], returns, cfg.vf_clip, response_mask)
    l2, c2 = clipped_value_error(vals[..., 2], old[..., 1], returns, cfg.vf_clip, response_mask)
    loss = cfg.vf_coef * ctx.aggregate(l1 + l2, response_mask)
    with torch.no_grad():
        m = response_mask
        metrics = {"critic/vf_loss": masked_mean(0.5 * (l1 + l2), m).item(), "critic/vf_clip_frac": 0.5 * (c1 + c2),
                   "critic/value_mean": masked_mean(vals[..., 0], m).item(),
                   "value/soft_min_mean": masked_mean(vals[..., 0], m).item(),
                   "value/v1_mean": masked_mean(vals[..., 1], m).item(),
                   "value/v2_mean": masked_mean(vals[..., 2], m).item(),
                   "value/head_gap": masked_mean((vals[..., 1] - vals[..., 2]).abs(), m).item()}
    return loss, metrics


def has_critic(cfg) -> bool:
    """Whether the advantage estimator reads the PPO value head (registered with it among its ``modules``)."""
    modules = ADVANTAGES.meta(cfg.advantage).get("modules", {})
    return VALUE_HEAD in (modules(cfg) if callable(modules) else modules)


def check_double_critic(cfg) -> str | None:
    """The refusal for ``vf_double_critic`` on an AlgorithmConfig, or None."""
    if not cfg.vf_double_critic:
        return None
    if not (is_number(cfg.vf_soft_min_alpha) and cfg.vf_soft_min_alpha > 0):
        return ("algorithm.vf_soft_min_alpha must be a finite number > 0, the soft-min's temperature α "
                f"(got {cfg.vf_soft_min_alpha!r})")
    if not (is_number(cfg.vf_coef) and cfg.vf_coef > 0):
        return ("algorithm.vf_double_critic=true trains its two value heads through the critic's loss, and "
                f"algorithm.vf_coef={cfg.vf_coef!r} gives them no gradient (they would stay at their init): set "
                "algorithm.vf_coef > 0 (0.5 is the default) or leave algorithm.vf_double_critic=false")
    if not has_critic(cfg):
        return (f"algorithm.vf_double_critic=true adds a second head to the PPO critic, but "
                f"algorithm.advantage={cfg.advantage!r} uses no value head: set algorithm.advantage=gae "
                "(algorithm.name=ppo) or leave algorithm.vf_double_critic=false")
    return None

