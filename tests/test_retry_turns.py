"""UFO's "try again" rollouts (rollout/retry_turns.py) and their reward (rewards/retry_reward.py): the
token layout and masks of a scripted episode, where it stops, the reward by hand, and refusals."""

import json

import pytest

from anabranch.config import ConfigError, RolloutConfig
from anabranch.config_loading import load_config
from anabranch.models.tiny import char_tokenizer
from anabranch.rewards.retry_reward import episode_reward, retry_turns_reward
from anabranch.rollout.retry_turns import FEEDBACK, RetryTurnsBackend, feedback_ids
from env_configs import load_with
from scripted_backend import Scripted

TOK = char_tokenizer()
EOS = TOK.eos_token_id


def _backend(script, k=3, answers=None, **cfg):
    inner = Scripted(script, FEEDBACK)
    rc = RolloutConfig(**{"retry_turns": k, "max_new_tokens": 200, **cfg})
    return inner, RetryTurnsBackend(inner, TOK, rc, answers if answers is not None else {"Q\n": "7"},
                                    check=lambda text, gold: text.strip().endswith(gold))


def test_feedback_is_the_chat_templates_user_turn():
    fb = TOK.decode(feedback_ids(TOK, True), skip_special_tokens=False)
    assert fb == "<|im_end|>\n<|im_start|>user\nLet's try again.<|im_end|>\n<|im_start|>assistant\n"
    assert TOK.decode(feedback_ids(TOK, False)) == "\n\nLet's try again.\n\n"


def test_wrong_then_right_layout_masks_and_reward():
    inner, be = _backend(["it is 5<|im_end|>", "it is 7<|im_end|>"])
    ro = be.generate(["Q\n"], 2)
    fb = "\n<|im_start|>user\nLet's try again.<|im_end|>\n<|im_start|>assistant\n"  # its <|im_end|> is the EOS
    row = TOK.decode(ro.response_ids[0][ro.response_mask[0].bool()], skip_special_tokens=False)
    assert row == "it is 5<|im_end|>" + fb + "it is 7<|im_end|>"
    n1, nf, n2 = len("it is 5") + 1, len(TOK(fb, add_special_tokens=False)["input_ids"]), len("it is 7") + 1
    assert ro.loss_mask[0, :n1 + nf + n2].tolist() == [1] * n1 + [0] * nf + [1] * n2
    assert ro.response_mask[0].sum() == n1 + nf + n2
    assert ro.sample_log_probs[0, n1:n1 + nf].abs().sum() == 0 and ro.sample_log_probs[0, 0] == -0.5
    assert not ro.truncated.any() and inner.calls == [2, 2]
    assert ro.metrics["retry/attempts_mean"] == 2 and ro.metrics["retry/success_at_1"] == 0
    assert ro.metrics["retry/success_at_2"] == 1 and ro.metrics["retry/success_at_3"] == 1
    # The reward reads the same attempts from the transcript: right at attempt 2 -> γ = 0.5, 2 distinct answers.
    assert ro.completions[0] == "it is 5\nuser\nLet's try again.\nassistant\nit is 7"
    assert retry_turns_reward(["Q\n"], ro.completions[:1], answer=["7"]) == [0.5]


def test_right_at_once_stops_and_wrong_stops_at_k():
    inner, be = _backend(["7<|im_end|>"])
    ro = be.generate(["Q\n"], 1)
    assert ro.loss_mask.tolist() == [[1, 1]] and inner.calls == [1]
    assert retry_turns_reward(["Q\n"], ro.completions, answer=["7"]) == [1.0]
    inner, be = _backend(["5<|im_end|>"], k=3)
    ro = be.generate(["Q\n"], 1)
    assert inner.calls == [1, 1, 1] and ro.metrics["retry/attempts_mean"] == 3
    assert ro.completions[0].count(FEEDBACK) == 2 and ro.metrics["retry/success_at_3"] == 0
    # three wrong attempts, one distinct answer: 0 − 0.5·(1 − 1/3)
    assert retry_turns_reward(["Q\n"], ro.completions, answer=["7"]) == [pytest.approx(-1 / 3)]


def test_unknown_prompts_and_greedy_calls_are_single_turn():
    inner, be = _backend(["5<|im_end|>"], answers={"other\n": "7"})
    with pytest.raises(AssertionError, match="evaluation only"):
        be.generate(["Q\n"], 1)
    _, be = _backend(["5<|im_end|>"])
    with pytest.raises(AssertionError, match="evaluation only"):
        be.generate(["Q\n"], 1, greedy=True)


def test_no_eos_or_no_room_ends_the_episode():
    inner, be = _backend(["5555555555"], max_new_tokens=6)  # no EOS within the budget: truncated, one attempt
    ro = be.generate(["Q\n"], 1)
    assert inner.calls == [1] and bool(ro.truncated[0]) and ro.response_mask.sum() == 6
    inner, be = _backend(["5<|im_end|>"], max_new_tokens=20)  # the feedback does not fit
    ro = be.generate(["Q\n"], 1)
    assert inner.calls == [1] and ro.loss_mask.tolist() == [[1, 1]]


def test_episode_reward_by_hand():
    assert episode_reward(["x 3", "x 4", "x 7"], [False, False, True]) == 0.25       # γ² and 3 distinct
    assert episode_reward(["x 3", "x 3", "x 7"], [False, False, True]) == pytest.approx(0.25 - 0.5 / 3)
    assert episode_reward(["x 3", " X 3 "], [False, False], gamma=0.9, penalty=1.0) == -0.5
    assert episode_reward(["none", "none"], [False, False]) == 0.0                   # no answers: no penalty
    assert episode_reward(["none", "x 3", "x 3"], [False] * 3) == -0.25            # T_v = 2 answers, E = 1
    assert episode_reward(["a 1"], [True], gamma=0.9) == 1.0


def _cfg(tmp_path, **over):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "1+1", "answer": "2"}) + "\n")
    base = {"task.name": "file", "task.path": str(data), "rollout.retry_turns": 2,
            "reward.functions": [{"name": "retry_turns"}, {"name": "math_verify", "weight": 0}]}
    return load_with(**{**base, **over})


@pytest.mark.parametrize("over,match", [
    ({"rollout.tools": ["calculator"]}, "rollout.tools"),
    ({"rollout.min_new_tokens": 4}, "rollout.min_new_tokens"),
    ({"reward.functions": [{"name": "format"}]}, "needs math_verify"),
    ({"reward.functions": [{"name": "retry_turns"}]}, "needs math_verify"),  # no correctness source at all
    ({"reward.functions": [{"name": "retry_turns"}, {"name": "reasoning_gym"}, {"name": "math_verify"}]},
     "found 'reasoning_gym' first"),
    ({"rollout.retry_turns": 0}, r"retry_turns reward needs rollout.retry_turns >= 2 \(got 0\)"),
    ({"rollout.retry_turns": 1}, r"rollout.retry_turns >= 2 \(got 1\)"),
    ({"rollout.retry_turns": -1}, "rollout.retry_turns"),
    ({"reward.functions": [{"name": "retry_turns", "params": {"gama": 0.5}}, {"name": "math_verify"}]},
     "no option 'gama'"),
])
def test_refusals(tmp_path, over, match):
    with pytest.raises(ConfigError, match=match):
        cfg = _cfg(tmp_path, **over)
        from anabranch.rewards import build_rewards
        build_rewards(cfg.reward)


def test_a_backend_without_continue_ids_and_rows_without_answers_are_refused(tmp_path):
    class Plain:
        eos_ids = [EOS]
    with pytest.raises(ConfigError, match="no continue_ids"):
        RetryTurnsBackend(Plain(), TOK, RolloutConfig(retry_turns=2), {})
    from anabranch.rollout.retry_turns import with_retry_turns
    cfg = _cfg(tmp_path)
    with pytest.raises(ConfigError, match="gold answer in every training row"):
        with_retry_turns(Scripted(["x"], FEEDBACK), TOK, cfg, [{"prompt": "a", "answer": ""}], ["a"])
    _, be = _backend(["x"])
    with pytest.raises(ConfigError, match="sharded"):
        be.synced_gpus = True


def test_two_steps_of_training_with_retry_turns(tiny_model_dir, write_jsonl, tmp_path, monkeypatch):
    """The real trainer with rollout.retry_turns=2 on the tiny model. Its random policy almost never
    writes EOS, so each sampled attempt is cut to 3 tokens + EOS (the trainer recomputes log-probs):
    wrong first attempts get the feedback and a second attempt, which the step trains on."""
    import math

    from anabranch import train
    from anabranch.rollout.hf_generate import HFGenerateBackend
    from test_train_e2e import digit_task, tiny_overrides

    orig = HFGenerateBackend.continue_ids

    def short(self, seqs, max_new, stop=(), greedy=False, seed=None):
        eos = self.tokenizer.eos_token_id
        return [(ids[:3] + [eos], None) for ids, _ in orig(self, seqs, [3] * len(seqs), stop, greedy, seed)]

    monkeypatch.setattr(HFGenerateBackend, "continue_ids", short)
    from anabranch.rollout import retry_turns
    tables, real_table = [], retry_turns.answer_table
    monkeypatch.setattr(retry_turns, "answer_table", lambda *a: tables.append(1) or real_table(*a))
    over = {"trainer.steps": 2, "trainer.eval_before": False, "trainer.eval_after": False, "rollout.n": 4,
            "rollout.max_new_tokens": 64, "rollout.prompts_per_step": 2, "rollout.retry_turns": 2,
            "reward.functions": json.dumps([{"name": "retry_turns"}, {"name": "math_verify", "weight": 0}])}
    result = train(load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path, **over)))
    for m in result.history:
        assert 1.0 < m["retry/attempts_mean"] <= 2.0
        assert m["retry/success_at_1"] <= m["retry/success_at_2"] <= 1.0
        assert -0.25 <= m["reward/mean"] <= 1.0 and math.isfinite(m["loss"]) and m["skipped_updates"] == 0
    assert len(tables) == 1  # the gold-answer table is built once per run (check_data), not again for the backend


@pytest.mark.parametrize("key,value", [("guide.enabled", True), ("scaffold.enabled", True), ("srpo_coef", 0.1)])
def test_guide_scaffold_and_srpo_are_refused(tmp_path, key, value):
    """Called directly, so this check is tested, not another module's (srpo.py refuses SRPO too)."""
    from anabranch.rollout.retry_turns import check_config
    cfg = _cfg(tmp_path)
    check_config(cfg)  # the base config passes
    obj, *path, last = ["algorithm", *key.split(".")]
    target = getattr(cfg, obj)
    for name in path:
        target = getattr(target, name)
    setattr(target, last, value)
    with pytest.raises(ConfigError, match=rf"algorithm\.{key}"):
        check_config(cfg)


def test_check_data_builds_the_answer_table_that_wraps_the_backend(tmp_path, monkeypatch):
    from anabranch.rollout import retry_turns
    cfg = _cfg(tmp_path)
    monkeypatch.setattr(retry_turns, "feedback_ids", lambda *a: None)  # the template check is tested elsewhere
    table = retry_turns.check_data(cfg, TOK, [{"answer": " 7"}], ["Q\n"])
    assert table == {"Q\n": "7"}
    monkeypatch.setattr(retry_turns, "answer_table", lambda *a: pytest.fail("the table was built twice"))
    be = retry_turns.with_retry_turns(Scripted(["x"], FEEDBACK), TOK, cfg, [{"answer": " 7"}], ["Q\n"], answers=table)
    assert be.answers == table  # the table given (answer_table above fails the test if called)
    import dataclasses
    off = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, retry_turns=1))
    assert retry_turns.check_data(off, TOK, [{"answer": ""}], ["Q\n"]) is None  # off: nothing checked or built


def test_duplicate_prompt_texts_with_other_answers_are_refused(tmp_path):
    from anabranch.rollout.retry_turns import answer_table
    cfg = _cfg(tmp_path)
    rows = [{"answer": "2"}, {"answer": "3"}, {"answer": "2 "}]
    assert answer_table(cfg, [rows[0], rows[2]], ["p", "p"]) == {"p": "2"}  # the same answer twice: fine
    with pytest.raises(ConfigError, match=r"row 2's prompt is also an earlier row's with another answer \('2' vs '3'\)"):
        answer_table(cfg, rows, ["p", "p", "p"])


def test_math_verify_on_a_transcript_is_solved_at_some_attempt():
    """The trainer's right/wrong with retry turns is math_verify (weight 0) on the whole transcript. An
    episode stops at its first correct attempt, so the transcript's last answer is the solving one: an
    episode solved at attempt 2 (retry_turns reward 0.5) counts as correct, a never-solved one as wrong."""
    from anabranch.eval.accuracy import batch_correct
    from anabranch.rewards import build_rewards
    from anabranch.rewards.compose import score_detailed
    from anabranch.config import RewardConfig, RewardFunctionConfig

    def episode(script):  # graded in the rollout by the real math-verify check
        be = RetryTurnsBackend(Scripted(script, FEEDBACK), TOK, RolloutConfig(retry_turns=3, max_new_tokens=200),
                               {"Q\n": "7"})
        return be.generate(["Q\n"], 1).completions[0]

    solved = episode(["so \\boxed{5}<|im_end|>", "then \\boxed{7}<|im_end|>"])
    unsolved = episode(["so \\boxed{5}<|im_end|>", "then \\boxed{6}<|im_end|>", "hmm<|im_end|>"])
    assert solved.count(FEEDBACK) == 1 and unsolved.count(FEEDBACK) == 2
    sources = build_rewards(RewardConfig(functions=[RewardFunctionConfig("retry_turns"),
                                                    RewardFunctionConfig("math_verify", weight=0.0)],
                                         isolation="thread"))
    batch = score_detailed(sources, ["Q\n"] * 2, [solved, unsolved], [{"answer": "7"}] * 2)
    assert batch.per_source["retry_turns"] == [0.5, 0.0]  # unsolved: 2 distinct answers in 2, no penalty
    assert batch.per_source["math_verify"] == [1.0, 0.0]
    assert batch_correct(batch, sources) == [1.0, 0.0]


def test_rows_without_answers_are_refused_before_the_model_loads(tiny_model_dir, write_jsonl, tmp_path, monkeypatch):
    from anabranch.trainer import components
    from test_train_e2e import tiny_overrides

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the data check")

    monkeypatch.setattr(components, "load_model", no_model)
    data = write_jsonl([{"prompt": f"Q{i}", "answer": "" if i == 3 else "7"} for i in range(12)])
    over = {"rollout.retry_turns": 2, "task.eval_size": 2,
            "reward.functions": json.dumps([{"name": "retry_turns"}, {"name": "math_verify", "weight": 0}])}
    cfg = load_config(None, tiny_overrides(tiny_model_dir, data, tmp_path, **over))
    with pytest.raises(ConfigError, match="gold answer in every training row"):
        components.build(cfg)
