"""DAPO's treatment of long responses (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
Learning System at Scale").

- Soft overlong punishment, added to the reward, with L_max = ``rollout.max_new_tokens`` and
  L_cache = ``algorithm.overlong_buffer``:

      R_len(|y|) = 0                                   if |y| ≤ L_max − L_cache
                 = ((L_max − L_cache) − |y|) / L_cache  if L_max − L_cache < |y| ≤ L_max
                 = −1                                  if |y| > L_max

  scaled by ``overlong_penalty``.
- Overlong filtering: truncated responses (no EOS within L_max) are masked out of the loss.
"""

from __future__ import annotations

import dataclasses

import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    lengths = lengths.to(torch.float32)
    if buffer <= 0:
        return torch.zeros_like(lengths)
    start = max_len - buffer
    pen = ((start - lengths) / buffer).clamp(max=0.0)
    pen = torch.where(lengths > max_len, torch.full_like(pen, -1.0), pen.clamp(min=-1.0))
    return factor * pen


def filter_overlong(rollout, enabled: bool):
    """A copy of ``rollout`` whose truncated rows have an empty response mask (no loss)."""
    if not enabled or not bool(rollout.truncated.any()):
        return rollout
    keep = (~rollout.truncated).to(rollout.response_mask.dtype)[:, None]
    return dataclasses.replace(rollout, response_mask=rollout.response_mask * keep)
