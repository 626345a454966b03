"""A judge call the reward guard abandoned at its deadline stops at its next batch and frees the
shared judge, instead of holding it for the rest of its batches (the next step's call would wait)."""

import time

import torch

from anabranch.rewards import judge
from anabranch.rewards.guard import TIMED_OUT, guarded_call

BATCH_S = 0.5


class _Encoded(dict):
    def to(self, device):
        return self


class _Tokenizer:
    chat_template = None
    pad_token_id = 0

    def __call__(self, texts, **_):
        return _Encoded(input_ids=torch.zeros(len(texts), 2, dtype=torch.long))

    def batch_decode(self, ids, **_):
        return ["Score: 5"] * len(ids)


class _SlowJudge:
    batches = 0

    def generate(self, input_ids, **_):
        _SlowJudge.batches += 1
        time.sleep(BATCH_S)
        return torch.zeros(input_ids.shape[0], 3, dtype=torch.long)


def test_an_abandoned_judge_call_frees_the_judge_at_its_next_batch(monkeypatch):
    monkeypatch.setattr(judge, "_load", lambda path, device: (_SlowJudge(), _Tokenizer()))
    n = 40  # 5 batches of 8: 2.5 s of judging
    completions = [f"The sum is {i} because {i} = {i}." for i in range(n)]
    t0 = time.monotonic()
    res = guarded_call("judge", judge.judge_reward, (["q"] * n, completions),
                       {"model_path": "a-judge", "answer": ["5"] * n}, n, timeout=0.3, isolation="thread")
    assert res.failed and res.kind == TIMED_OUT
    assert judge._lock.acquire(timeout=10)
    waited = time.monotonic() - t0
    judge._lock.release()
    # Without the check the abandoned call holds the lock for all 5 batches (2.5 s).
    assert waited < 3 * BATCH_S and _SlowJudge.batches == 1, (waited, _SlowJudge.batches)
    # A call within its deadline still judges everything.
    _SlowJudge.batches = 0
    ok = guarded_call("judge", judge.judge_reward, (["q"] * 8, completions[:8]),
                      {"model_path": "a-judge", "answer": ["5"] * 8}, 8, timeout=10, isolation="thread")
    assert not ok.failed and ok.values == [0.5] * 8
