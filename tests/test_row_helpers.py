"""The shared row/group helpers that replaced hand-written copies: ScoredBatch.take (PROF, AMPO, DPH's buffer,
DARS's merge, select_groups), rollout.base.first_rows (AMPO, Guide, HPT, RL-PLUS, CalibRL),
hpt_step.group_demonstrations with rl_plus_step.demonstration_pass (HPT, RL-PLUS, CalibRL) and
rewards.length.response_lengths (the length rewards, RLSP's exploration reward, LASER)."""

import dataclasses

import torch

from anabranch.config import Config
from anabranch.rewards.length import response_lengths
from anabranch.rollout.base import first_rows
from anabranch.trainer.calibrl_step import CalibRL
from anabranch.trainer.collect import ScoredBatch, select_groups
from anabranch.trainer.hpt_step import build_sft_batch, group_demonstrations
from anabranch.trainer.rl_plus_step import demonstration_log_probs, demonstration_pass
from test_hpt import FakeTok, ToyLM, toy_rollout


def _batch():
    roll = toy_rollout([[[1, 2], [3]], [[4], [5, 6], [1]]])  # groups 0, 0, 1, 1, 1
    rows = [{"answer": "12"}] * 2 + [{"answer": "7", "demonstration": "89"}] * 3
    return ScoredBatch(roll, rows, [0.0, 1.0, 2.0, 3.0, 4.0], {"a": [10, 11, 12, 13, 14], "b": [5, 6, 7, 8, 9]},
                       t_generate=2.5, metrics={"m": 1.0})


def test_scored_batch_take_slices_every_row_field_in_order_and_keeps_the_rest():
    batch = _batch()
    out = batch.take([4, 1, 4])  # any order, repeats allowed
    assert out.total == [4.0, 1.0, 4.0] and out.per_source == {"a": [14, 11, 14], "b": [9, 6, 9]}
    assert out.rows == [batch.rows[4], batch.rows[1], batch.rows[4]]
    assert out.rollout.group_index.tolist() == [1, 0, 1] and out.rollout.completions == ["1", "3", "1"]
    assert torch.equal(out.rollout.response_ids, batch.rollout.response_ids[[4, 1, 4]])
    assert out.rollout.prompts == ["p0", "p1"] and out.t_generate == 2.5
    out.metrics["m"] = 9.0  # a copy: the source batch's metrics stay as they were
    assert out.metrics == {"m": 9.0} and batch.metrics == {"m": 1.0}


def test_select_groups_renumbers_through_take():
    sel = select_groups(_batch(), [1])
    assert sel.rollout.group_index.tolist() == [0, 0, 0] and sel.rollout.prompts == ["p1"]
    assert sel.total == [2.0, 3.0, 4.0] and sel.per_source["b"] == [7, 8, 9] and sel.t_generate == 2.5


def test_first_rows_is_each_groups_first_row_in_ascending_group_order():
    first = first_rows(torch.tensor([3, 3, 1, 0, 1, 0]))
    assert first == {0: 3, 1: 2, 3: 0} and list(first) == [0, 1, 3]
    assert first_rows(torch.tensor([0, 0, 1, 1])) == {0: 0, 1: 2}


def test_group_demonstrations_read_each_groups_first_row():
    batch = _batch()
    batch.rows[3] = {"answer": "5"}  # not a group's first row: never read
    every = group_demonstrations(batch, "The answer is {answer}")
    assert every.groups == [0, 1] and every.prompts == ["p0", "p1"]
    assert every.texts == ["The answer is 12", "89"]  # the row's own demonstration wins over the template
    some = group_demonstrations(batch, "{answer}", [1])
    assert some.groups == [1] and some.rows == [{"answer": "7", "demonstration": "89"}] and some.texts == ["89"]
    # another row layout (CalibRL's trained rollout): its first rows index batch.rows
    other = group_demonstrations(batch, "{answer}", group_index=torch.tensor([1, 1, 0, 0, 0]))
    assert other.texts == ["89", "12"]


def test_demonstration_pass_is_build_sft_batch_then_the_no_grad_forward():
    model, cfg = ToyLM(), Config()
    sft, old = demonstration_pass(model, FakeTok(), ["p0", "p1"], ["12", "7"], 0, cfg)
    want_sft = build_sft_batch(FakeTok(), ["p0", "p1"], ["12", "7"])
    assert torch.equal(sft.input_ids, want_sft.input_ids) and torch.equal(sft.target_mask, want_sft.target_mask)
    want = demonstration_log_probs(model, want_sft, cfg.rollout.temperature, cfg.trainer.micro_batch_size)
    assert torch.allclose(old, want) and not old.requires_grad


def test_calibrl_baselines_follow_sparse_interleaved_group_numbers():
    # rows of groups 3, 0, 3, 0 (groups 1 and 2 absent): each row gets its own group's expert
    roll = toy_rollout([[[1, 2], [3]], [[1, 1], [2]]])
    roll.group_index = torch.tensor([3, 0, 3, 0])
    roll.prompts = ["p0", "unused1", "unused2", "p3"]
    rows = [{"answer": "7", "demonstration": "895"}, {"answer": "12"}] * 2
    batch = ScoredBatch(roll, rows, [1.0, 0.0, 0.0, 1.0], {})
    cfg = Config()
    calibrl = dataclasses.replace(cfg.algorithm.calibrl, enabled=True, demonstration_template="{answer}")
    cfg = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, calibrl=calibrl))
    model = ToyLM()
    step = CalibRL(cfg, FakeTok()).step(batch, roll, model)
    b = step.baseline
    experts = {g: demonstration_log_probs(model, build_sft_batch(FakeTok(), [p], [d]), 1.0, 4)[0]
               for g, p, d in ((0, "p0", "12"), (3, "p3", "895"))}
    for r, g in enumerate([3, 0, 3, 0]):
        assert torch.allclose(b[r], experts[g][:2], atol=1e-6), (r, g)
    # the metric: the experts' mean token log-prob over their target tokens ("12"+eos: 3, "895"+eos: 4), not
    # over the padding of the shorter one
    want = float(torch.cat([experts[0], experts[3]]).mean())
    assert abs(step.metrics["calibrl/expert_logprob"] - want) < 1e-6 and step.metrics["calibrl/expert_tokens"] == 3.5


def test_response_lengths_are_tokens_when_given_else_characters():
    assert response_lengths(["abc", "de"], [7, 1]) == [7.0, 1.0]
    assert response_lengths(["abc", "de"], None) == [3.0, 2.0]
