"""RLSP's exploration reward (rewards/exploration.py): scores on hand-built responses (tokens, characters,
distinct lines), the cap and the linear decay, the verifier-weight guard at config load, the composed reward
(a correct answer always outscores a long wrong one, accuracy still reads the verifier) and a short run
on the tiny model through the trainer's scoring."""

import math
from types import SimpleNamespace

import pytest

from anabranch import load_config, train
from anabranch.config import ConfigError, RewardConfig, RewardFunctionConfig
from anabranch.eval.accuracy import batch_correct
from anabranch.rewards import build_rewards, score_detailed
from anabranch.rewards.exploration import rlsp_exploration, schedule, step_count
from test_train_e2e import digit_task, tiny_overrides

RIGHT, WRONG = "<answer>7</answer>", "<answer>3</answer>"


def test_length_score_is_tokens_over_the_cap_clipped_at_one():
    out = rlsp_exploration(["p"] * 4, ["a", "b", "c", "d"], response_length=[0, 3, 8, 20], max_length=8)
    assert out.values == pytest.approx([0.0, 0.375, 1.0, 1.0])  # 0/8, 3/8, 8/8, min(1, 20/8)
    assert out.metrics == pytest.approx({"score_mean": (0 + 0.375 + 1 + 1) / 4, "share": 1.0})
    # Without the trainer's token counts: characters ("abcd" is 4 of 8, 12 characters cap at 1)
    assert rlsp_exploration(["p"] * 2, ["abcd", "x" * 12], max_length=8).values == pytest.approx([0.5, 1.0])


def test_steps_are_distinct_non_empty_lines_so_repeats_earn_nothing():
    assert step_count("a\n\nb\n  a  \nc\n") == 3  # a, b, c: the blank line and the repeated "a" are no steps
    assert step_count("x\nx\nx\nx") == 1 and step_count("") == 0
    comps = ["step 1\nstep 2\nstep 3\nanswer", "same\nsame\nsame\nsame", "one line"]
    out = rlsp_exploration(["p"] * 3, comps, response_length=[50, 50, 50], measure="steps", max_steps=8)
    assert out.values == pytest.approx([4 / 8, 1 / 8, 1 / 8])  # token counts play no part
    assert rlsp_exploration(["p"], ["a\nb\nc"], measure="steps", max_steps=2).values == [1.0]  # capped


def test_linear_decay_of_the_share_by_training_step():
    assert [schedule(t, 4) for t in (1, 2, 3, 5, 9)] == pytest.approx([1.0, 0.75, 0.5, 0.0, 0.0])
    assert schedule(7, 0) == 1.0 and schedule(None, 4) == 1.0  # no decay; no training step (evaluation)
    lens = [2, 4]
    at3 = rlsp_exploration(["p"] * 2, ["a", "b"], response_length=lens, train_step=[3, 3], max_length=4,
                           decay_steps=4)
    assert at3.values == pytest.approx([0.5 * 0.5, 0.5 * 1.0]) and at3.metrics["share"] == 0.5
    assert at3.metrics["score_mean"] == pytest.approx(0.75)  # the undecayed score, for the logs
    late = rlsp_exploration(["p"] * 2, ["a", "b"], response_length=lens, train_step=[6, 6], max_length=4,
                            decay_steps=4)
    assert late.values == [0.0, 0.0]
    evaluation = rlsp_exploration(["p"] * 2, ["a", "b"], response_length=lens, max_length=4, decay_steps=4)
    assert evaluation.values == pytest.approx([0.5, 1.0])


def _sources(w_verifier=0.8, w_explore=0.2, **params):
    return build_rewards(RewardConfig(functions=[
        RewardFunctionConfig(name="math_verify", weight=w_verifier),
        RewardFunctionConfig(name="rlsp_exploration", weight=w_explore, params={"max_length": 10, **params})],
        isolation="none"))


def test_composed_reward_correct_always_outscores_a_long_wrong_answer_and_accuracy_reads_the_verifier():
    sources = _sources()  # α = 0.8: the paper's α·correct + (1 − α)·exploration
    comps = [RIGHT, RIGHT, WRONG, WRONG]
    lens = [0, 5, 5, 1000]
    out = score_detailed(sources, ["p"] * 4, comps, [{"answer": "7"}] * 4, group_index=[0] * 4,
                         extra_fields={"response_length": lens})
    assert out.per_source["math_verify"] == [1.0, 1.0, 0.0, 0.0]
    assert out.per_source["rlsp_exploration"] == pytest.approx([0.0, 0.5, 0.5, 1.0])
    assert out.total == pytest.approx([0.8, 0.8 + 0.1, 0.1, 0.2])  # hand: 0.8·v + 0.2·min(1, n/10)
    assert min(out.total[:2]) > max(out.total[2:])  # the shortest right answer beats the longest wrong one
    assert out.metrics["reward/rlsp_exploration/score_mean"] == pytest.approx(0.5)
    # Accuracy (and dynamic sampling's "correct") read the verifier, not the total below 1.0.
    batch = SimpleNamespace(per_source=out.per_source, total=out.total)
    assert batch_correct(batch, sources) == [1.0, 1.0, 0.0, 0.0]


def _load(functions, **extra):
    return load_config(None, [f"reward.functions={functions}", *(f"{k}={v}" for k, v in extra.items())])


def test_config_load_accepts_the_guarded_combination():
    cfg = _load("[{name: math_verify, weight: 0.8}, {name: rlsp_exploration, weight: 0.2, "
                "params: {measure: steps, max_steps: 12, decay_steps: 50}}]")
    assert [f.name for f in cfg.reward.functions] == ["math_verify", "rlsp_exploration"]
    default = load_config(None, [])  # the default run has no exploration reward
    assert all(f.name != "rlsp_exploration" for f in default.reward.functions)


@pytest.mark.parametrize("functions, match", [
    ("[{name: rlsp_exploration, weight: 0.2}]", r"needs a correctness reward with a larger weight.*there is none"),
    ("[{name: format, weight: 1.0}, {name: rlsp_exploration, weight: 0.2}]", r"there is none"),
    ("[{name: math_verify, weight: 0.5}, {name: rlsp_exploration, weight: 0.5}]",
     r"largest weight is 0\.5.*α > 0\.5"),
    ("[{name: math_verify, weight: 1.0}, {name: rlsp_exploration, weight: 0.0}]", r"weight must be > 0"),
    ("[{name: math_verify, weight: 1.0}, {name: rlsp_exploration, weight: -0.3}]", r"target_length"),
    ("[{name: math_verify}, {name: rlsp_exploration, weight: 0.2, params: {max_length: 0}}]", r"params\.max_length"),
    ("[{name: math_verify}, {name: rlsp_exploration, weight: 0.2, params: {decay_steps: -1}}]",
     r"params\.decay_steps"),
    ("[{name: math_verify}, {name: rlsp_exploration, weight: 0.2, params: {decay_steps: 2.5}}]",
     r"params\.decay_steps"),
    ("[{name: math_verify}, {name: rlsp_exploration, weight: 0.2, params: {measure: words}}]", r"params\.measure"),
    ("[{name: math_verify}, {name: rlsp_exploration, weight: 0.2, params: {max_steps: 8}}]",
     r"params\.max_steps only acts with measure=steps"),
    ("[{name: math_verify}, {name: rlsp_exploration, weight: 0.2, params: {measure: steps, max_length: 8}}]",
     r"params\.max_length only acts with measure=length"),
    ("[{name: math_verify}, {name: rlsp_exploration, weight: 0.2, params: {alpha: 0.8}}]",
     r"params\.alpha: unknown option"),
])
def test_config_load_refuses(functions, match):
    with pytest.raises(ConfigError, match=match):
        _load(functions)


def test_the_guard_sums_several_exploration_sources():
    # Each 0.4 alone is below math_verify's 0.5, but a long wrong answer scores 1 on both: 0.4 + 0.4 = 0.8 > 0.5
    # (a correct one, 0.5): refused, the sum named.
    both = ("[{name: math_verify, weight: 0.5}, {name: rlsp_exploration, weight: 0.4}, "
            "{name: rlsp_exploration, weight: 0.4, params: {measure: steps}}]")
    with pytest.raises(ConfigError, match=r"2 entries, weights 0\.4 \+ 0\.4 = 0\.8.*largest weight is 0\.5"):
        _load(both)
    # Below the verifier together (0.2 + 0.2 = 0.4 < 0.5): accepted, and then a correct answer does outscore
    # the longest wrong one under the composed reward.
    ok = _load("[{name: math_verify, weight: 0.5}, {name: rlsp_exploration, weight: 0.2, params: {max_length: 10}}, "
               "{name: rlsp_exploration, weight: 0.2, params: {measure: steps, max_steps: 2}}]")
    sources = build_rewards(ok.reward)
    out = score_detailed(sources, ["p"] * 2, [RIGHT, WRONG + "\nmore\nlines"], [{"answer": "7"}] * 2,
                         group_index=[0, 0], extra_fields={"response_length": [0, 1000]})
    assert out.total == pytest.approx([0.5 + 0.2 * 0.5, 0.2 * 1.0 + 0.2 * 1.0])  # RIGHT: 1 line of 2 steps
    assert out.total[0] > out.total[1]


def test_build_rewards_also_checks_the_options():  # a config built in code, not loaded from text
    with pytest.raises(ConfigError, match=r"rlsp_exploration\]\.params\.max_steps"):
        build_rewards(RewardConfig(functions=[RewardFunctionConfig(name="rlsp_exploration",
                                                                   params={"measure": "steps", "max_steps": 0})]))


def test_short_run_scores_the_composed_reward_with_the_schedule(tiny_model_dir, write_jsonl, tmp_path):
    fn = ("[{name: math_verify, weight: 1.0}, {name: rlsp_exploration, weight: 0.5, "
          "params: {max_length: 8, decay_steps: 2}}]")
    overrides = {"reward.functions": fn, "trainer.steps": 3, "trainer.eval_before": False,
                 "trainer.eval_after": False, "rollout.n": 4, "trainer.micro_batch_size": 8}
    result = train(load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path, **overrides)))
    shares = [m["reward/rlsp_exploration/share"] for m in result.history]
    assert shares == [1.0, 0.5, 0.0]  # s(t) = max(0, 1 − (t − 1)/2) at steps 1, 2, 3
    for m, share in zip(result.history, shares):
        score = m["reward/rlsp_exploration/score_mean"]
        assert 0.0 < score <= 0.5  # at most rollout.max_new_tokens = 4 tokens of a cap of 8
        assert m["reward/rlsp_exploration"] == pytest.approx(share * score)  # the source's mean value
        # the total: 1.0·verifier + 0.5·exploration, per sample, so also in the mean
        assert m["reward/mean"] == pytest.approx(m["reward/math_verify"] + 0.5 * share * score, abs=1e-6)
        assert math.isfinite(m["loss"])
