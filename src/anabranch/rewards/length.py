"""Length shaping rewards.

Length n is the completion's token count when the trainer passes ``response_length`` (it does
for training rollouts), else its character count.

``overlong_penalty`` — DAPO's soft overlong punishment (Yu et al. 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale", eq. 13), with L_max = ``max_length`` and cache
L_cache = ``cache_length``:

  R(n) = 0                              if n ≤ L_max − L_cache
       = ((L_max − L_cache) − n) / L_cache  if L_max − L_cache < n ≤ L_max
       = −1                             if n > L_max

``target_length`` — distance to a target length, as in L1 (Aggarwal & Welleck 2025, "L1:
Controlling How Long A Reasoning Model Thinks With Reinforcement Learning"), scaled to [−1, 0]:

  R(n) = −min(1, |n − n_target| / n_target)
"""

from __future__ import annotations

from anabranch.rewards.registry import REWARDS


def response_lengths(completions, response_length) -> list[float]:
    """Each completion's length n: its token count from the trainer's ``response_length`` field when given
    (training rollouts), else its character count (shared by the length-based rewards)."""
    if response_length is not None:
        return [float(n) for n in response_length]
    return [float(len(c)) for c in completions]


def soft_overlong(n: float, max_length: float, cache_length: float) -> float:
    start = max_length - cache_length
    if n <= start:
        return 0.0
    if n <= max_length:
        return (start - n) / cache_length
    return -1.0


@REWARDS.register("overlong_penalty")
def overlong_penalty(prompts, completions, response_length=None, max_length: int = 32,
                     cache_length: int = 8, **_):
    if not 0 < cache_length <= max_length:
        raise ValueError(f"overlong_penalty needs 0 < cache_length <= max_length (got {cache_length}, {max_length})")
    return [soft_overlong(n, max_length, cache_length) for n in response_lengths(completions, response_length)]


@REWARDS.register("target_length")
def target_length(prompts, completions, response_length=None, target: int = 16, **_):
    if target <= 0:
        raise ValueError(f"target_length needs target > 0 (got {target})")
    return [-min(1.0, abs(n - target) / target) for n in response_lengths(completions, response_length)]
