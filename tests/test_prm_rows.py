"""Rollout.process_rewards (PRM-Clip/Delta's step rewards, reward.prm_shaping) through every row slice:
Rollout.take and its callers (ScoredBatch.take, select_groups), concat_batches' padding and
its refusal of a mix, and DARS's merge of extra samples into their groups."""

import pytest
import torch

from anabranch.trainer.collect import ScoredBatch, concat_batches, select_groups
from test_prm import _rollout


def _with_fields(b=4, r=5):
    roll = _rollout(torch.ones(b, r, dtype=torch.long))
    roll.response_ids = torch.arange(b * r).view(b, r)
    roll.attempt_correct = torch.arange(b * 2).view(b, 2)
    roll.process_rewards = torch.arange(b * r, dtype=torch.float32).view(b, r) / 10
    roll.loss_mask = torch.ones(b, r, dtype=torch.long)
    roll.sample_log_probs = -torch.arange(b * r, dtype=torch.float32).view(b, r)
    roll.completions = [f"c{i}" for i in range(b)]
    return roll


def test_rollout_take_and_its_callers_slice_every_per_row_field():
    roll = _with_fields()
    out = roll.take([3, 1])
    for name in ("prompt_ids", "response_ids", "response_mask", "group_index", "truncated", "sample_log_probs",
                 "loss_mask", "attempt_correct", "process_rewards"):
        assert torch.equal(getattr(out, name), getattr(roll, name)[[3, 1]]), name
    assert out.completions == ["c3", "c1"] and out.prompts == roll.prompts and out.prompts is not roll.prompts
    batch = ScoredBatch(roll, [{"i": i} for i in range(4)], [0.0, 1.0, 2.0, 3.0], {"s": [0, 1, 2, 3]})
    picked = batch.take([3, 1])  # DPH's buffer rows, AMPO's candidates, SCOPE's swapped-in rewrites
    assert torch.equal(picked.rollout.attempt_correct, roll.attempt_correct[[3, 1]])
    assert torch.equal(picked.rollout.process_rewards, roll.process_rewards[[3, 1]])
    assert picked.rows == [{"i": 3}, {"i": 1}] and picked.total == [3.0, 1.0]
    sel = select_groups(batch, [1])  # group 1 = rows 2, 3, renumbered 0
    assert torch.equal(sel.rollout.process_rewards, roll.process_rewards[2:]) and sel.rollout.group_index.tolist() == [0, 0]
    assert torch.equal(sel.rollout.attempt_correct, roll.attempt_correct[2:]) and sel.rollout.prompts == ["p"]


def test_concat_pads_process_rewards_and_refuses_a_mix():
    a, b = _with_fields(2, 3), _with_fields(2, 5)
    both = concat_batches([ScoredBatch(a, [{}] * 2, [0.0] * 2, {}), ScoredBatch(b, [{}] * 2, [0.0] * 2, {})])
    want = torch.cat([torch.cat([a.process_rewards, torch.zeros(2, 2)], 1), b.process_rewards])
    assert torch.equal(both.rollout.process_rewards, want)
    b.process_rewards = None
    with pytest.raises(ValueError, match="process_rewards"):
        concat_batches([ScoredBatch(a, [{}] * 2, [0.0] * 2, {}), ScoredBatch(b, [{}] * 2, [0.0] * 2, {})])
    a.process_rewards = None
    none = concat_batches([ScoredBatch(a, [{}] * 2, [0.0] * 2, {}), ScoredBatch(b, [{}] * 2, [0.0] * 2, {})])
    assert none.rollout.process_rewards is None


def test_dars_merge_keeps_each_row_with_its_step_rewards():
    from anabranch.trainer.extra_rollouts import merge_groups

    first = _with_fields(4, 5)  # groups 0, 0, 1, 1
    extra = _with_fields(2, 6)  # one extra sample for each group, in that order
    extra.group_index = torch.tensor([0, 1])
    extra.process_rewards = torch.full((2, 6), 7.0)
    extra.process_rewards[1] = 9.0
    out = merge_groups(ScoredBatch(first, [{}] * 4, [0.0] * 4, {}), ScoredBatch(extra, [{}] * 2, [1.0] * 2, {}),
                       torch.tensor([0, 1]))
    pr = out.rollout.process_rewards
    assert out.rollout.group_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert torch.equal(pr[:2, :5], first.process_rewards[:2]) and torch.equal(pr[3:5, :5], first.process_rewards[2:])
    assert (pr[2] == 7.0).all() and (pr[5] == 9.0).all() and (pr[[0, 1, 3, 4], 5] == 0).all()
    assert torch.equal(out.rollout.response_ids[2], extra.response_ids[0])  # the rows moved together
