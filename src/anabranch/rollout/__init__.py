"""Generation backends; importing this package registers the built-in ones."""

from anabranch.rollout import hf_generate, vllm_backend  # noqa: F401  (vllm itself is imported lazily)
from anabranch.rollout.base import ROLLOUT_BACKENDS, Rollout

__all__ = ["ROLLOUT_BACKENDS", "Rollout"]
