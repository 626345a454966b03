"""Reward functions; importing this package registers the built-in ones."""

from anabranch.rewards import (  # noqa: F401 - registration
    code_exec, format_reward, intrinsic, judge, length, majority_vote, math_answer, noisy_verifier,
    random_reward, reasoning_gym_score, rlpr,
)
from anabranch.rewards import label_refinement  # noqa: F401,E402 - OLR (registration)
from anabranch.rewards import laser  # noqa: F401,E402 - LASER / LASER-D (registration)
from anabranch.rewards import retry_reward  # noqa: F401,E402 - UFO's retry_turns reward (registration)
from anabranch.rewards import prm  # noqa: F401,E402 - process reward model for PRM-Clip/Delta (registration)
from anabranch.rewards import exploration  # noqa: F401,E402 - RLSP's exploration reward (registration)
from anabranch.rewards import gen_prm  # noqa: F401,E402 - CAPO's generative PRM critic (registration)
from anabranch.rewards import pairwise_judge  # noqa: F401,E402 - pairwise generative judge (registration)
from anabranch.rewards import domain_router  # noqa: F401,E402 - Guru's per-domain verifier routing (registration)
from anabranch.rewards import ssrl_format  # noqa: F401,E402 - SSRL's format and exact-match rewards (registration)
from anabranch.rollout import environments  # noqa: F401,E402 - env_return / env_solved (registration)
from anabranch.rewards.compose import RewardSource, Scored, build_rewards, score, score_detailed
from anabranch.rewards.guard import RewardError, RewardOutput
from anabranch.rewards.registry import REWARDS

__all__ = ["REWARDS", "RewardError", "RewardOutput", "RewardSource", "Scored", "build_rewards", "score",
           "score_detailed"]
