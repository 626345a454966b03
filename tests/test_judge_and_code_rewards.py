import pytest

from anabranch.rewards import judge as judge_mod
from anabranch.rewards.code_exec import build_program, code_tests_reward
from anabranch.rewards.judge import is_trivial, judge_reward, parse_score


@pytest.mark.parametrize("text,expected", [
    ("Score: 7", 7),
    ("The answer matches the reference.\nScore: 10\n", 10),
    ("  Score: 0  ", 0),
    ("Score: 11", None),          # out of range
    ("Score: -1", None),
    ("Score: 7\nScore: 3", None),  # ambiguous
    ("score: 7", None),           # wrong case
    ("Score:7", None),            # no space
    ("Score: 7/10", None),
    ("Final Score: 7", None),     # extra text on the line
    ("Score: 7.5", None),
    (":", None),
    ("", None),
    (None, None),
])
def test_parse_score_is_strict(text, expected):
    assert parse_score(text, 0, 10) == expected


@pytest.mark.parametrize("completion,trivial", [
    (":", True), (".", True), ("Solution:", True), ("Thought process:", True),
    ("Let's solve this problem step by step.", True), ("", True), ("解", True),
    ("42", False), ("Solution: x = 3", False), ("The answer is seven", False),
])
def test_trivial_completions(completion, trivial):
    assert is_trivial(completion) is trivial


def test_fooled_judge_cannot_reward_master_keys(monkeypatch):
    # A judge that says 10 to everything (what "One Token to Fool" found for ":" and "Solution:").
    seen = []
    monkeypatch.setattr(judge_mod, "judge_generate", lambda texts, *a, **k: seen.extend(texts) or ["Score: 10"] * len(texts))
    out = judge_reward(None, [":", "Solution:", "The result is 4", "Thought process:"], question=["2+2?"] * 4,
                       answer=["4"] * 4, model_path="unused")
    assert out.values == [0.0, 0.0, 1.0, 0.0]
    assert out.metrics == {"unparseable": 0.0, "trivial_rejected": 3.0}
    assert len(seen) == 1 and "The result is 4" in seen[0] and "Reference answer:\n<<<\n4\n>>>" in seen[0]
    # Without the guard the fooled judge rewards them: the parser alone cannot catch this.
    out = judge_reward(None, [":"], question=["q"], answer=["4"], model_path="unused", reject_trivial=False)
    assert out.values == [1.0]


def test_judge_with_the_tiny_model_counts_unparseable_outputs(tiny_model_dir):
    from anabranch.config import RewardConfig, RewardFunctionConfig
    from anabranch.rewards import build_rewards, score_detailed

    cfg = RewardConfig(functions=[RewardFunctionConfig("judge", 1.0, {"model_path": tiny_model_dir, "max_new_tokens": 8})])
    out = score_detailed(build_rewards(cfg), ["p"] * 3, ["4", "five", ":"], [{"question": "2+2?", "answer": "4"}] * 3)
    # A random model does not write "Score: N": every judged answer is an unparseable failure, reward 0.
    assert out.total == [0.0, 0.0, 0.0]
    assert out.metrics["reward/judge/unparseable"] == 2.0
    assert out.metrics["reward/judge/trivial_rejected"] == 1.0
    assert out.metrics["reward/judge/failures"] == 0.0


def test_build_program():
    prompt = "def f(x):\n    \"\"\"Double.\"\"\"\n"
    assert build_program(prompt, "    return 2 * x\n", "f") == prompt + "    return 2 * x\n"
    fenced = "Here:\n```python\ndef f(x):\n    return x + x\n```\nDone."
    assert build_program(prompt, fenced, "f").endswith("def f(x):\n    return x + x\n")


def test_code_tests_reward_on_humaneval_problems():
    from anabranch.data.humaneval import humaneval_rows

    rows = humaneval_rows()[:2]
    assert len(humaneval_rows()) == 164
    r0, r1 = rows
    good0 = f"```python\n{r0['prompt_code']}{r0['answer']}```"
    cols = {k: [r[k] for r in rows] * 2 for k in ("tests", "test_setup", "prompt_code", "entry_point")}
    # r1 (separate_paren_groups) with a body that always returns [] passes none of its asserts
    comps = [good0, r1["answer"], "    return True\n", "    return []\n"]
    out = code_tests_reward(None, comps, **cols, max_workers=2)
    n0 = len(r0["tests"])
    passing_true = sum(1 for t in r0["tests"] if "== True" in t)
    assert out.values[:2] == [1.0, 1.0]
    assert out.values[2] == pytest.approx(passing_true / n0)
    assert out.values[3] == 0.0
    assert code_tests_reward(None, comps, **cols, mode="all").values == [1.0, 1.0, 0.0, 0.0]


def test_humaneval_task_split():
    from anabranch.config import TaskConfig
    from anabranch.data.tasks import load_task

    train, held = load_task(TaskConfig(name="humaneval", eval_size=4))
    assert len(train) == 160 and len(held) == 4 and held[-1]["task_id"] == "HumanEval/163"
