"""PPO's critic: a value head on the policy's last hidden state, GAE, and the clipped value loss.

GAE (Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
Estimation"), per token with per-token rewards r_t and values V_t (V = 0 after the last token):

    δ_t = r_t + γ V_{t+1} − V_t,    Â_t = Σ_l (γλ)^l δ_{t+l},    R_t = Â_t + V_t

Â is then whitened over the batch's response tokens; R_t is the critic's target. The critic loss
with value clipping (PPO2; Schulman et al. 2017) is

    L_V = vf_coef · ½ · max((V − R)², (V_old + clip(V − V_old, −ε_v, ε_v) − R)²)

aggregated like the policy loss. V_t is read from the hidden state of the token *before*
response token t (the state that token t was sampled in).

With ``algorithm.vf_double_critic`` (SAFE's double soft-min critic, algorithms/double_critic.py) a second head
V2 is built beside V, GAE reads V_soft = −α·log(½e^{−V1/α} + ½e^{−V2/α}), and each head gets the loss above
toward the same R; off, nothing here changes (one dict lookup per call).
"""

from __future__ import annotations

import torch
from torch import nn

from anabranch.algorithms.advantages import token_level_rewards, whiten
from anabranch.algorithms.aggregation import masked_mean
from anabranch.algorithms.registries import ADVANTAGES, RECIPES

VALUE_HEAD = "value"
VALUE_HEAD2 = "value2"  # the double critic's second head (algorithms/double_critic.py), only with vf_double_critic


class ValueHead(nn.Module):
    """V(s) = w·h + b on the last-layer hidden state; starts at V = 0."""

    def __init__(self, hidden_size: int, lr_multiplier: float = 1.0):
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)
        self.lr_multiplier = lr_multiplier  # read by the optimizer builder

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden.to(self.proj.weight.dtype)).squeeze(-1)


def make_value_head(model_config, cfg) -> ValueHead:
    return ValueHead(model_config.hidden_size, cfg.vf_lr_multiplier)


def value_modules(cfg) -> dict:
    """The critic's heads (registered as ``modules=``): V, and V2 with ``vf_double_critic``."""
    if not cfg.vf_double_critic:
        return {VALUE_HEAD: make_value_head}
    from anabranch.algorithms.double_critic import make_second_value_head  # it imports this module

    return {VALUE_HEAD: make_value_head, VALUE_HEAD2: make_second_value_head}


def response_values(modules: dict, hidden: torch.Tensor, response_len: int) -> torch.Tensor:
    """Values [B, R] of the states in which each response token was sampled (the double critic's V_soft)."""
    if VALUE_HEAD2 in modules:
        from anabranch.algorithms.double_critic import head_values

        return head_values(modules, hidden, response_len)[..., 0]
    return modules[VALUE_HEAD](hidden[:, -(response_len + 1):-1])


def rollout_values(modules: dict, hidden: torch.Tensor, response_len: int) -> torch.Tensor:
    """What the rollout's no-grad pass keeps: V [B, R], or the double critic's (V_soft, V1, V2) [B, R, 3] (each
    head's own old value clips its loss); :func:`split_rollout_values` turns it into the estimator's inputs."""
    if VALUE_HEAD2 in modules:
        from anabranch.algorithms.double_critic import head_values

        return head_values(modules, hidden, response_len)
    return response_values(modules, hidden, response_len)


def rollout_value_columns(modules: dict | None) -> tuple:
    """The trailing shape of :func:`rollout_values`: () or (3,)."""
    return (3,) if modules and VALUE_HEAD2 in modules else ()


def split_rollout_values(values: torch.Tensor) -> dict:
    """``{"values": V}``; the double critic's adds ``"value_heads"`` [B, R, 2] (V1, V2) for its loss."""
    if values.dim() == 2:
        return {"values": values}
    return {"values": values[..., 0].contiguous(), "value_heads": values[..., 1:].contiguous()}


def gae(token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
        gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [B, T] and zero outside the response mask. The next state of a
    token is the next *masked* token: tool outputs inside a response (mask gaps) are not steps of
    the policy, so δ_t bootstraps from the value at the policy's next token."""
    mask = response_mask.to(torch.float32)
    values = values * mask
    rewards = token_rewards * mask
    adv = torch.zeros_like(mask)
    last = torch.zeros(mask.shape[0])
    next_v = torch.zeros(mask.shape[0])
    for t in reversed(range(mask.shape[1])):
        on = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        step = delta + gamma * lam * last
        adv[:, t] = step
        last = torch.where(on, step, last)
        next_v = torch.where(on, values[:, t], next_v)
    adv = adv * mask
    return adv, (adv + values) * mask


def clipped_value_error(v: torch.Tensor, old: torch.Tensor, returns: torch.Tensor, clip: float,
                        response_mask: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(½·max((V − R)², (V_old + clip(V − V_old, ±clip) − R)²) per token, the clipped share); clip 0: ½(V − R)²."""
    err = (v - returns) ** 2
    if clip > 0:
        v_clip = old + (v - old).clamp(-clip, clip)
        err_clip = (v_clip - returns) ** 2
        return 0.5 * torch.maximum(err, err_clip), masked_mean((err_clip > err).float(), response_mask).item()
    return 0.5 * err, 0.0


def value_loss(ctx, response_mask):
    """The clipped critic loss above, from ``ctx.hidden`` and the rollout's values and returns."""
    if VALUE_HEAD2 in ctx.modules:  # SAFE's double critic: each head's own clipped loss
        from anabranch.algorithms.double_critic import double_value_loss

        return double_value_loss(ctx, response_mask)
    cfg = ctx.cfg
    old, returns = ctx.extras["values"], ctx.extras["returns"]
    v = response_values(ctx.modules, ctx.hidden, old.shape[1])
    loss_mat, clip_frac = clipped_value_error(v, old, returns, cfg.vf_clip, response_mask)
    loss = cfg.vf_coef * ctx.aggregate(loss_mat, response_mask)
    with torch.no_grad():
        metrics = {"critic/vf_loss": masked_mean(loss_mat, response_mask).item(),
                   "critic/vf_clip_frac": clip_frac,
                   "critic/value_mean": masked_mean(v, response_mask).item()}
    return loss, metrics


@ADVANTAGES.register("gae", needs=("values", "hidden"), modules=value_modules, aux_loss=value_loss)
def gae_advantage(rewards, group_index, response_mask, cfg, values=None, token_rewards=None, **_):
    """GAE with a learned value head, whitened over the batch (see the module docstring).

    Returns ``(advantages, {"returns": R})``; the trainer hands ``values`` and ``returns`` to the
    critic loss through ``ctx.extras``.
    """
    mask = response_mask.to(torch.float32)
    if values is None:
        raise ValueError("the gae estimator needs per-token values from the value head")
    if token_rewards is None:
        token_rewards = token_level_rewards(rewards, mask)
    adv, returns = gae(token_rewards, values.to(torch.float32), mask, cfg.gamma, cfg.lam)
    return whiten(adv, mask), {"returns": returns}


RECIPES.register("ppo")({"advantage": "gae", "loss": "ppo_clip", "loss_agg_mode": "token-mean",
                         "ppo_epochs": 2, "kl_in": "reward", "kl_coef": 0.01, "kl_estimator": "k1",
                         "lam": 0.95, "gamma": 1.0})
