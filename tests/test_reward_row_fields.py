"""Rewards that read task columns (reasoning-gym's entry, a code task's tests) are checked against the
task's rows at the run's start (rewards/compose.check_row_fields), not at every step's scoring."""

import pytest

from anabranch.config import ConfigError, RewardConfig, RewardFunctionConfig, load_config
from anabranch.rewards import build_rewards
from anabranch.rewards.compose import check_row_fields, row_fields


def sources(*items):
    return build_rewards(RewardConfig(functions=[RewardFunctionConfig(**i) for i in items]))


def test_reasoning_gym_reward_on_rows_without_its_entry_is_refused():
    rows = [{"question": "1+1", "answer": "2"}]
    with pytest.raises(ConfigError, match=r"reward.functions\[reasoning_gym\] reads the row field 'rg_entry'.*row 1"):
        check_row_fields(sources({"name": "reasoning_gym"}), rows)
    check_row_fields(sources({"name": "math_verify"}), rows)  # reads 'answer', not declared: nothing checked


def test_the_first_row_without_the_field_is_named():
    rows = [{"question": "a", "tests": ["assert True"]}, {"question": "b", "tests": None}]
    with pytest.raises(ConfigError, match=r"code_tests\] reads the row field 'tests', which row 2"):
        check_row_fields(sources({"name": "code_tests"}), rows)
    check_row_fields(sources({"name": "code_tests"}), rows[:1])


def test_noisy_verifier_reports_its_wrapped_rewards_fields():
    src = sources({"name": "noisy_verifier", "params": {"reward": "reasoning_gym", "false_positive_rate": 0.1,
                                                        "false_negative_rate": 0.1}})
    assert row_fields(src[0]) == ("rg_entry", "rg_dataset")
    with pytest.raises(ConfigError, match=r"noisy_verifier\] reads the row field 'rg_entry'"):
        check_row_fields(src, [{"question": "q", "answer": "1"}])
    plain = sources({"name": "noisy_verifier", "params": {"reward": "math_verify", "false_positive_rate": 0.1,
                                                          "false_negative_rate": 0.1}})
    assert row_fields(plain[0]) == ()


def test_a_run_stops_before_the_model_loads(write_jsonl, monkeypatch):
    import anabranch.trainer.components as components

    data = write_jsonl([{"prompt": f"{i}+1", "answer": str(i + 1)} for i in range(20)])
    cfg = load_config(None, ["task.name=file", f"task.path={data}", "task.eval_size=2", "reward.functions=[reasoning_gym]"])
    monkeypatch.setattr(components, "load_tokenizer", lambda *a, **k: pytest.fail("the tokenizer was loaded"))
    with pytest.raises(ConfigError, match="rg_entry"):
        components.build(cfg)
