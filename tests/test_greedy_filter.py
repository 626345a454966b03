"""SELF's online greedy filter (``task.curation=greedy_wrong``, Nguyen et al. 2025, arXiv 2510.02230, as in the
authors' released trainer): only prompts whose greedy answer is wrong are sampled, redraws when all are right,
the stateful rewards never see greedy answers, metrics, refusals and a 2-step run on the tiny model."""

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from anabranch import load_config, train
from anabranch.config import Config, ConfigError, RewardConfig, RewardFunctionConfig, TaskConfig
from anabranch.rewards import build_rewards
from anabranch.rewards.registry import REWARDS
from anabranch.rollout.base import Rollout
from anabranch.trainer import greedy_filter
from anabranch.trainer.collect import collect_batch
from anabranch.trainer.curation import Curation
from anabranch.trainer.distributed import Distributed
import test_prompt_pairing as tpp  # registers pairing_test_rate (hard rows ~1/8 solved, easy ~7/8)
from test_train_e2e import tiny_overrides

GREEDY_RIGHT = {0, 2, 3, 5}  # prompts whose greedy answer is the right one; 1 and 4 are answered wrong greedily


class Log:
    """A stateful reward's state (rewards/compose.py's protocol): observations pending until committed."""

    def __init__(self, _params=None):
        self.pending, self.committed = [], []

    def take_pending(self):
        out, self.pending = self.pending, []
        return out

    def commit(self, obs):
        self.committed.extend(obs)


if "greedy_test_match" not in REWARDS:
    @REWARDS.register("greedy_test_match", correctness=True, state_factory=Log)
    def greedy_test_match(prompts, completions, answer, reward_state=None, train_step=None, **_):
        if reward_state is not None and train_step is not None:  # training calls record, as OLR / LASER-D do
            reward_state.pending.extend(completions)
        return [float(c == a) for c, a in zip(completions, answer)]


class Backend:
    """Greedy: ``a{i}`` for the prompts of GREEDY_RIGHT, else ``wrong``; sampled: ``s{i}`` (n per prompt)."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, n, greedy=False, max_new_tokens=None, seed=None):
        self.calls.append((list(prompts), n, greedy))
        ids = [int(p[1:]) for p in prompts]
        comps = [(f"a{i}" if i in GREEDY_RIGHT else "wrong") if greedy else f"s{i}" for i in ids for _ in range(n)]
        m = len(comps)
        return Rollout(prompt_ids=torch.ones(m, 2, dtype=torch.long), prompt_mask=torch.ones(m, 2, dtype=torch.long),
                       response_ids=torch.ones(m, 1, dtype=torch.long), response_mask=torch.ones(m, 1, dtype=torch.long),
                       group_index=torch.arange(len(ids)).repeat_interleave(n), prompts=list(prompts),
                       completions=comps, truncated=torch.zeros(m, dtype=torch.bool))


class Script:
    """A sampler handing out fixed draws, in order."""

    def __init__(self, *draws):
        self.draws = [list(d) for d in draws]

    def next(self, k):
        return self.draws.pop(0)


def components():
    rewards = build_rewards(RewardConfig(functions=[RewardFunctionConfig(name="greedy_test_match")], isolation="none"))
    return SimpleNamespace(train_rows=[{"question": f"q{i}", "answer": f"a{i}"} for i in range(6)],
                           train_prompts=[f"p{i}" for i in range(6)], backend=Backend(), rewards=rewards, model=None)


def cfg_with(n=2, pps=4, max_batches=10, **algo):
    cfg = Config()
    return dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, curation="greedy_wrong"),
                               rollout=dataclasses.replace(cfg.rollout, n=n, prompts_per_step=pps),
                               algorithm=dataclasses.replace(cfg.algorithm, max_sample_batches=max_batches, **algo))


# ---------------------------------------------------------------- the filter on a scripted backend

def test_only_prompts_answered_wrong_greedily_are_sampled_and_trained():
    c = components()
    batch = collect_batch(c, Script([0, 1, 2, 4]), cfg_with(), step=1)
    # one greedy decode of the 4 drawn prompts, then rollout.n=2 samples of the 2 wrong ones only
    assert c.backend.calls == [(["p0", "p1", "p2", "p4"], 1, True), (["p1", "p4"], 2, False)]
    assert batch.rollout.prompts == ["p1", "p4"] and batch.rollout.completions == ["s1", "s1", "s4", "s4"]
    assert [r["question"] for r in batch.rows] == ["q1", "q1", "q4", "q4"]
    assert batch.metrics["curation/greedy_wrong_frac"] == 0.5  # 2 of 4 greedy answers wrong
    assert batch.metrics["curation/kept_prompts"] == 2.0
    assert batch.metrics["curation/greedy_draws"] == 1.0 and batch.metrics["curation/greedy_all_correct"] == 0.0


def test_a_draw_solved_greedily_is_replaced_by_a_fresh_draw():
    c = components()
    batch = collect_batch(c, Script([0, 2, 3], [5, 1]), cfg_with(), step=1)
    assert [call[0] for call in c.backend.calls] == [["p0", "p2", "p3"], ["p5", "p1"], ["p1"]]
    assert batch.rollout.prompts == ["p1"]
    m = batch.metrics
    assert m["curation/greedy_draws"] == 2.0 and m["curation/greedy_wrong_frac"] == pytest.approx(1 / 5)
    assert m["curation/kept_prompts"] == 1.0 and m["curation/greedy_all_correct"] == 0.0


def test_every_draw_solved_trains_the_last_draw_as_is_and_says_so():
    c = components()
    batch = collect_batch(c, Script([0, 2], [3, 5], [1]), cfg_with(max_batches=2), step=1)
    # algorithm.max_sample_batches=2 draws, both solved greedily: the last one is sampled as is, no third draw
    assert c.backend.calls == [(["p0", "p2"], 1, True), (["p3", "p5"], 1, True), (["p3", "p5"], 2, False)]
    assert batch.rollout.prompts == ["p3", "p5"]
    m = batch.metrics
    assert m["curation/greedy_all_correct"] == 1.0 and m["curation/greedy_wrong_frac"] == 0.0
    assert m["curation/kept_prompts"] == 2.0 and m["curation/greedy_draws"] == 2.0


def test_greedy_answers_never_reach_the_stateful_rewards():
    c = components()
    collect_batch(c, Script([0, 1, 2, 4]), cfg_with(), step=1)
    # Only the training samples were committed; the greedy "a0", "wrong", ... were dropped, nothing left pending.
    assert c.rewards[0].state.committed == ["s1", "s1", "s4", "s4"] and c.rewards[0].state.pending == []


def test_dynamic_sampling_rounds_are_filtered_each():
    c = components()
    # DAPO keeps groups whose samples differ: every group here is all-equal, so all rounds run (2) and the last
    # round's filtered batch is kept as is; each round drew, decoded greedily, then sampled only the wrong ones.
    batch = collect_batch(c, Script([0, 1], [4, 2]), cfg_with(max_batches=2, dynamic_sampling=True), step=1)
    assert [(p, g) for p, _, g in c.backend.calls] == [(["p0", "p1"], True), (["p1"], False),
                                                       (["p4", "p2"], True), (["p4"], False)]
    assert batch.rollout.prompts == ["p4"]
    assert batch.metrics["curation/greedy_draws"] == 2.0 and batch.metrics["curation/kept_prompts"] == 2.0
    assert batch.metrics["dynamic_sampling/rounds"] == 2.0


def test_dynamic_sampling_rounds_share_one_redraw_budget():
    """Every greedy answer right, max_sample_batches=3: round 1 redraws twice (the step's whole budget of 3 − 1),
    rounds 2 and 3 get their one pass each and train their draw as is: 5 greedy passes, not 3 per round (9)."""
    c = components()
    draws = [[0, 2], [3, 5], [2, 0], [5, 3], [0, 5], [2, 3], [3, 0], [5, 2], [0, 2]]
    batch = collect_batch(c, Script(*draws), cfg_with(max_batches=3, dynamic_sampling=True), step=1)
    greedy = [p for p, _, g in c.backend.calls if g]
    assert greedy == [["p0", "p2"], ["p3", "p5"], ["p2", "p0"], ["p5", "p3"], ["p0", "p5"]]
    sampled = [p for p, _, g in c.backend.calls if not g]
    assert sampled == [["p2", "p0"], ["p5", "p3"], ["p0", "p5"]]  # each round's last draw, trained as is
    m = batch.metrics
    assert m["curation/greedy_draws"] == 5.0 and m["curation/greedy_all_correct"] == 1.0
    assert m["dynamic_sampling/rounds"] == 3.0


SEEN_BY_COUNTER = []  # every completion the counting reward was asked to score


if "greedy_test_counter" not in REWARDS:
    @REWARDS.register("greedy_test_counter")
    def greedy_test_counter(prompts, completions, answer, **_):
        """Not a correctness reward (as a PRM, RLPR or a judge beside it): records what it scores."""
        SEEN_BY_COUNTER.extend(completions)
        return [float(c == a) for c, a in zip(completions, answer)]


def test_greedy_pass_runs_only_the_correctness_reward_when_there_is_one():
    c = components()
    c.rewards = build_rewards(RewardConfig(functions=[RewardFunctionConfig(name="greedy_test_match"),
                                                      RewardFunctionConfig(name="greedy_test_counter")],
                                           isolation="none"))
    SEEN_BY_COUNTER.clear()
    batch = collect_batch(c, Script([0, 1, 2, 4]), cfg_with(), step=1)
    assert batch.rollout.prompts == ["p1", "p4"]  # the verdict is the correctness reward's, as before
    # the other source scored the training samples only, never the greedy answers ("a0", "wrong", ...)
    assert SEEN_BY_COUNTER == ["s1", "s1", "s4", "s4"]
    assert set(batch.per_source) == {"greedy_test_match", "greedy_test_counter"}


def test_greedy_pass_scores_the_total_without_a_correctness_reward():
    c = components()
    c.rewards = build_rewards(RewardConfig(functions=[RewardFunctionConfig(name="greedy_test_counter")],
                                           isolation="none"))
    SEEN_BY_COUNTER.clear()
    batch = collect_batch(c, Script([0, 1, 2, 4]), cfg_with(), step=1)
    # no source says right/wrong: the greedy answers are judged on the total, so this source scores them too
    assert SEEN_BY_COUNTER == ["a0", "wrong", "a2", "wrong", "s1", "s1", "s4", "s4"]
    assert batch.rollout.prompts == ["p1", "p4"]


def test_greedy_time_is_logged_and_counted_as_generation(monkeypatch):
    real = greedy_filter.greedy_correct
    monkeypatch.setattr(greedy_filter, "greedy_correct", lambda *a, **k: (real(*a, **k)[0], 1.5))
    c = components()
    batch = collect_batch(c, Script([0, 2], [1, 4]), cfg_with(), step=1)  # two greedy passes of 1.5 s each
    assert batch.metrics["time/greedy_s"] == 3.0
    assert 3.0 <= batch.t_generate < 3.5  # the sampled generation (instant here) plus the greedy passes


def test_off_by_default_no_greedy_pass():
    c = components()
    cfg = Config()
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, n=2))
    batch = collect_batch(c, Script([0, 1]), cfg, step=1)
    assert c.backend.calls == [(["p0", "p1"], 2, False)]
    assert not any(k.startswith("curation/") for k in batch.metrics)


# ---------------------------------------------------------------- refusals

@pytest.mark.parametrize("kw, key", [
    ({"curation_samples": 4}, "task.curation_samples"),
    ({"curation_prompts": 3}, "task.curation_prompts"),
    ({"curation_max_rate": 0.25}, "task.curation_max_rate"),
    ({"curation_min_rate": 0.125}, "task.curation_min_rate"),
    ({"pairing": True}, "task.pairing"),
    ({"mixture": [{"name": "basic_arithmetic"}]}, "task.mixture"),
    # A curriculum needs a mixture of >= 2 sources: the refusal names the curriculum, the key that was set last.
    ({"curriculum": "dump", "mixture": [{"name": "basic_arithmetic"}, {"name": "chain_sum"}]}, "task.curriculum"),
])
def test_keys_that_do_not_apply_are_refused(kw, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        TaskConfig(curation="greedy_wrong", **kw)
    assert TaskConfig(curation="greedy_wrong").curation == "greedy_wrong"


def test_several_processes_are_refused_at_load_and_in_prepare():
    with pytest.raises(ConfigError, match=r"task\.curation=greedy_wrong.*distributed\.num_processes=2"):
        load_config(None, ["task.curation=greedy_wrong", "distributed.num_processes=2"])
    cfg = load_config(None, ["task.curation=greedy_wrong"])
    assert Curation.create(cfg) is None  # no pre-pass, no kept set: the filter works per round
    # A launch with 2 processes the config did not announce: refused before accelerate wraps anything.
    with pytest.raises(ConfigError, match=r"task\.curation=greedy_wrong.*num_processes=2"):
        Distributed(world_size=2, accelerator=object()).prepare(SimpleNamespace(cfg=cfg))
    # dph.exclude_from_rl is refused with the π_0 pre-pass only; the online filter wraps whatever sampler runs.
    load_config(None, ["task.curation=greedy_wrong", "algorithm.dph.coef=0.1", "algorithm.dph.exclude_from_rl=true"])


# ---------------------------------------------------------------- a 2-step run on the tiny model

def test_two_step_run_on_the_tiny_model(tiny_model_dir, write_jsonl, tmp_path, monkeypatch):
    seen = []  # per greedy pass: the drawn questions and whether each greedy answer was right
    real = greedy_filter.greedy_correct

    def spy(c, idx, cfg, step=None):
        flags, seconds = real(c, idx, cfg, step)
        seen.append(([c.train_rows[i]["question"] for i in idx], flags))
        return flags, seconds

    monkeypatch.setattr(greedy_filter, "greedy_correct", spy)
    base = {"trainer.eval_before": False, "trainer.eval_after": False, "trainer.save_final": False,
            "trainer.steps": 2, "rollout.n": 4, "rollout.prompts_per_step": 4, "trainer.micro_batch_size": 16,
            "reward.isolation": "none", "reward.functions": "[pairing_test_rate]", "task.curation": "greedy_wrong",
            "rollout.max_new_tokens": 3}
    res = train(load_config(None, tiny_overrides(tiny_model_dir, tpp.rate_task(write_jsonl), tmp_path, **base)))
    assert len(res.history) == 2 and len(seen) >= 2
    for m in res.history:
        assert all(torch.isfinite(torch.tensor(m[k])) for k in ("loss", "grad_norm")), m
        assert 0.0 <= m["curation/greedy_wrong_frac"] <= 1.0 and 1 <= m["curation/kept_prompts"] <= 4
    assert sum(m["curation/greedy_draws"] for m in res.history) == len(seen)
    assert all(0 < m["time/greedy_s"] <= m["time/generate_s"] for m in res.history)
    flags = [f for _, fs in seen for f in fs]
    assert 0.0 in flags and 1.0 in flags  # the filter had something to drop and something to keep
    # Every trained question was drawn and answered wrong greedily (or is in a draw trained as is: all right).
    allowed = {q for qs, flags in seen for q, ok in zip(qs, flags) if not ok or not any(f == 0 for f in flags)}
    logged = [json.loads(line) for line in (Path(res.run_dir) / "samples.jsonl").read_text().splitlines()]
    assert logged and {x["question"] for x in logged} <= allowed
