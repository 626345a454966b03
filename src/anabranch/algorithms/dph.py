"""DPH-RL's rehearsal loss: a mass-covering f-divergence to the initial policy, on its own samples.

Paper: Long Li, Zhijian Zhou, Jiaran Hao, Jason Klein Liu, Yanting Miao, Wei Pang, Xiaoyu Tan, Wei Chu,
Zhe Wang, Shirui Pan, Chao Qu, Yuan Qi, "The Choice of Divergence: A Neglected Key to Mitigating
Diversity Collapse in Reinforcement Learning with Verifiable Reward" (2025, arXiv 2509.07430; ICLR 2026).

An f-divergence written with its generator f (convex, f(1) = 0) is an expectation under one of the two
distributions only:

    D_f(π_θ ‖ π_0) = E_{y~π_0}[ f(u) ],   u = π_θ(y|x) / π_0(y|x).

So samples drawn once from the initial policy π_0, with their log π_0 stored, are all it needs: no
reference model is kept during training (the paper's "generator function" form). The two
mass-covering choices:

* forward KL, KL(π_0 ‖ π_θ):   f(u) = −log u,
  loss E_{π_0}[log π_0 − log π_θ], gradient −E_{π_0}[∇ log π_θ] (likelihood of π_0's samples:
  rehearsal as supervised replay).
* Jensen–Shannon (times 2, as the generator gives it):   f(u) = u·log u − (u + 1)·log((u + 1)/2),
  gradient E_{π_0}[ w·∇ log π_θ ] with w = u·f′(u) = u·log(2u / (u + 1)): zero where π_θ = π_0, negative
  (pull up) where π_θ fell below π_0, positive where it rose above it, bounded by log 2 from below.

As in the authors' code, the ratio is taken per token (u_t = π_θ(y_t|x, y_<t) / π_0(y_t|x, y_<t)) and
f(u_t) is averaged over all response tokens of the rehearsal mini-batch (token mean); the total loss
is ``L_RL + coef · mean_t f(u_t)``. For numerical safety the log-ratio is clamped to [−20, 20] before
it is exponentiated (an assumption of ours; irrelevant near π_θ ≈ π_0, where the loss lives).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from anabranch.range_checks import first_failed

DIVERGENCES = ("forward_kl", "js")
LOG_RATIO_CLAMP = 20.0


def generator(divergence: str, log_ratio: torch.Tensor) -> torch.Tensor:
    """f(u) elementwise, from log u = log π_θ − log π_0 (each token's log-ratio)."""
    if divergence == "forward_kl":
        return -log_ratio
    if divergence == "js":
        lr = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        u = lr.exp()
        # log((u + 1)/2) = softplus(log u) − log 2, stable for any u.
        return u * lr - (u + 1.0) * (F.softplus(lr) - math.log(2.0))
    raise ValueError(f"unknown DPH divergence {divergence!r}; expected one of {DIVERGENCES}")


def rehearsal_loss(log_prob: torch.Tensor, init_log_prob: torch.Tensor, mask: torch.Tensor,
                   divergence: str, total_tokens: float | None = None) -> tuple[torch.Tensor, dict]:
    """Σ_t mask·f(u_t) / total_tokens (the token mean of the rehearsal mini-batch) and its metrics.

    ``total_tokens`` is the token count of the whole rehearsal mini-batch when this call sees one
    micro-batch of it (the sum over micro-batches is then the mini-batch's token mean); None: this
    call's own count. The metrics are sums over this call's tokens (``dph/f_sum``,
    ``dph/log_ratio_sum``) so that micro-batches add up; the caller divides."""
    mask = mask.to(log_prob.dtype)
    log_ratio = log_prob - init_log_prob.to(log_prob.dtype)
    f = generator(divergence, log_ratio)
    n = mask.sum().clamp(min=1.0).item() if total_tokens is None else max(float(total_tokens), 1.0)
    loss = (f * mask).sum() / n
    with torch.no_grad():
        metrics = {"dph/f_sum": float((f * mask).sum()), "dph/log_ratio_sum": float((log_ratio * mask).sum())}
    return loss, metrics


def check_dph(cfg) -> str | None:
    """The first problem with ``algorithm.dph`` (a :class:`~anabranch.config.DPHConfig`), or None."""
    checks = [
        (isinstance(cfg.coef, (int, float)) and math.isfinite(cfg.coef) and cfg.coef >= 0, "coef",
         "must be a finite number >= 0 (0 turns DPH-RL's rehearsal off)"),
        (cfg.divergence in DIVERGENCES, "divergence", f"must be one of {DIVERGENCES}"),
        (cfg.samples_per_step >= 1, "samples_per_step", "must be >= 1 (rehearsal sequences per optimizer step)"),
        (cfg.buffer_prompts >= 0, "buffer_prompts", "must be >= 0 (0: pre-sample every training prompt)"),
        (cfg.buffer_n >= 1, "buffer_n", "must be >= 1 (samples per pre-sampled prompt)"),
        (1 <= cfg.keep_per_prompt <= max(cfg.buffer_n, 1), "keep_per_prompt",
         f"must be in [1, algorithm.dph.buffer_n={cfg.buffer_n}]"),
    ]
    if (error := first_failed(checks, "algorithm.dph", cfg)) is not None:
        return error
    return None
