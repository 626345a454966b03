"""PPO's critic: a value head on the policy's last hidden state, GAE, and the clipped value loss.

GAE (Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
Estimation"), per token with per-token rewards r_t and values V_t (V = 0 after the last token):

    δ_t = r_t + γ V_{t+1} − V_t,    Â_t = Σ_l (γλ)^l δ_{t+l},    R_t = Â_t + V_t

Â is then whitened over the batch's response tokens; R_t is the critic's target. The critic loss
with value clipping (PPO2; Schulman et al. 2017) is

    L_V = vf_coef · ½ · max((V − R)², (V_old + clip(V − V_old, −ε_v, ε_v) − R)²)

aggregated like the policy loss. V_t is read from the hidden state of the token *before*
response token t (the state that token t was sampled in).
"""

from __future__ import annotations

import torch
from torch import nn

from anabranch.algorithms.advantages import token_level_rewards, whiten
from anabranch.algorithms.aggregation import masked_mean
from anabranch.algorithms.registries import ADVANTAGES, RECIPES

VALUE_HEAD = "value"


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


def response_values(modules: dict, hidden: torch.Tensor, response_len: int) -> torch.Tensor:
    """Values [B, R] of the states in which each response token was sampled."""
    return modules[VALUE_HEAD](hidden[:, -(response_len + 1):-1])


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


def value_loss(ctx, response_mask):
    """The clipped critic loss above, from ``ctx.hidden`` and the rollout's values and returns."""
    cfg = ctx.cfg
    old, returns = ctx.extras["values"], ctx.extras["returns"]
    v = response_values(ctx.modules, ctx.hidden, old.shape[1])
    err = (v - returns) ** 2
    if cfg.vf_clip > 0:
        v_clip = old + (v - old).clamp(-cfg.vf_clip, cfg.vf_clip)
        err_clip = (v_clip - returns) ** 2
        loss_mat = 0.5 * torch.maximum(err, err_clip)
        clip_frac = masked_mean((err_clip > err).float(), response_mask).item()
    else:
        loss_mat, clip_frac = 0.5 * err, 0.0
    loss = cfg.vf_coef * ctx.aggregate(loss_mat, response_mask)
    with torch.no_grad():
        metrics = {"critic/vf_loss": masked_mean(loss_mat, response_mask).item(),
                   "critic/vf_clip_frac": clip_frac,
                   "critic/value_mean": masked_mean(v, response_mask).item()}
    return loss, metrics


@ADVANTAGES.register("gae", needs=("values", "hidden"), modules={VALUE_HEAD: make_value_head},
                     aux_loss=value_loss)
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
