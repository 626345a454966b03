"""Learned estimates of the log partition function log Z(x) for flow-balance objectives (FlowRL).

Both are plain ``nn.Module`` heads kept outside the policy: they are trained with it (the
optimizer gives them ``trainer.lr × lr_multiplier``), saved in ``trainer_state.pt`` under
``"modules"``, and never written into the Hugging Face export.
"""

from __future__ import annotations

import torch
from torch import nn


class LogZHead(nn.Module):
    """log Z_φ(x) from the last-layer hidden states of the prompt tokens, as in FlowRL's reference
    code (its ``ProjZ``): the mask-averaged prompt states go through two blocks of
    Linear(H, H) → GELU → LayerNorm(H) → Dropout(p), then Linear(H, 1).

    The hidden states are not detached, so the loss also trains the backbone through this head
    (the reference code leaves the detach commented out).
    """

    def __init__(self, hidden_size: int, dropout: float = 0.1, lr_multiplier: float = 1.0):
        super().__init__()
        blocks: list[nn.Module] = []
        for _ in range(2):
            blocks += [nn.Linear(hidden_size, hidden_size), nn.GELU(), nn.LayerNorm(hidden_size), nn.Dropout(dropout)]
        self.net = nn.Sequential(*blocks, nn.Linear(hidden_size, 1))
        self.lr_multiplier = lr_multiplier

    def forward(self, prompt_hidden: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
        """``prompt_hidden`` [B, P, H], ``prompt_mask`` [B, P] (0 on left padding) -> log Z [B]."""
        mask = prompt_mask.to(prompt_hidden.dtype)[..., None]
        pooled = (prompt_hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return self.net(pooled.to(self.net[0].weight.dtype)).squeeze(-1)


class ScalarLogZ(nn.Module):
    """One learned log Z for every prompt of the run (exact only when all prompts share Z)."""

    def __init__(self, lr_multiplier: float = 1.0):
        super().__init__()
        self.log_z = nn.Parameter(torch.zeros(()))
        self.lr_multiplier = lr_multiplier

    def forward(self, batch_size: int) -> torch.Tensor:
        return self.log_z.expand(batch_size)


def hidden_size_of(model_config) -> int:
    """The width of the last hidden states (the text model's, for multimodal configs)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    return int(text.hidden_size)
