"""RLTF-SD: distil the feedback-conditioned retries into the first turn (``algorithm.rltf_sd_coef > 0``).

Song, Chen, Tajwar, Munos, Pathak, Bagnell, Singh, Zanette 2026, "Expanding the Capabilities of
Reinforcement Learning via Text Feedback" (arXiv 2602.02482). With feedback available in training but not
at test time, the policy answers x₀ with y₀, gets feedback c₀, and answers again in x₁ = [x₀, y₀, c₀] with
y₁ ~ π(·|x₁). Self Distillation trains the *first-turn* policy on the second-turn samples, scored in the
first-turn context x₀, as an advantage-weighted regression without importance weight:

    ∇ℓ_SD = E_{y₁ ~ π(·|x₁)} [ A⁽⁰⁾(y₁) · ∇ log π_θ(y₁ | x₀) ]
    A⁽⁰⁾_i = R(x₀, y₁ⁱ) − (1/N)·Σ_j R(x₀, y₀ʲ)

the baseline being the mean *first-turn* reward of the prompt's N samples (a second-turn baseline would
vanish once feedback makes every retry right, while the first-turn policy is still poor); the ratio
π(y₁|x₀)/π(y₁|x₁) is dropped for its variance (the paper's bias-variance analysis).

Here the episodes are the "Try again" rollouts (``rollout.retry_turns=K``, rollout/retry_turns.py): one
response = attempt_1 · feedback · attempt_2 · ... Every attempt k >= 2 was written after feedback, so it
is a y₁; its tokens are the k-th maximal run of trained tokens (TRLOO's segmentation, ``turn_index``), and
its grade R is ``Rollout.attempt_correct`` (1 right, 0 wrong). The demonstration is ``prompt + attempt k``:
the prompt alone (x₀), without the earlier attempts or the feedback. The term added to the update is

    L_SD = λ · Σ_{(i,k)} Σ_{t ∈ attempt k of i} −w_{i,k} · log π_θ(y_t | x₀, y_<t) / N

with λ = ``algorithm.rltf_sd_coef``, N the number of distilled tokens in the batch (token mean, as HPT's
SFT term) and, by ``algorithm.rltf_sd_weighting``:

* ``advantage`` (the paper's): w_{i,k} = r_{i,k} − mean_{j ∈ group(i)} r_{j,1}; every retry attempt of the
  group trains, a right one up and a wrong one down, unless its weight is 0;
* ``correct``: w_{i,k} = 1 for a right attempt k >= 2, and wrong retries are not trained (SFT on the
  successful retries only).

Assumed (not in what we could read of the paper, whose exact loss we read from a summary of it): the token
mean over the distilled tokens (the paper's estimator sums the sequence's log-probs), the rollout
temperature for log π (as the RL loss's), and, for K > 2, every attempt after the first counting as a
second-turn sample with the same first-turn baseline. RLTF-FM (feedback modelling) is not implemented:
the "Try again" feedback is one fixed sentence, so predicting it teaches nothing.
"""

from __future__ import annotations

import dataclasses

import torch

from anabranch.algorithms.trloo import turn_index

WEIGHTINGS = ("advantage", "correct")


@dataclasses.dataclass
class Span:
    """Attempt ``attempt`` (1-based, >= 2) of row ``row``: its response columns and distillation weight."""

    row: int
    attempt: int
    columns: list[int]
    weight: float


def attempt_weights(attempt_correct: torch.Tensor, group_index: torch.Tensor, weighting: str) -> torch.Tensor:
    """[B, K] w_{i,k} for every attempt k >= 2 that was made (0 for attempt 1, attempts not made, and
    wrong retries under ``correct``); see the module docstring."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"algorithm.rltf_sd_weighting must be one of {', '.join(WEIGHTINGS)} (got {weighting!r})")
    grades = attempt_correct.to(torch.float32)
    made = attempt_correct >= 0
    retry = made.clone()
    retry[:, 0] = False  # the first attempt is the student's own sample, not a feedback-conditioned one
    if weighting == "correct":
        return torch.where(retry & (attempt_correct == 1), torch.ones_like(grades), torch.zeros_like(grades))
    _, group = torch.unique(group_index, return_inverse=True)
    n = int(group.max()) + 1 if group.numel() else 0
    first = grades[:, 0].clamp(min=0)  # every sample makes a first attempt; −1 (none) counts as wrong
    count = torch.zeros(n).index_add_(0, group, torch.ones_like(first))
    mean_first = torch.zeros(n).index_add_(0, group, first) / count
    w = grades.clamp(min=0) - mean_first[group][:, None]
    return torch.where(retry, w, torch.zeros_like(w))


def distill_spans(loss_mask: torch.Tensor, attempt_correct: torch.Tensor, group_index: torch.Tensor,
                  weighting: str) -> list[Span]:
    """The attempts to distil, with their response columns: the k-th run of ``loss_mask`` 1 is attempt k.
    A row whose runs do not match its graded attempts one to one (an attempt with no token) is skipped:
    its runs cannot be told apart safely."""
    weights = attempt_weights(attempt_correct, group_index, weighting)
    turns = turn_index(loss_mask)
    made = (attempt_correct >= 0).sum(-1)
    runs = turns.max(-1).values + 1
    spans = []
    for i, k0 in (weights != 0).nonzero().tolist():
        if int(runs[i]) != int(made[i]):
            continue
        cols = (turns[i] == k0).nonzero().flatten().tolist()
        if cols:
            spans.append(Span(i, k0 + 1, cols, float(weights[i, k0])))
    return spans


def weighted_nll(log_prob: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor,
                 total_tokens: float) -> tuple[torch.Tensor, float]:
    """(Σ −w_i·mask·log π / N, Σ −w_i·mask·log π): ``weight`` [B] per demonstration, N = ``total_tokens``
    (the whole batch's distilled tokens, so that micro-batches add up to the token mean). HPT's SFT NLL
    with a per-sequence weight (algorithms/hpt.py ``sft_nll``), the one implementation of both terms."""
    from anabranch.algorithms.hpt import sft_nll

    return sft_nll(log_prob, mask, total_tokens, weight=weight)


def check_rltf_sd(cfg) -> str | None:
    """Error text for invalid ``algorithm.rltf_sd_*`` keys (the algorithm section), else None."""
    c = cfg.rltf_sd_coef
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 <= c < float("inf"):
        return f"algorithm.rltf_sd_coef must be a finite number >= 0, the weight λ of the SD term (0: off; got {c!r})"
    if cfg.rltf_sd_weighting not in WEIGHTINGS:
        return (f"algorithm.rltf_sd_weighting must be one of {', '.join(WEIGHTINGS)} (advantage: the paper's "
                f"r − first-turn mean; correct: only right retries, weight 1; got {cfg.rltf_sd_weighting!r})")
    return None


def check_rltf_sd_config(cfg) -> None:
    """Whole-config refusal at load: RLTF-SD distils the retries of ``rollout.retry_turns >= 2`` episodes."""
    from anabranch.config import ConfigError

    if cfg.algorithm.rltf_sd_coef > 0 and cfg.rollout.retry_turns < 2:
        raise ConfigError(f"algorithm.rltf_sd_coef > 0 needs multi-attempt episodes to distil: set "
                          f"rollout.retry_turns >= 2 (got {cfg.rollout.retry_turns}) or algorithm.rltf_sd_coef=0")
