"""PROF (Ye et al. 2025, algorithms/prof.py): the kept counts and rows of hand-built groups (both sides, the
balance), the filtered ScoredBatch and its metrics, the config refusals, and a short GRPO run on the tiny model
with a tiny random PRM in which the advantages see exactly the rows the filter chose."""

import pytest
import torch

from anabranch import load_config, train
from anabranch.algorithms.prof import KEY, balanced_counts, keep_rows, process_means, prof_filter
from anabranch.config import ConfigError
from anabranch.models.tiny import build_tiny_model
from anabranch.rewards.compose import RewardSource
from anabranch.rollout.base import Rollout
from anabranch.trainer.collect import ScoredBatch
from test_train_e2e import digit_task, tiny_overrides


@pytest.fixture(scope="module")
def tiny_prm_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("prm") / "prm", seed=1))


def test_process_means_average_the_steps_and_give_0_without_steps():
    assert process_means([[0.2, 0.4], [], [1.0], [0.1, 0.2, 0.6]]) == pytest.approx([0.3, 0.0, 1.0, 0.3])


@pytest.mark.parametrize("n_pos, n_neg, m, want", [
    (6, 2, 4, (2, 2)),   # both sides large enough: m/2 each
    (5, 3, 4, (2, 2)),
    (1, 7, 4, (1, 3)),   # one right answer: all of it, the rest wrong
    (7, 1, 4, (3, 1)),
    (0, 8, 4, (0, 4)),   # one-sided groups stay one-sided
    (8, 0, 4, (4, 0)),
    (4, 4, 5, (2, 3)),   # odd m: the extra row to the wrong side (assumed)
    (3, 1, 3, (2, 1)),
])
def test_balanced_counts_by_hand(n_pos, n_neg, m, want):
    assert balanced_counts(n_pos, n_neg, m) == want


def test_balanced_counts_refuse_more_than_the_group():
    with pytest.raises(ValueError, match="keeps m=5 of a group of only 4"):
        balanced_counts(2, 2, 5)


def _hand_groups():
    # group 0: 8 samples, 5 right, 3 wrong; group 1: 6 samples, 1 right, 5 wrong; group 2: 2 samples (< m)
    correct = [1, 0, 1, 1, 0, 1, 0, 1] + [0, 0, 1, 0, 0, 0] + [1, 0]
    scores = [0.9, 0.8, 0.2, 0.7, 0.1, 0.5, 0.3, 0.95] + [0.6, 0.4, 0.1, 0.9, 0.05, 0.2] + [0.3, 0.9]
    groups = [0] * 8 + [1] * 6 + [2] * 2
    return [float(c) for c in correct], scores, groups


def test_keep_rows_on_hand_built_groups():
    correct, scores, groups = _hand_groups()
    kept = keep_rows(correct, scores, groups, 4)
    # group 0 (m⁺ = m⁻ = 2): right rows by score 0.95 (7), 0.9 (0) kept, 0.7/0.5/0.2 dropped;
    #                        wrong rows by score 0.1 (4), 0.3 (6) kept, 0.8 (1) dropped
    # group 1 (m⁺ = 1, m⁻ = 3): its only right row (10) despite a low 0.1; wrong 0.05 (12), 0.2 (13), 0.4 (9)
    # group 2: two rows, fewer than m: kept whole
    assert kept == [0, 4, 6, 7, 9, 10, 12, 13, 14, 15]


def test_keep_rows_ties_keep_the_earlier_row():
    assert keep_rows([1.0, 1.0, 1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.2, 0.2, 0.2], [0] * 6, 2) == [0, 3]


def _batch(correct, scores, groups):
    b, width = len(correct), 3
    rollout = Rollout(prompt_ids=torch.ones(b, 2, dtype=torch.long), prompt_mask=torch.ones(b, 2, dtype=torch.long),
                      response_ids=torch.arange(b * width).view(b, width), response_mask=torch.ones(b, width, dtype=torch.long),
                      group_index=torch.tensor(groups), prompts=[f"p{g}" for g in sorted(set(groups))],
                      completions=[f"c{i}" for i in range(b)], truncated=torch.zeros(b, dtype=torch.bool))
    return ScoredBatch(rollout, [{"i": i} for i in range(b)], [2.0 * c for c in correct],
                       {"math_verify": list(correct), KEY: list(scores)}, 1.5, metrics={"round": 1.0})


def test_prof_filter_slices_every_field_and_reports_the_kept_rows():
    from anabranch.rewards.registry import REWARDS

    correct, scores, groups = _hand_groups()
    src = RewardSource("math_verify", 2.0, REWARDS.get("math_verify"), {})
    out = prof_filter(_batch(correct, scores, groups), [src], 4)
    kept = [0, 4, 6, 7, 9, 10, 12, 13, 14, 15]
    assert out.rollout.completions == [f"c{i}" for i in kept]
    assert out.rollout.group_index.tolist() == [groups[i] for i in kept] and out.rollout.prompts == ["p0", "p1", "p2"]
    assert out.rollout.response_ids[:, 0].tolist() == [3 * i for i in kept]
    assert [r["i"] for r in out.rows] == kept and out.total == [2.0 * correct[i] for i in kept]
    assert out.per_source[KEY] == [scores[i] for i in kept] and out.t_generate == 1.5
    m = out.metrics
    assert m["round"] == 1.0
    assert m["prof/correct_frac_sampled"] == pytest.approx(7 / 16)
    assert m["prof/correct_frac_kept"] == pytest.approx(4 / 10)       # rows 0, 7, 10, 14
    assert m["prof/kept_frac"] == pytest.approx(10 / 16)
    assert m["prof/process_correct_kept"] == pytest.approx((0.9 + 0.95 + 0.1 + 0.3) / 4)
    assert m["prof/process_wrong_kept"] == pytest.approx((0.1 + 0.3 + 0.4 + 0.05 + 0.2 + 0.9) / 6)


def test_prof_filter_needs_the_prm_scores():
    correct, scores, groups = _hand_groups()
    batch = _batch(correct, scores, groups)
    del batch.per_source[KEY]
    with pytest.raises(RuntimeError, match="no PRM step scores"):
        prof_filter(batch, [], 4)


def _cfg(tiny_model_dir, write_jsonl, tmp_path, prm_dir=None, prm=True, **extra):
    prm_dir = str(tmp_path) if prm_dir is None else prm_dir  # an existing folder: load time checks only that
    entry = ", {name: prm, weight: 1.0, params: {model_path: %s, step_tag: '#', good_token: '+', bad_token: '-'}}" % prm_dir
    over = {"reward.functions": f"[math_verify{entry if prm else ''}]", "algorithm.name": "grpo",
            "algorithm.prof_keep": 2, "trainer.steps": 2, "trainer.eval_before": False, "trainer.eval_after": False,
            "rollout.n": 4, "rollout.prompts_per_step": 2, "rollout.max_new_tokens": 8, "reward.isolation": "thread",
            **extra}
    return load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl, n=8), tmp_path, **over))


@pytest.mark.parametrize("extra, match", [
    ({"algorithm.prof_keep": 1}, r"keeps m >= 2 samples"),
    ({"algorithm.prof_keep": -1}, r"must be an integer >= 0"),
    ({"algorithm.prof_keep": 4}, r"prof_keep=4 must be below rollout.n=4"),
    ({"rollout.tools": "[calculator]"}, "cannot be used with rollout.tools"),
    ({"rollout.extra_rollouts": "dars"}, "cannot be used with rollout.extra_rollouts=dars"),
    ({"algorithm.ampo.enabled": True}, "cannot be used with algorithm.ampo.enabled"),
    ({"algorithm.guide.enabled": True}, "cannot be used with algorithm.guide.enabled"),
    ({"task.pairing": True}, "cannot be used with task.pairing"),
    # SCOPE would put partly-rectifier rewrites in place of failed rows PROF kept (algorithms/prof.with_scope)
    ({"algorithm.scope.enabled": True, "algorithm.scope.prm_path": "/", "algorithm.scope.rectifier": "/"},
     "prof_keep=2 cannot be used with algorithm.scope.enabled: .*never selected"),
    # PRM shaping would make the PRM a reward too, which PROF keeps it out of
    ({"reward.prm_shaping": "clip"}, r"cannot be used with reward.prm_shaping=clip: PROF uses the PRM only to filter"),
    ({"reward.prm_shaping": "delta", "algorithm.advantage": "reinforce_pp"}, r"reward.prm_shaping=delta"),
])
def test_refusals(tiny_model_dir, write_jsonl, tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(tiny_model_dir, write_jsonl, tmp_path, **extra)


def test_scope_refuses_prof_with_the_same_message():
    from anabranch.algorithms.prof import with_scope
    from anabranch.algorithms.scope import check_scope
    from anabranch.config_algorithm import AlgorithmConfig
    from anabranch.config_algorithm_options import ScopeConfig

    on = ScopeConfig(enabled=True, prm_path="p", rectifier="r")
    grpo = dict(advantage="grpo", loss="ppo_clip")
    assert check_scope(AlgorithmConfig(**grpo, scope=on)) is None
    assert check_scope(AlgorithmConfig(**grpo, scope=on, prof_keep=2)) == with_scope(2)


def test_refusals_of_the_prm_source(tiny_model_dir, write_jsonl, tmp_path):
    with pytest.raises(ConfigError, match="needs exactly one 'prm' entry"):
        _cfg(tiny_model_dir, write_jsonl, tmp_path, prm=False)
    with pytest.raises(ConfigError, match="is not an existing folder"):
        _cfg(tiny_model_dir, write_jsonl, tmp_path, prm_dir=str(tmp_path / "no_such_prm"))
    # without PROF a prm entry that nothing reads is still refused (algorithms/prm_shaping.py), naming PROF
    with pytest.raises(ConfigError, match="algorithm.prof_keep=m to filter"):
        _cfg(tiny_model_dir, write_jsonl, tmp_path, **{"algorithm.prof_keep": 0})
    cfg = _cfg(tiny_model_dir, write_jsonl, tmp_path)  # GRPO with PROF and reward.prm_shaping=none: accepted
    assert cfg.algorithm.prof_keep == 2 and cfg.reward.prm_shaping == "none"
    assert _cfg(tiny_model_dir, write_jsonl, tmp_path, prm=False, **{"algorithm.prof_keep": 0}).algorithm.prof_keep == 0


def test_two_step_grpo_trains_on_the_rows_prof_keeps(tiny_model_dir, tiny_prm_dir, write_jsonl, tmp_path,
                                                       monkeypatch):
    import anabranch.algorithms.prof as prof
    import anabranch.trainer.loop as loop

    filtered, seen = [], []
    real_filter, real_adv = prof.prof_filter, loop.compute_advantages

    def filter_spy(batch, sources, m):  # generate_round imports prof_filter at call time: this one
        out = real_filter(batch, sources, m)
        filtered.append((batch, out))
        return out

    def adv_spy(algo, model, rollout, rewards, **kw):
        seen.append((list(rollout.completions), rollout.group_index.tolist(), rewards.clone()))
        return real_adv(algo, model, rollout, rewards, **kw)

    monkeypatch.setattr(prof, "prof_filter", filter_spy)
    monkeypatch.setattr(loop, "compute_advantages", adv_spy)
    result = train(_cfg(tiny_model_dir, write_jsonl, tmp_path, prm_dir=tiny_prm_dir, **{"algorithm.kl_coef": 0.0}))
    assert len(result.history) == 2 and len(filtered) == 2 and len(seen) == 2
    for (before, after), (completions, groups, rewards), m in zip(filtered, seen, result.history):
        assert len(before.rollout.completions) == 8 and len(completions) == 4  # n = 4 sampled, m = 2 kept per prompt
        assert sorted(groups) == [0, 0, 1, 1]
        scores = before.per_source[KEY]
        assert all(0.0 <= s < 1.0 for s in scores) and any(s > 0 for s in scores)  # the PRM's mean step scores
        correct = [float(v >= 1.0) for v in before.per_source["math_verify"]]
        want = keep_rows(correct, scores, before.rollout.group_index.tolist(), 2)
        assert completions == [before.rollout.completions[i] for i in want]  # the advantages see PROF's rows
        assert rewards.tolist() == pytest.approx([before.total[i] for i in want])  # outcome reward only
        assert m["prof/kept_frac"] == 0.5 and m["reward/prm/failures"] == 0.0 and m["skipped_updates"] == 0
