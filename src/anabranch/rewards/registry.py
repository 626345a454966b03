"""The reward-function registry.

A reward function is ``fn(prompts, completions, **row_fields) -> list[float]``: ``prompts`` and
``completions`` are aligned lists (one entry per sampled completion), and each row field of the
task (``answer``, ...) is passed as a list aligned with them. A user's own function is named in
the config as ``package.module:function``.
"""

from anabranch.registry import Registry

REWARDS: Registry = Registry("reward function")
