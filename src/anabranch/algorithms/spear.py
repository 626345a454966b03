"""SPEAR's self-imitation pieces: the reward baseline, the advantage recalibration, the coefficient schedule and the
covariance clipping of replayed tokens.

Paper: Yulei Qin, Xiaoyu Tan, Zhengbao He, Gang Li, Haojia Lin, Zongyi Li, Zihan Xu, Yuchen Shi, Siqi Cai,
Renting Rui, Shaofei Cai, Yuzheng Cai, Xuan Zhang, Sheng Ye, Ke Li, Xing Sun, "Learn the Ropes, Then Trust the
Wins: Self-imitation with Progressive Exploration for Agentic Reinforcement Learning", 2025, arXiv 2509.22601
(SPEAR; builds on self-imitation learning, Oh et al. 2018, "Self-Imitation Learning", arXiv 1806.05635).

Implemented (the buffer and where its rows train: trainer/spear_replay.py):

    admission   a row of step s enters the buffer when its own advantage is positive, A_i > 0 (and, for the
                p50 recalibration, R_i > b_s too), with its reward R_i and behaviour log-probs log π_s(o_t)
    baseline    H = per-group reward means μ_g (and stds σ_g) of the most recent steps, at most
                ``baseline_groups`` groups;  b = P50(μ_g ∈ H),  s_b = P50(σ_g ∈ H)
    recalibrate Â_i = R_i − b                 (``recalibration=p50``; ÷ (s_b + ε) with algorithm.norm_adv_by_std)
                Â_i = λ · A_i                 (``recalibration=decay``, λ = ``advantage_decay``)
                rows with Â_i ≤ 0 leave the buffer: they are no longer wins against the current policy's level
    replayed    L_SIL = agg( max(−Â_i c_k r_t, −Â_i c_k clip(r_t, 1−ε_low, 1+ε_high)) · keep_t ),
                r_t = π_θ(o_t) / π_s(o_t)  (the behaviour policy of the step that sampled the row)
    schedule    c_k = coef · (1 − cos(π k / T)) / 2 for step k ≤ T (``warmup_steps``), coef after
    Clip-Cov    keep_t = 0 on ⌊ρ·N⌋ tokens drawn among the replayed tokens with ω_low ≤ Cov_t ≤ ω_high that the
                PPO clip has not cut, Cov_t = (log π_θ(o_t) − mean)(Â_t − mean) over the replayed tokens
                (algorithms/cov_control.py: ``token_covariance``, ``clip_cov_keep``), 1 elsewhere
    replay_step joint (default): L = agg over this step's rows ∪ the replayed rows of their terms (one normalizer,
                e.g. token-mean: N_on + N_rep tokens), one optimizer step; c_k folded into the replayed Â;
                separate (the authors'): θ' = step(θ, ∇L_on), then θ'' = step(θ', ∇ c_k·L_SIL(θ')) with L_SIL's
                own normalizer (token-mean: N_rep), Â unscaled in Clip-Cov, no KL term, one epoch, no step at
                c_k = 0 (trainer/spear_update.py)
    tool reward R_i ← R_i + w_k · min(coef · n_i, cap),  w_k = (1 + cos(π k / T)) / 2 for k ≤ T, 0 after
                (T = ``tool_reward.decay_steps``; T = 0: w = 1), n_i the tool calls of row i (its tool-output blocks)

Confirmed (the abstract, and the authors' released code, TencentYoutuResearch/SPEAR, which we read: the replay
buffer class of verl-agent's hybrid trainer, dp_actor's replay pass, the run scripts and README): a buffer of
self-generated trajectories with positive advantage; their advantages recalibrated against a 50th-percentile
baseline of recent group reward means (std likewise when the run divides by the group std), rows no longer
positive dropped, or a multiplicative decay instead; rows older than ``tolerate_steps`` (5 in the scripts)
dropped; the replay loss is the run's PPO loss on the stored old log-probs, with Clip-Cov on the replayed tokens
only (their own ratio/bounds: README defaults 0.02, 1, 40) and the coefficient's rising half-cosine over
``max_replay_loss_steps`` (README 200); a baseline history of 10240 groups; buffer size 2048.

Also confirmed in that code: the replay pass is its own update after the on-policy mini-batches of each PPO epoch
(its own zero_grad, micro-batch backward passes and ``_optimizer_step``: the same gradient clipping), the run's
policy loss and ``loss_agg_mode`` over each replayed micro-batch's own response mask, the entropy bonus kept and the
KL loss left out (commented out), and the whole replay loss multiplied by c_k (so Clip-Cov sees the unscaled Â).
The tool-call reward (the retool recipe's reward function, ``use_toolcall_reward=cosine``,
``max_toolcall_steps=200`` in the run scripts): 0.1 per assistant turn holding a tool call, capped at 1, times
(cos(π k / T) + 1) / 2 while k ≤ T, 0 after; added to every response's score (its "posneg" variant).

Differences from the released code (**assumed** / adapted to this library):

* ``replay_step=joint`` (the default): the replayed rows join the step's one update (merged with its on-policy rows,
  ``c_k`` folded into their advantages, the run's ``loss_agg_mode`` over both; Clip-Cov sees c_k·Â), where the
  authors run the second optimizer step that ``replay_step=separate`` runs. ``separate`` differs from the code in
  that it takes one optimizer step on all replayed rows (theirs: one per ``ppo_mini_batch_size`` rows) once, after
  all ``ppo_epochs`` on-policy epochs (theirs: after each epoch), normalized over all replayed tokens of the step
  (theirs: per micro-batch, averaged over the accumulation);
* the tool-call count is the number of tool-output blocks in a response (this library's turns hold one call each);
  the Qwen3 scripts' variant (a flat w_k for any call on a positive-score row) is not implemented; the bonus is
  added after the batch is collected, so dynamic sampling's group filter does not see it (as DSDR's bonus);
* they replay ``replay_rows`` K of the oldest waiting rows whenever that many wait (RoRecomp's FIFO pop), where
  the code replays a random power-of-two subset of all waiting rows once 1.5× ``buffer_size`` wait and then
  empties the buffer;
* the baseline includes this step's groups (the code's lags by one step);
* the covariance mask is drawn once, before the update, with π_θ from a no-grad pass over the replayed rows
  (exact for ppo_epochs=1; with more epochs the tokens stay those of the first);
* the README's ``trajectory_score_threshold`` (1) is not read by the buffer code we read: admission is A_i > 0;
"""

from __future__ import annotations

import math

import torch

from anabranch.algorithms.cov_control import clip_cov_keep, token_covariance
from anabranch.algorithms.grpo import ppo_surrogate
from anabranch.algorithms.turn_spans import turn_counts, turn_index

RECALIBRATIONS = ("p50", "decay")
REPLAY_STEPS = ("joint", "separate")


def group_reward_stats(rewards: torch.Tensor, group_index: torch.Tensor) -> tuple[list[float], list[float]]:
    """Each group's reward mean and standard deviation (unbiased, 0 for a single row), groups in first-seen order."""
    rewards, groups = rewards.detach().float().cpu(), group_index.cpu().tolist()
    order = list(dict.fromkeys(groups))
    means, stds = [], []
    for g in order:
        r = rewards[torch.tensor([x == g for x in groups])]
        means.append(float(r.mean()))
        stds.append(float(r.std()) if r.numel() > 1 else 0.0)
    return means, stds


class BaselineHistory:
    """The recent groups' reward means and stds, newest step last; at most ``capacity`` groups (the oldest steps go
    first, the newest step always stays)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.steps: list[tuple[int, list[float], list[float]]] = []

    def add(self, step: int, means: list[float], stds: list[float]) -> None:
        if means:
            self.steps.append((step, list(means), list(stds)))
        while len(self.steps) > 1 and sum(len(m) for _, m, _ in self.steps) > self.capacity:
            self.steps.pop(0)

    def baseline(self) -> tuple[float, float] | None:
        """(b, s_b): the 50th percentiles (linear interpolation) of the held means and stds; None when empty."""
        means = [x for _, m, _ in self.steps for x in m]
        if not means:
            return None
        stds = [x for _, _, s in self.steps for x in s]
        return (float(torch.quantile(torch.tensor(means, dtype=torch.float64), 0.5)),
                float(torch.quantile(torch.tensor(stds, dtype=torch.float64), 0.5)))

    def state(self) -> list:
        return [list(s) for s in self.steps]

    def load(self, state: list) -> None:
        self.steps = [(int(s), list(m), list(d)) for s, m, d in state]


def recalibrated(rewards: torch.Tensor, stored: torch.Tensor, mode: str, baseline: tuple[float, float] | None,
                 decay: float, norm_by_std: bool, eps: float) -> torch.Tensor:
    """[k] Â_i of buffered rows (module docstring): ``rewards`` [k] their rewards, ``stored`` [k] their own step's
    advantages (row means over their trained tokens), ``baseline`` (b, s_b)."""
    if mode == "decay":
        return decay * stored.float()
    if baseline is None:  # no group seen yet: nothing can be called a win
        return torch.zeros_like(rewards, dtype=torch.float32)
    b, s = baseline
    adv = rewards.float() - b
    return adv / (s + eps) if norm_by_std else adv


def replay_coef(step: int, coef: float, warmup_steps: int) -> float:
    """c_k: coef · (1 − cos(π k / T)) / 2 for k ≤ T, coef after (T = 0: coef from the start)."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return coef
    return coef * (1.0 - math.cos(math.pi * step / warmup_steps)) / 2.0


def covariance_keep(log_prob: torch.Tensor, behaviour_lp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    algo_cfg, ratio: float, low: float, high: float) -> torch.Tensor:
    """[k, T] 0/1: Clip-Cov on the replayed tokens (module docstring). ``log_prob``: π_θ before the update,
    ``behaviour_lp``: π_s; a token the PPO clip already cuts (r_t against π_s) is not a candidate."""
    if ratio <= 0:
        return torch.ones_like(advantages)
    _, was_clipped, _ = ppo_surrogate(log_prob, behaviour_lp, advantages, algo_cfg)
    cov = token_covariance(log_prob, advantages, mask)
    return clip_cov_keep(cov, mask, was_clipped, ratio, low, high).to(advantages.dtype)


def tool_calls(response_mask: torch.Tensor, trained_mask: torch.Tensor) -> torch.Tensor:
    """[B] each row's tool calls: its blocks of tool output (response tokens the policy did not sample; each call,
    a refused one past rollout.max_tool_calls included, is answered by one such block, rollout/multi_turn.py)."""
    return turn_counts(turn_index((response_mask.bool() & ~trained_mask.bool()).long())).float()


def tool_reward_weight(step: int, decay_steps: int) -> float:
    """w_k: (1 + cos(π k / T)) / 2 for k ≤ T, 0 after (T = 0: no decay, 1)."""
    if decay_steps <= 0:
        return 1.0
    if step > decay_steps:
        return 0.0
    return (1.0 + math.cos(math.pi * step / decay_steps)) / 2.0


def tool_bonus(calls: torch.Tensor, coef: float, cap: float, weight: float) -> torch.Tensor:
    """[B] w_k · min(coef · n_i, cap)."""
    return weight * (coef * calls).clamp(max=cap)
