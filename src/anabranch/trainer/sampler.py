"""Seeded prompt order over epochs, with a position that a checkpoint can store.

Each epoch's order is a permutation drawn from a generator seeded by (seed, epoch). Epoch 0 uses
``seed`` itself, so a run's first epoch (the README quick start's documented trajectory) is what
it has always been; later epochs use a seed derived from the pair by ``numpy.random.SeedSequence``.
A plain ``seed + epoch`` would make seed 0's second epoch seed 1's first, so runs with
neighbouring seeds would share prompt orders and not be independent repeats.
"""

from __future__ import annotations

import numpy as np
import torch


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of ``epoch`` for a run seeded ``seed``.

    SeedSequence hashes the pair (seed, epoch) into a 64-bit value: distinct pairs give unrelated
    seeds, with no arithmetic relation such as (s, e + 1) ~ (s + 1, e). ``seed % 2**64`` is the value
    torch itself uses for a negative seed (SeedSequence takes only non-negative entropy)."""
    if epoch == 0:
        return seed
    state = np.random.SeedSequence([seed % 2**64, epoch]).generate_state(1, dtype=np.uint64)
    return int(state[0])


class PromptSampler:
    def __init__(self, size: int, seed: int):
        self.size, self.seed = size, seed
        self.epoch, self.pos = 0, 0
        self._order = self._perm()

    def _perm(self) -> list[int]:
        g = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
        return torch.randperm(self.size, generator=g).tolist()

    def next(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos >= self.size:
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._perm()
            out.append(self._order[self.pos])
            self.pos += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._perm()
