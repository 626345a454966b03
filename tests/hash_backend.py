"""A deterministic rollout backend for tests that compare rollouts across batch compositions (one process
against each rank's share, tests/test_distributed_more_methods.py): a prompt's samples and a context's
continuation depend on their own tokens only, not on the batch or the process's RNG."""

from __future__ import annotations

import json
import zlib

import torch

from anabranch.rollout.base import Rollout, left_padded, right_padded


class HashBackend:
    """A deterministic sampler: a response (or continuation) is drawn from a generator seeded by its context's
    tokens, so a prompt's samples are the same whatever else is in the batch, on any rank. Never writes EOS."""

    def __init__(self, tokenizer, max_new: int):
        self.tok, self.max_new, self.eos_ids = tokenizer, max_new, [tokenizer.eos_token_id]

    def draw(self, context: list[int], budget: int) -> list[int]:
        g = torch.Generator().manual_seed(zlib.crc32(json.dumps(context).encode()))
        length = int(torch.randint(2, self.max_new + 1, (1,), generator=g))
        return torch.randint(3, 90, (min(length, budget),), generator=g).tolist()

    def generate(self, prompts: list[str], n: int, **_) -> Rollout:
        ids = [self.tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        pid, pmask = left_padded(ids, self.tok.pad_token_id)
        resp = [self.draw(ids[g] + [-1 - k], self.max_new) for g in range(len(prompts)) for k in range(n)]
        rid, rmask = right_padded(resp, self.tok.pad_token_id)
        src = torch.arange(len(prompts)).repeat_interleave(n)
        return Rollout(prompt_ids=pid[src], prompt_mask=pmask[src], response_ids=rid, response_mask=rmask,
                       group_index=src, prompts=list(prompts), completions=[self.tok.decode(r) for r in resp],
                       truncated=torch.tensor([len(r) == self.max_new for r in resp]))

    def continue_ids(self, sequences: list[list[int]], budgets: list[int], **_):
        return [(self.draw(list(s), b), None) for s, b in zip(sequences, budgets)]
