"""RoRecomp (algorithms/rorecomp.py, trainer/rorecomp.py): the split, the replay buffer, refusals, a run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from anabranch import load_config, train
from anabranch.algorithms.rorecomp import priority_mask, side_count
from anabranch.config import Config, ConfigError
from anabranch.rewards.registry import REWARDS
from anabranch.rollout.base import Rollout
from anabranch.trainer.rorecomp import Chunk, ReplayBuffer, RoRecomp, check_config, merge

from test_train_e2e import tiny_overrides

if "rorecomp_test_parity" not in REWARDS:
    @REWARDS.register("rorecomp_test_parity", correctness=True)
    def rorecomp_test_parity(prompts, completions, answer, **_):
        # About half right whatever the length: the groups are mixed, so both sides of the split exist.
        return [float(sum(map(ord, c)) % 2 == 0) for c in completions]


def test_split_on_a_hand_built_group():
    # group 0: correct rows 0 (len 9), 1 (len 3), 2 (len 5); wrong rows 3 (len 2), 4 (len 8), 5 (len 6)
    # group 1: all correct, lengths 4 4 1 7 -> k = max(1, floor(0.5*4)) = 2 shortest: rows 8 (1), 6 (4, first of ties)
    correct = torch.tensor([1, 1, 1, 0, 0, 0, 1, 1, 1, 1])
    lengths = torch.tensor([9, 3, 5, 2, 8, 6, 4, 4, 1, 7])
    groups = torch.tensor([0] * 6 + [1] * 4)
    got = priority_mask(correct, lengths, groups, 0.5)
    # group 0: k(3) = max(1, floor(1.5)) = 1 -> shortest correct row 1, longest wrong row 4
    assert torch.nonzero(got).flatten().tolist() == [1, 4, 6, 8]
    assert torch.nonzero(priority_mask(correct, lengths, groups, 0.7)).flatten().tolist() == [1, 2, 4, 5, 6, 8]
    assert [side_count(m, 0.5) for m in (0, 1, 2, 3, 4)] == [0, 1, 1, 1, 2]
    assert side_count(10, 0.3) == 3  # 0.3·10 in floats is 2.9999…: still 3


def _chunk(born, n, width=3, rewards=None):
    r = Rollout(prompt_ids=torch.ones(n, 2, dtype=torch.long), prompt_mask=torch.ones(n, 2, dtype=torch.long),
                response_ids=torch.arange(n * width).view(n, width), response_mask=torch.ones(n, width, dtype=torch.long),
                group_index=torch.zeros(n, dtype=torch.long), prompts=["p"], completions=[f"{born}:{i}" for i in range(n)],
                truncated=torch.zeros(n, dtype=torch.bool))
    adv = torch.full((n, width), float(born))
    return Chunk(born, r, adv, {"old_log_prob": -adv}, torch.zeros(n) if rewards is None else rewards)


def test_buffer_cap_age_and_fifo_pop():
    buf = ReplayBuffer(capacity=5, max_age=2)
    buf.add(_chunk(1, 3))
    buf.add(_chunk(2, 4))  # 7 rows > cap 5: the two oldest of step 1 go
    assert len(buf) == 5 and [c.rollout.completions for c in buf.chunks][0] == ["1:2"]
    out = buf.pop(2)  # oldest first, across chunks
    assert [x for c in out for x in c.rollout.completions] == ["1:2", "2:0"]
    assert len(buf) == 3
    assert buf.expire(4) == 0 and buf.expire(5) == 3 and len(buf) == 0  # born 2, max_age 2: dropped at step 5
    m = merge([_chunk(1, 2, width=2), _chunk(3, 1, width=4)])  # responses re-right-padded, per-token tensors too
    assert m.rollout.response_ids.shape == (3, 4) and m.advantages.tolist()[0] == [1.0, 1.0, 0.0, 0.0]
    assert m.precomputed["old_log_prob"].shape == (3, 4) and m.rollout.group_index.tolist() == [0, 0, 1]


class _Batch:
    def __init__(self, rollout, total):
        self.rollout, self.total, self.per_source, self.metrics = rollout, total, {}, {}


def test_step_trains_priority_then_replays_remaining_rows_later():
    cfg = Config()
    cfg.algorithm.rorecomp_fraction, cfg.algorithm.rorecomp_compensation_rows = 0.5, 4
    rr = RoRecomp(cfg, sources=[])
    lengths = [9, 3, 5, 2, 8, 6]
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])

    def step(s):
        ch = _chunk(s, 6, width=10, rewards=rewards)
        ch.rollout.response_mask = (torch.arange(10)[None] < torch.tensor(lengths)[:, None]).long()
        adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])[:, None].expand(6, 10).clone()
        batch = _Batch(ch.rollout, rewards.tolist())
        out = rr.step(batch, ch.rollout, adv, {"old_log_prob": torch.zeros(6, 10)}, rewards, s)
        return out, batch.metrics

    out, m = step(1)  # priority: row 1 (short correct), row 4 (long wrong); 4 rows wait
    assert out.rollout.completions == ["1:1", "1:4"] and out.advantages[:, 0].tolist() == [1.0, -1.0]
    assert m["rorecomp/compensation_rows"] == 0 and m["rorecomp/buffer_rows"] == 4
    assert m["rorecomp/correct_length_gap"] == pytest.approx((9 + 3 + 5) / 3 - 3)
    assert m["rorecomp/wrong_length_gap"] == pytest.approx(8 - (2 + 8 + 6) / 3)
    out, m = step(2)  # 4 rows were waiting: step 1's remaining rows train now, with their own advantages
    assert out.rollout.completions == ["2:1", "2:4", "1:0", "1:2", "1:3", "1:5"]
    assert out.advantages[:, 0].tolist() == [1.0, -1.0, 1.0, 1.0, -1.0, -1.0]
    assert m["rorecomp/compensation_rows"] == 4 and m["rorecomp/buffer_rows"] == 4
    # rows without advantage never enter the buffer
    out, m = step(3)
    assert len(rr.buffer) == 4
    # checkpoint / resume: the state restores the same rows
    fresh = RoRecomp(cfg, sources=[])
    fresh.load_state_dict(rr.state_dict())
    assert [c.rollout.completions for c in fresh.buffer.chunks] == [c.rollout.completions for c in rr.buffer.chunks]


@pytest.mark.parametrize("key,value,match", [
    ("algorithm.rorecomp_fraction", 1.0, "must be in"),
    ("rollout.n", 2, "rollout.n >= 4"),
    ("algorithm.name", "flowrl", "unbiased"),
    ("algorithm.loss", "fdpg", "unbiased"),
    ("algorithm.guide.enabled", True, "guide"),
    ("rollout.extra_rollouts", "cure", "extra_rollouts"),
    ("algorithm.rorecomp_compensation_rows", 4096, "exceeds"),
])
def test_refusals(key, value, match):
    cfg = Config()
    cfg.algorithm.rorecomp_fraction = 0.5
    node = cfg
    *path, last = key.split(".")
    for p in path:
        node = getattr(node, p)
    setattr(node, last, value)
    with pytest.raises(ConfigError, match=match):
        check_config(cfg)


def test_buffer_keys_refused_while_off_and_off_costs_nothing(tiny_model_dir, write_jsonl, tmp_path):
    assert RoRecomp.create(Config()) is None
    data = write_jsonl([{"prompt": "x", "answer": "7"}])
    with pytest.raises(ConfigError, match="rorecomp_buffer_size.*rorecomp_fraction > 0"):
        load_config(None, tiny_overrides(tiny_model_dir, data, tmp_path, **{"algorithm.rorecomp_buffer_size": 8}))


def test_tiny_run_priority_is_shorter_correct_and_longer_wrong_and_resumes(tiny_model_dir, write_jsonl, tmp_path):
    data = write_jsonl([{"prompt": f"Q{i}: say seven", "answer": "7"} for i in range(16)])
    base = {"trainer.eval_before": False, "trainer.eval_after": False, "trainer.save_final": False,
            "trainer.steps": 4, "rollout.n": 8, "rollout.max_new_tokens": 6, "reward.isolation": "none",
            "reward.functions": "[rorecomp_test_parity]", "algorithm.rorecomp_fraction": 0.25,
            "algorithm.rorecomp_compensation_rows": 8, "trainer.save_every": 2}
    res = train(load_config(None, tiny_overrides(tiny_model_dir, data, tmp_path, **base)))
    hist = res.history
    assert all(m["rorecomp/priority_rows"] < 32 for m in hist)  # 4 prompts × 8: a strict subset trains
    assert any(m["rorecomp/compensation_rows"] == 8 for m in hist)  # a compensation batch was replayed
    # mixed groups happen: the priority batch's correct ones are shorter, its wrong ones longer, than all
    assert sum(m["rorecomp/correct_length_gap"] for m in hist) > 0
    assert sum(m["rorecomp/wrong_length_gap"] for m in hist) > 0
    assert all(m["rorecomp/correct_length_gap"] >= 0 and m["rorecomp/wrong_length_gap"] >= 0 for m in hist)
    run = Path(res.run_dir)
    st = torch.load(run / "checkpoints" / "step-000004" / "trainer_state.pt", weights_only=False)
    saved = st["stateful"]["rorecomp"]["ranks"][0]
    assert sum(int(c["rewards"].shape[0]) for c in saved) == hist[-1]["rorecomp/buffer_rows"]
    resumed = train(load_config(None, tiny_overrides(tiny_model_dir, data, tmp_path, **{
        **base, "trainer.resume": str(run / "checkpoints" / "step-000002")})))
    for a, b in zip(hist[2:], resumed.history[2:]):
        assert a["rorecomp/buffer_rows"] == b["rorecomp/buffer_rows"]
        assert a["rorecomp/compensation_rows"] == b["rorecomp/compensation_rows"]
