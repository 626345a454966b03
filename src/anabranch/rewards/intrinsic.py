"""Intrinsic (label-free) rewards from the policy's own confidence.

As compared in "How Far Can Unsupervised RLVR Scale LLM Training?" (2025): rewards computed from
the model's token distributions alone, which improve accuracy early and then collapse (the
policy learns to be confident rather than right), so the trainer logs true accuracy alongside
them whenever the task has labels (add a correctness reward with weight 0, e.g.
``reward.functions=[self_certainty, math_verify*0]``).

* ``self_certainty`` — r = (1/|y|) Σ_t KL(U ‖ p_t) (Zhao et al. 2025, "Learning to Reason without
  External Rewards", Intuitor).
* ``neg_entropy`` — r = −(1/|y|) Σ_t H(p_t) (token-level entropy minimization: Agarwal et al. 2025,
  "The Unreasonable Effectiveness of Entropy Minimization in LLM Reasoning"; Prabhudesai et al.
  2025, "Maximizing Confidence Alone Improves Reasoning").
* ``trajectory_log_prob`` — r = (1/|y|) Σ_t log p_t(y_t), the per-token log-likelihood of the
  sampled answer (trajectory-level entropy minimization, Agarwal et al. 2025).

The statistics come from ``rewards/token_stats.py``; the trainer computes them (one no-grad
forward) only when one of these rewards is configured. Called without them, these rewards raise.
"""

from __future__ import annotations

from anabranch.rewards.registry import REWARDS

_META = dict(needs_token_stats=True, needs_fields=("self_certainty", "token_entropy", "mean_log_prob"))


def _need(values, name):
    if values is None:
        raise ValueError(f"the {name} reward needs per-token statistics that only the trainer computes")
    return [float(v) for v in values]


@REWARDS.register("self_certainty", **_META)
def self_certainty_reward(prompts, completions, self_certainty=None, **_):
    return _need(self_certainty, "self_certainty")


@REWARDS.register("neg_entropy", **_META)
def neg_entropy_reward(prompts, completions, token_entropy=None, **_):
    return [-v for v in _need(token_entropy, "neg_entropy")]


@REWARDS.register("trajectory_log_prob", **_META)
def trajectory_log_prob_reward(prompts, completions, mean_log_prob=None, **_):
    return _need(mean_log_prob, "trajectory_log_prob")
