"""UFO's "try again" rollouts (rollout/retry_turns.py) and their reward (rewards/retry_reward.py): the
token layout and masks of a scripted episode, where it stops, the reward by hand, and refusals."""

import json

import pytest

from anabranch.config import ConfigError, RolloutConfig
from anabranch.config_loading import load_config
from anabranch.models.tiny import char_tokenizer
from anabranch.rewards.retry_reward import episode_reward, retry_turns_reward
from anabranch.rollout.retry_turns import FEEDBACK, RetryTurnsBackend, feedback_ids

TOK = char_tokenizer()
EOS = TOK.eos_token_id


class Scripted:
    """A backend whose k-th attempt (k = feedback messages in the sequence so far) is ``script[k]``."""

    def __init__(self, script):
        self.script, self.eos_ids, self.calls = script, [EOS], []

    def continue_ids(self, seqs, max_new, stop=(), greedy=False, seed=None):
        self.calls.append(len(seqs))
        out = []
        for s, budget in zip(seqs, max_new):
            k = TOK.decode(s, skip_special_tokens=False).count(FEEDBACK)
            ids = TOK(self.script[min(k, len(self.script) - 1)], add_special_tokens=False)["input_ids"][:budget]
            out.append((ids, [-0.5] * len(ids)))
        return out

    def generate(self, prompts, n, greedy=False, max_new_tokens=None, seed=None):
        raise AssertionError("single-turn generate is for evaluation only")

    def sync_weights(self, model):
        pass


def _backend(script, k=3, answers=None, **cfg):
    inner = Scripted(script)
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
            "reward.functions": [{"name": "retry_turns"}]}
    return load_config(None, [f"{k}={json.dumps(v) if not isinstance(v, str) else v}"
                              for k, v in {**base, **over}.items()])


@pytest.mark.parametrize("over,match", [
    ({"rollout.tools": ["calculator"]}, "rollout.tools"),
    ({"rollout.min_new_tokens": 4}, "rollout.min_new_tokens"),
    ({"reward.functions": [{"name": "format"}]}, "reward.functions needs retry_turns or math_verify"),
    ({"rollout.retry_turns": -1}, "rollout.retry_turns"),
    ({"reward.functions": [{"name": "retry_turns", "params": {"gama": 0.5}}]}, "no option 'gama'"),
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
        with_retry_turns(Scripted(["x"]), TOK, cfg, [{"prompt": "a", "answer": ""}], ["a"])
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
    over = {"trainer.steps": 2, "trainer.eval_before": False, "trainer.eval_after": False, "rollout.n": 4,
            "rollout.max_new_tokens": 64, "rollout.prompts_per_step": 2, "rollout.retry_turns": 2,
            "reward.functions": json.dumps([{"name": "retry_turns"}, {"name": "math_verify", "weight": 0}])}
    result = train(load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path, **over)))
    for m in result.history:
        assert 1.0 < m["retry/attempts_mean"] <= 2.0
        assert m["retry/success_at_1"] <= m["retry/success_at_2"] <= 1.0
        assert -0.25 <= m["reward/mean"] <= 1.0 and math.isfinite(m["loss"]) and m["skipped_updates"] == 0
