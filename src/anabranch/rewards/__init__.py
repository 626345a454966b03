"""Reward functions; importing this package registers the built-in ones."""

from anabranch.rewards import math_answer  # noqa: F401
from anabranch.rewards.compose import RewardSource, build_rewards, score
from anabranch.rewards.registry import REWARDS

__all__ = ["REWARDS", "RewardSource", "build_rewards", "score"]
