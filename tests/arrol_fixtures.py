"""The ARRoL tests' fixtures (test_arrol.py, test_arrol_unbiased.py): the config, a stand-in policy, a tokenizer,
phase 1's scripted prefixes and a scripted two-phase backend, so a test knows every token of a round in advance."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from anabranch.config import load_config
from anabranch.rollout.base import Rollout

EOS, PAD = 3, 0


def arrol_cfg(*extra):
    return load_config(None, ["rollout.arrol.enabled=true", "rollout.n=2", "rollout.max_new_tokens=5",
                              "rollout.arrol.prune_at=2", *extra])


class FakeModel(torch.nn.Module):
    """Only what ARRoL's state reads of the policy: a device and config.hidden_size."""

    def __init__(self, hidden_size):
        super().__init__()
        self.config = SimpleNamespace(hidden_size=hidden_size)
        self.w = torch.nn.Parameter(torch.zeros(1))


class Tok:
    pad_token_id = PAD

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i in (EOS, PAD)))


def phase_one(prompts, n, ended=(2, 3)):
    """Two prompts ([pad, 1] and [2, 4]), n' = 4 prefixes each of at most 2 tokens, numbered from 5 on; the rows in
    ``ended`` stop at their second token (EOS), the rest are open (truncated). The default gives
    [5, 6], [7, 8], [9, EOS], [10, EOS], [11, 12], [13, 14], [15, 16], [17, 18]; ``ended=(2,)`` gives
    [5, 6], [7, 8], [9, EOS], [10, 11], [12, 13], [14, 15], [16, 17], [18, 19]. Sampler log-probs 0, -0.1, -0.2, ...
    in row-major order."""
    assert n == 4 and len(prompts) == 2
    resp, t = [], 5
    for row in range(8):
        resp.append([t, EOS] if row in ended else [t, t + 1])
        t += 1 if row in ended else 2
    return Rollout(prompt_ids=torch.tensor([[PAD, 1]] * 4 + [[2, 4]] * 4),
                   prompt_mask=torch.tensor([[0, 1]] * 4 + [[1, 1]] * 4),
                   response_ids=torch.tensor(resp), response_mask=torch.ones(8, 2, dtype=torch.long),
                   group_index=torch.arange(2).repeat_interleave(4), prompts=list(prompts),
                   completions=[""] * 8, truncated=torch.tensor([row not in ended for row in range(8)]),
                   sample_log_probs=-torch.arange(16, dtype=torch.float32).view(8, 2) / 10)


class ScriptedBackend:
    """Phase 1 from ``first(prompts, n)``; the k-th ``continue_ids`` call takes its continuation rows from
    ``scripts[k]`` (sequence i gets row i mod the script's length, cut to its budget, at log-probs -0.5, -0.6, ...);
    a call past the last script fails. Records ``generated`` (each generate's (n, max_new_tokens)) and ``continued``
    (each continue_ids call's (sequences, max_new, seed))."""

    eos_ids = [EOS]

    def __init__(self, scripts=(), first=phase_one):
        self.scripts, self.first = list(scripts), first
        self.generated, self.continued = [], []

    def generate(self, prompts, n, max_new_tokens=None):
        self.generated.append((n, max_new_tokens))
        return self.first(prompts, n)

    def continue_ids(self, sequences, max_new, seed=None):
        self.continued.append((sequences, max_new, seed))
        assert self.scripts, "continue_ids called more often than the test scripted"
        rows = self.scripts.pop(0)
        out = []
        for i, b in enumerate(max_new):
            ids = rows[i % len(rows)][:b]
            out.append((ids, [-0.5 - 0.1 * j for j in range(len(ids))]))
        return out
