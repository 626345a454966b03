"""trainer/collect.py score_rollout: the one scoring path of training samples (generate_scored, AMPO's teacher
rows, the greedy filter): reward fields on demand, DAPO's overlong penalty, and a ``sources`` subset that runs
neither the other rewards nor the fields only they need."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from anabranch.config import Config, RewardConfig, RewardFunctionConfig
from anabranch.rewards import build_rewards
from anabranch.rewards import token_stats
from anabranch.rewards.registry import REWARDS
from anabranch.rollout.base import Rollout
from anabranch.trainer import collect

CALLS = {"match": [], "stats": []}

if "sr_test_match" not in REWARDS:
    @REWARDS.register("sr_test_match", correctness=True)
    def sr_test_match(prompts, completions, answer, group_index=None, train_step=None, sample_round=None, **_):
        CALLS["match"].append({"completions": list(completions), "groups": list(group_index),
                               "step": train_step, "round": sample_round})
        return [float(c == a) for c, a in zip(completions, answer)]

    @REWARDS.register("sr_test_stats", needs_token_stats=True, needs_fields=("mean_log_prob",))
    def sr_test_stats(prompts, completions, mean_log_prob, **_):
        CALLS["stats"].append(list(completions))
        return [float(v) for v in mean_log_prob]


def rollout(lengths=(2, 5, 6)):
    b, width = len(lengths), max(lengths)
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    return Rollout(prompt_ids=torch.ones(b, 2, dtype=torch.long), prompt_mask=torch.ones(b, 2, dtype=torch.long),
                   response_ids=torch.ones(b, width, dtype=torch.long), response_mask=mask,
                   group_index=torch.tensor([0, 0, 1][:b]), prompts=["p0", "p1"], completions=["a0", "x", "a1"][:b],
                   truncated=torch.zeros(b, dtype=torch.bool))


def setup(monkeypatch, buffer=0):
    stats_calls = []

    def fake_stats(model, input_ids, attention_mask, response_mask, micro_batch_size=8, **_):
        stats_calls.append(input_ids.shape[0])  # the forward a token-statistics reward costs
        return {"mean_log_prob": [-0.5] * input_ids.shape[0]}

    monkeypatch.setattr(token_stats, "sequence_token_stats", fake_stats)
    for v in CALLS.values():
        v.clear()
    rewards = build_rewards(RewardConfig(functions=[RewardFunctionConfig(name="sr_test_match"),
                                                    RewardFunctionConfig(name="sr_test_stats")], isolation="none"))
    c = SimpleNamespace(rewards=rewards, model=torch.nn.Linear(1, 1), tokenizer=None)
    cfg = Config()
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_new_tokens=6),
                              algorithm=dataclasses.replace(cfg.algorithm, overlong_buffer=buffer))
    rows = [{"answer": "a0"}, {"answer": "a0"}, {"answer": "a1"}]
    return c, cfg, rows, stats_calls


def test_all_sources_and_dapo_overlong_penalty_by_hand(monkeypatch):
    c, cfg, rows, stats_calls = setup(monkeypatch, buffer=4)
    out = collect.score_rollout(c, rollout(), rows, cfg, step=3, round_=2)
    # overlong: L_max = 6, buffer 4, so lengths past 2 lose (|y| − 2)/4: 2 → 0, 5 → −0.75, 6 → −1
    assert out.per_source["overlong"] == pytest.approx([0.0, -0.75, -1.0])
    assert out.per_source["sr_test_match"] == [1.0, 0.0, 1.0]
    assert out.per_source["sr_test_stats"] == pytest.approx([-0.5] * 3)
    assert out.total == pytest.approx([1.0 - 0.5 + 0.0, 0.0 - 0.5 - 0.75, 1.0 - 0.5 - 1.0])
    assert stats_calls == [3] and CALLS["stats"] == [["a0", "x", "a1"]]
    assert CALLS["match"] == [{"completions": ["a0", "x", "a1"], "groups": [0, 0, 1], "step": [3] * 3,
                               "round": [2] * 3}]
    assert out.rows == rows and out.t_generate == 0.0


def test_a_sources_subset_runs_neither_the_others_nor_their_fields(monkeypatch):
    c, cfg, rows, stats_calls = setup(monkeypatch)
    out = collect.score_rollout(c, rollout(), rows, cfg, sources=[c.rewards[0]])
    assert stats_calls == [] and CALLS["stats"] == []  # no token-statistics forward, no call of the other reward
    assert out.per_source == {"sr_test_match": [1.0, 0.0, 1.0]} and out.total == [1.0, 0.0, 1.0]
    assert CALLS["match"][0]["step"] is None  # no training step given: not a training visit


def test_reward_groups_override_the_group_index_the_rewards_see(monkeypatch):
    c, cfg, rows, _ = setup(monkeypatch)
    collect.score_rollout(c, rollout(), rows, cfg, sources=[c.rewards[0]], reward_groups=[7, 7, 7])
    assert CALLS["match"][0]["groups"] == [7, 7, 7]


def test_generate_scored_is_generation_then_score_rollout(monkeypatch):
    c, cfg, rows, _ = setup(monkeypatch, buffer=4)
    ro = rollout()
    c.backend = SimpleNamespace(generate=lambda prompts, n: ro)
    c.train_prompts, c.train_rows = ["p0", "p1"], [rows[0], rows[2]]
    seen = []
    real = collect.score_rollout
    monkeypatch.setattr(collect, "score_rollout", lambda *a, **k: seen.append((a, k)) or real(*a, **k))
    out = collect.generate_scored(c, [0, 1], cfg, step=1)
    assert len(seen) == 1 and seen[0][0][1] is ro and seen[0][0][2] == rows  # each row its group's
    assert out.total == pytest.approx([0.5, -1.25, -0.5]) and out.t_generate >= 0.0
