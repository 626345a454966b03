import json

import pytest

from anabranch.config import ConfigError, TaskConfig
from anabranch.data.files import DataError
from anabranch.data.prompts import build_prompt
from anabranch.data.tasks import load_task
from anabranch.models.tiny import char_tokenizer

ROWS = [{"q": f"What is {i}+1?", "a": str(i + 1)} for i in range(10)]


def file_cfg(path, **kw):
    return TaskConfig(name="file", path=path, prompt_column="q", answer_column="a", eval_size=2, **kw)


def test_jsonl_rows_and_held_out_split(write_jsonl):
    train, held = load_task(file_cfg(write_jsonl(ROWS)))
    assert [r["answer"] for r in held] == ["9", "10"]  # the last eval_size rows
    assert len(train) == 8 and train[0]["question"] == "What is 0+1?"
    assert {r["question"] for r in train}.isdisjoint({r["question"] for r in held})


def test_a_single_file_has_no_other_split(write_jsonl, caplog):
    # A split name on one file would read the training rows again as the "held-out" set.
    path = write_jsonl(ROWS)
    for key in ("eval_split", "split"):
        with pytest.raises(DataError, match=f"single file, which has no split 'test'"):
            load_task(file_cfg(path, **{key: "test"}))
    # Held-out rows are at most half the file, and saying so is not silent.
    train, held = load_task(TaskConfig(name="file", path=path, prompt_column="q", answer_column="a", eval_size=8))
    assert len(held) == 5 and len(train) == 5
    assert "only 5 are held out" in caplog.text


def test_parquet_and_csv(tmp_path):
    import pandas as pd

    df = pd.DataFrame(ROWS)
    df.to_parquet(tmp_path / "d.parquet")
    df.to_csv(tmp_path / "d.csv", index=False)
    for name in ("d.parquet", "d.csv"):
        train, held = load_task(file_cfg(str(tmp_path / name)))
        assert len(train) == 8 and held[-1]["answer"] == "10"


def test_saved_hf_dataset_with_splits(tmp_path):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                               "test": datasets.Dataset.from_list(ROWS[:3])})
    dd.save_to_disk(str(tmp_path / "ds"))
    train, held = load_task(file_cfg(str(tmp_path / "ds"), eval_split="test"))
    # The test split repeats two training prompts: they are held out, so training loses them.
    assert [r["answer"] for r in held] == ["1", "2"]
    assert len(train) == 8 and {r["question"] for r in train}.isdisjoint({r["question"] for r in held})
    with pytest.raises(DataError, match="no split 'validation'"):
        load_task(file_cfg(str(tmp_path / "ds"), split="validation"))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl"):
        load_task(file_cfg(str(tmp_path / "nope.jsonl")))


def test_missing_column_is_named(write_jsonl):
    path = write_jsonl([{"q": "x", "solution": "1"}])
    with pytest.raises(DataError, match=r"no column 'a'.*task.answer_column"):
        load_task(file_cfg(path))


def test_empty_dataset(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="empty"):
        load_task(file_cfg(str(tmp_path / "empty.jsonl")))


def test_file_task_needs_path():
    with pytest.raises(ConfigError, match="task.path"):
        load_task(TaskConfig(name="file"))


def test_unknown_task_name():
    with pytest.raises(ConfigError, match="unknown task 'basic_arithmatic'"):
        load_task(TaskConfig(name="basic_arithmatic"))


def test_a_broken_reasoning_gym_install_is_reported_as_such(monkeypatch):
    # Seen on a GPU machine whose reasoning-gym lacked one of its own dependencies: the task name was
    # right, and "unknown task" sent the user looking in the wrong place.
    import sys
    monkeypatch.setitem(sys.modules, "reasoning_gym.factory", None)  # any import of it now fails
    with pytest.raises(ConfigError, match="reasoning-gym is installed but failed to import"):
        load_task(TaskConfig(name="basic_arithmetic"))


def test_a_missing_reasoning_gym_is_named_in_the_unknown_task_error(monkeypatch):
    import importlib.util
    import sys
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "reasoning_gym" else real(n, *a))
    monkeypatch.setitem(sys.modules, "reasoning_gym.factory", None)
    with pytest.raises(ConfigError, match=r"unknown task 'basic_arithmetic'.*reasoning-gym is not installed"):
        load_task(TaskConfig(name="basic_arithmetic"))


def test_reasoning_gym_held_out_is_disjoint_from_training():
    cfg = TaskConfig(name="basic_arithmetic", train_size=300, eval_size=64)
    train, held = load_task(cfg)
    assert len(held) == 64
    assert {r["question"] for r in train}.isdisjoint({r["question"] for r in held})
    # The answers are correct arithmetic.
    for r in held[:10]:
        expr = r["question"].removeprefix("Calculate ").rstrip(".")
        assert str(eval(expr)) == r["answer"]


def test_reasoning_gym_bad_params():
    with pytest.raises(ConfigError, match="task.params"):
        load_task(TaskConfig(name="basic_arithmetic", params={"digits": 3}))


def test_prompt_uses_chat_template_and_instruction():
    tok = char_tokenizer()
    cfg = TaskConfig(instruction="Answer with a number.", system_prompt="Be brief.")
    text = build_prompt({"question": "What is 2+2?"}, cfg, tok)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2? "
                    "Answer with a number.<|im_end|>\n<|im_start|>assistant\n")


def test_tokenizer_without_chat_template_is_a_clear_error():
    tok = char_tokenizer(chat_template=False)
    with pytest.raises(ConfigError, match="task.chat_template=false"):
        build_prompt({"question": "hi"}, TaskConfig(), tok)
    assert build_prompt({"question": "hi"}, TaskConfig(chat_template=False), tok) == "hi\n"
