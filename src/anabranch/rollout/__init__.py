"""Generation backends; importing this package registers the built-in ones."""

from anabranch.rollout import hf_generate  # noqa: F401
from anabranch.rollout.base import ROLLOUT_BACKENDS, Rollout

__all__ = ["ROLLOUT_BACKENDS", "Rollout"]
