"""UCAS: uncertainty-aware advantage shaping (``algorithm.ucas=true``).

Xie, Pan, Wu, Zhang, Fu, Gao, Zhou 2025, "Unlocking Exploration in RLVR: Uncertainty-aware
Advantage Shaping for Deeper Reasoning" (arXiv 2510.10649). Two stages on the advantages Â of the
estimator, both computed once per batch under the policy that sampled it (π_old), without gradient:

1. Response level. Each response's self-confidence is its summed per-token self-certainty
   (the KL from the uniform distribution, up to the constant log V; Kang et al. 2025)

       s_{i,t} = logsumexp_v(z_{i,t,v}/τ) − mean_v(z_{i,t,v}/τ)        c_i = Σ_t s_{i,t}

   z-scored within the prompt's group, ĉ_i = (c_i − mean_g c) / (std_g c + ε) (only centred with
   ``norm_adv_by_std=false``, as the GRPO advantage; 0 for a group of one), and

       Â'_{i,t} = Â_{i,t} · exp(−β₊ ĉ_i)   if Â_{i,t} > 0
       Â'_{i,t} = Â_{i,t} · exp(+β₋ ĉ_i)   otherwise

   so a correct but uncertain response (ĉ < 0) gets a larger positive advantage and a confident
   error (ĉ > 0) a more negative one. β₊ = ``ucas_beta_pos`` (0.25), β₋ = ``ucas_beta_neg`` (0.35).

2. Token level. The raw logit z_{i,t}[y_{i,t}] of each sampled token (before the temperature),
   min-max normalized over all trained tokens of the batch to ℓ_{i,t} ∈ [0, 1], is subtracted:

       Ã_{i,t} = Â'_{i,t} − λ ℓ_{i,t},     and where Â'_{i,t} > 0:  Ã_{i,t} = max(Ã_{i,t}, 0)

   (λ = ``ucas_token_coef``, 0.05): locally over-certain tokens get less push, and the clamp keeps a
   token of a positive response from turning negative. The term changes the advantage itself, so
   with any loss linear in Â (PPO clip, GRPO, CISPO) it is exactly the paper's update.

What the sources fix and what is assumed: the two-stage structure, the asymmetric exponential
weights and the clamp come from the paper's abstract and the authors' released code (read, not
copied), which also gives the defaults β₊ = 0.25, β₋ = 0.35, λ = 0.05, the summed self-certainty
(z-scored per group with the GRPO ε) and the batch-wide min-max of raw logits (all 0.5 when every
logit is equal). The method sections were not available. Assumed here: the sums and the min-max run
over trained tokens only (the released code also counted padding in the sum), and the shaping
applies to the advantages of any estimator, per token, by the sign of each token's Â.
"""

from __future__ import annotations

import torch

from anabranch.algorithms.grpo import group_stats

DEFAULTS = {"ucas_beta_pos": 0.25, "ucas_beta_neg": 0.35, "ucas_token_coef": 0.05}


def head_stats(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, temperature: float,
               chunk_rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Self-certainty ``s`` and raw target logit ``z[y]`` [B, R] from the hidden states [B, R, H]
    that predict ``targets`` [B, R]; the head runs on ``chunk_rows`` rows at a time so that at most
    that many rows of vocabulary-wide logits exist at once."""
    inv_temp = 1.0 / temperature if temperature > 0 else 1.0
    certainty, raw = [], []
    for start in range(0, hidden.shape[0], chunk_rows):
        z = head(hidden[start:start + chunk_rows]).float()
        raw.append(z.gather(-1, targets[start:start + chunk_rows, :, None]).squeeze(-1))
        z = z * inv_temp
        certainty.append(torch.logsumexp(z, -1) - z.mean(-1))
    return torch.cat(certainty), torch.cat(raw)


def minmax_normalize(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6, dist=None) -> torch.Tensor:
    """(x − min) / (max − min + ε) over the masked entries of the whole batch; 0.5 everywhere when
    they are all equal (no token is more certain than another); 0 off the mask. With ``dist`` (data
    parallel) min and max are over every rank's tokens, so the batch is the global one, as in one process."""
    live = mask > 0
    if dist is not None and dist.world_size > 1:
        # Every rank takes part in the reduction, also one with no trained token (±inf then).
        lo = x[live].min() if live.any() else torch.tensor(float("inf"), dtype=x.dtype)
        hi = x[live].max() if live.any() else torch.tensor(float("-inf"), dtype=x.dtype)
        lo, hi = dist.all_reduce_extrema(lo.detach().cpu(), hi.detach().cpu())
        lo, hi = lo.to(x.device, x.dtype), hi.to(x.device, x.dtype)
    elif live.any():
        lo, hi = x[live].min(), x[live].max()
    if not live.any():
        return torch.zeros_like(x)
    if torch.isclose(hi, lo):
        return torch.full_like(x, 0.5) * live
    return (x - lo) / (hi - lo + eps) * live


def ucas_advantages(advantages: torch.Tensor, certainty: torch.Tensor, raw_logit: torch.Tensor,
                    group_index: torch.Tensor, mask: torch.Tensor, *, beta_pos: float, beta_neg: float,
                    token_coef: float, norm_by_std: bool = True, eps: float = 1e-6,
                    dist=None) -> tuple[torch.Tensor, dict]:
    """Both UCAS stages on ``advantages`` [B, T]; ``certainty`` and ``raw_logit`` are per token [B, T]
    and ``mask`` the trained tokens. Returns the shaped advantages and metrics."""
    m = mask.to(advantages.dtype)
    conf = (certainty.to(advantages.dtype) * m).sum(-1)
    mean, std = group_stats(conf, group_index)
    z = conf - mean
    if norm_by_std:
        z = torch.where(std > 0, z / (std + eps), torch.zeros_like(z))  # a group of one: no comparison
    positive = advantages > 0
    factor = torch.where(positive, torch.exp(-beta_pos * z)[:, None], torch.exp(beta_neg * z)[:, None])
    response_level = advantages * factor
    shaped = response_level - token_coef * minmax_normalize(raw_logit.to(advantages.dtype), m, dist=dist)
    shaped = torch.where(response_level > 0, shaped.clamp(min=0.0), shaped) * m
    live = m.sum(-1) > 0
    metrics = {
        "ucas/confidence_mean": conf[live].mean().item() if live.any() else 0.0,
        "ucas/factor_pos_mean": factor[positive & (m > 0)].mean().item() if (positive & (m > 0)).any() else 1.0,
        "ucas/factor_neg_mean": factor[~positive & (m > 0)].mean().item() if (~positive & (m > 0)).any() else 1.0,
    }
    return shaped, metrics


def ucas_on(cfg) -> bool:
    return bool(getattr(cfg, "ucas", False))


def check_ucas(cfg) -> str | None:
    """The config error of UCAS's keys, or None (called by resolve.check_ranges)."""
    for key in ("ucas_beta_pos", "ucas_beta_neg", "ucas_token_coef"):
        value = getattr(cfg, key)
        if not (abs(value) < float("inf") and value >= 0):
            return f"algorithm.{key} must be a finite number >= 0 (got {value!r})"
    if not isinstance(cfg.ucas, bool):
        return f"algorithm.ucas must be true or false (got {cfg.ucas!r})"
    return None
