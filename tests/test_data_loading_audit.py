"""Loading the user's files, held-out splits, reasoning-gym and HumanEval rows, and prompt building:
the cases an audit found wrong (each test failed before its fix)."""

import json

import pytest

from anabranch.config import ConfigError, RewardConfig, TaskConfig
from anabranch.data.files import DataError
from anabranch.data.prompts import build_prompt
from anabranch.data.tasks import load_task
from anabranch.models.tiny import CHAT_TEMPLATE, char_tokenizer


def file_cfg(path, **kw):
    kw.setdefault("eval_size", 1)
    return TaskConfig(name="file", path=str(path), **kw)


def answers(path, **kw):
    train, held = load_task(file_cfg(path, **kw))
    return [r["answer"] for r in train + held]


# --- CSV and JSON keep the values as written -------------------------------------------------

def test_csv_cells_are_read_as_written(tmp_path):
    # pandas' defaults would turn the integer column with one empty cell into floats ("1" -> "1.0"),
    # the empty cell into "nan", the answers "None"/"NA" into missing values and "007" into 7.
    path = tmp_path / "d.csv"
    path.write_text("prompt,answer\nQ1,1\nQ2,\nQ3,None\nQ4,NA\nQ5,007\nQ6,6\n")
    assert answers(path) == ["1", "", "None", "NA", "007", "6"]
    # A prompt cell that reads as a number stays the text of the file.
    path.write_text("prompt,answer\n12,1\nQ2,2\nQ3,3\n")
    train, _ = load_task(file_cfg(path))
    assert train[0]["question"] == "12"


def test_csv_empty_prompt_cell_is_reported_as_empty(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("prompt,answer\nQ1,1\n,2\nQ3,3\n")
    with pytest.raises(DataError, match=r"row 2 has an empty or non-text prompt in column 'prompt': ''"):
        load_task(file_cfg(path))


def test_json_numbers_keep_their_type(tmp_path):
    # Arrow unifies a column of 1 and 2.5 to floats: the answer 1 would become "1.0", and an integer
    # beyond int64 "1.2345678901234567e+19".
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"prompt": "Q0", "answer": 1}, {"prompt": "Q1", "answer": 2.5},
                                {"prompt": "Q2", "answer": 12345678901234567890}, {"prompt": "Q3", "answer": 3}]))
    assert answers(path) == ["1", "2.5", "12345678901234567890", "3"]
    # JSON lines under a .json name are read too.
    path.write_text("\n".join(json.dumps({"prompt": f"Q{i}", "answer": i}) for i in range(3)))
    assert answers(path) == ["0", "1", "2"]


def test_malformed_files_give_the_parser_reason_on_one_line(tmp_path):
    (tmp_path / "bad.json").write_text('[{"prompt": "Q0", "answer": ')
    (tmp_path / "bad.csv").write_text('prompt,answer\n"Q1,1\nQ2,2\n')
    with pytest.raises(DataError, match=r"bad\.json is not valid JSON \(Expecting value at line 1") as e1:
        load_task(file_cfg(tmp_path / "bad.json"))
    with pytest.raises(DataError, match=r"cannot read dataset file .*bad\.csv: .*EOF inside string") as e2:
        load_task(file_cfg(tmp_path / "bad.csv"))
    for e in (e1, e2):
        assert "\n" not in str(e.value) and "An error occurred while generating" not in str(e.value)
    (tmp_path / "rows.json").write_text(json.dumps([{"prompt": "Q0", "answer": "0"}, ["Q1", "1"]]))
    with pytest.raises(DataError, match=r"rows\.json row 2 is a JSON list, not an object"):
        load_task(file_cfg(tmp_path / "rows.json"))


def test_jsonl_with_a_byte_order_mark(tmp_path):
    # Editors on Windows write UTF-8 with a BOM; json.loads rejects it on line 1.
    path = tmp_path / "d.jsonl"
    lines = [json.dumps({"prompt": f"Ωμέγα {i} 😀", "answer": "é"}, ensure_ascii=False) for i in range(3)]
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode("utf-8"))
    train, held = load_task(file_cfg(path))
    assert [r["question"] for r in train + held] == ["Ωμέγα 0 😀", "Ωμέγα 1 😀", "Ωμέγα 2 😀"]


# --- held-out rows never trained on ------------------------------------------------------------

def test_duplicate_prompts_are_not_trained_on_when_held_out(write_jsonl, caplog):
    rows = [{"prompt": f"Q{i % 3}", "answer": str(i % 3)} for i in range(9)]  # Q0 Q1 Q2 Q0 Q1 Q2 ...
    train, held = load_task(file_cfg(write_jsonl(rows), eval_size=2))
    assert [r["question"] for r in held] == ["Q1", "Q2"]
    assert [r["question"] for r in train] == ["Q0", "Q0", "Q0"]
    assert "removed 4 training rows whose prompt is also held out" in caplog.text
    # Chat-message prompts are compared by their content too.
    msgs = [{"prompt": [{"role": "user", "content": f"Q{i % 2}"}], "answer": "1"} for i in range(6)]
    train, held = load_task(file_cfg(write_jsonl(msgs, "m.jsonl"), eval_size=1))
    assert [r["question"][0]["content"] for r in train] == ["Q0", "Q0", "Q0"]
    # Nothing left to train on is an error, not an empty run.
    with pytest.raises(DataError, match="too few distinct rows"):
        load_task(file_cfg(write_jsonl([{"prompt": "Q", "answer": "1"}] * 4, "same.jsonl"), eval_size=1))


def test_single_saved_dataset_has_no_other_split(tmp_path):
    # A folder saved from one Dataset (not a DatasetDict) ignored the split name, so
    # task.eval_split=test held out the first training rows themselves.
    import datasets

    datasets.Dataset.from_list([{"prompt": f"Q{i}", "answer": str(i)} for i in range(6)]).save_to_disk(
        str(tmp_path / "ds"))
    with pytest.raises(DataError, match=r"single saved Dataset.*no split 'test' \(task\.eval_split\)"):
        load_task(file_cfg(tmp_path / "ds", eval_split="test", eval_size=2))
    with pytest.raises(DataError, match=r"no split 'validation' \(task\.split\)"):
        load_task(file_cfg(tmp_path / "ds", split="validation"))
    train, held = load_task(file_cfg(tmp_path / "ds", eval_size=2))
    assert [r["answer"] for r in held] == ["4", "5"] and len(train) == 4


def test_errors_name_the_config_key(tmp_path):
    import datasets

    datasets.DatasetDict({"test": datasets.Dataset.from_list([{"prompt": "Q", "answer": "1"}] * 2)}).save_to_disk(
        str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"no split 'train' \(task\.split\); splits: \['test'\]"):
        load_task(file_cfg(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"no split 'dev' \(task\.eval_split\)"):
        load_task(file_cfg(tmp_path / "dd", split="test", eval_split="dev"))
    with pytest.raises(DataError, match=r"nope\.jsonl \(task\.path\)"):
        load_task(file_cfg(tmp_path / "nope.jsonl"))
    # A folder of data files (a Hub dataset downloaded as files) is read as hf:FOLDER, with its splits.
    import pandas as pd

    (tmp_path / "repo" / "data").mkdir(parents=True)
    for split, n in (("train", 5), ("test", 3)):
        pd.DataFrame({"prompt": [f"{split}{i}" for i in range(n)], "answer": [str(i) for i in range(n)]}).to_parquet(
            tmp_path / "repo" / "data" / f"{split}-00000-of-00001.parquet")
    with pytest.raises(DataError, match=r"repo \(task\.path\) is a folder but not a dataset saved with save_to_disk "
                                        r".*use task\.path=hf:.*repo$"):
        load_task(file_cfg(tmp_path / "repo"))
    train, held = load_task(file_cfg(f"hf:{tmp_path / 'repo'}", eval_split="test", eval_size=2))
    assert [r["question"] for r in held] == ["test0", "test1"] and len(train) == 5
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(DataError, match=r"d\.txt \(task\.path\) has an unsupported extension"):
        load_task(file_cfg(tmp_path / "d.txt"))


# --- rows as reward functions see them ---------------------------------------------------------

def test_a_prompts_column_does_not_break_the_rewards(write_jsonl, caplog):
    # Rewards are called as fn(prompts, completions, **row_fields): a "prompts" column made every
    # call raise "got multiple values for argument 'prompts'", so every reward was 0.
    from anabranch.rewards import build_rewards
    from anabranch.rewards.compose import score_detailed

    rows = [{"prompts": f"What is {i}+1?", "completions": "x", "answer": str(i + 1)} for i in range(4)]
    train, _ = load_task(file_cfg(write_jsonl(rows), prompt_column="prompts"))
    assert "prompts" not in train[0] and train[0]["question"] == "What is 0+1?"
    assert "column(s) ['completions'] are left out" in caplog.text
    out = score_detailed(build_rewards(RewardConfig()), ["p", "p"], ["The answer is 1", "The answer is 5"],
                         train[:1] * 2)
    assert out.total == [1.0, 0.0] and out.metrics["reward/math_verify/failures"] == 0.0


# --- reasoning-gym -------------------------------------------------------------------------------

def test_reasoning_gym_params_rejected_by_its_asserts_name_task_params():
    with pytest.raises(ConfigError, match=r"task\.params .* do not fit reasoning-gym task 'basic_arithmetic': "
                                          r"max_terms must be >= min_terms"):
        load_task(TaskConfig(name="basic_arithmetic", params={"min_terms": 5, "max_terms": 2}))


def test_reasoning_gym_rows_are_seeded_and_scored_by_their_dataset():
    from anabranch.rewards.reasoning_gym_score import reasoning_gym_reward

    cfg = TaskConfig(name="chain_sum", train_size=40, eval_size=8, seed=3)
    train, held = load_task(cfg)
    again, held_again = load_task(cfg)
    other, _ = load_task(TaskConfig(name="chain_sum", train_size=40, eval_size=8, seed=4))
    qs = lambda rows: [r["question"] for r in rows]  # noqa: E731
    assert qs(train) == qs(again) and qs(held) == qs(held_again) and qs(train) != qs(other)
    assert len(held) == 8 and 0 < len(train) <= 40 and set(qs(train)).isdisjoint(qs(held))
    rows = train[:3] + held[:3]
    vals = reasoning_gym_reward(None, [r["answer"] for r in rows] + ["-12345"] * 6,
                                rg_entry=[r["rg_entry"] for r in rows] * 2,
                                rg_dataset=[r["rg_dataset"] for r in rows] * 2)
    assert vals[:6] == [1.0] * 6 and max(vals[6:]) < 1.0  # chain_sum gives partial credit when close
    assert all(r["answer"] == str(r["rg_entry"]["answer"]) for r in rows)


def test_reasoning_gym_task_without_a_reference_answer_keeps_none():
    # str(None) == "None" looked like a real answer to the math fallback of the held-out accuracy.
    train, held = load_task(TaskConfig(name="propositional_logic", train_size=4, eval_size=2))
    assert all(r["rg_entry"]["answer"] is None and r["answer"] is None for r in train + held)


# --- prompts -------------------------------------------------------------------------------------

def test_instruction_is_added_to_chat_message_prompts():
    tok = char_tokenizer()
    cfg = TaskConfig(instruction="Answer with a number.")
    row = {"question": [{"role": "system", "content": "S."}, {"role": "user", "content": "What is 2+2?"}]}
    text = build_prompt(row, cfg, tok)
    assert text == ("<|im_start|>system\nS.<|im_end|>\n<|im_start|>user\nWhat is 2+2? Answer with a number."
                    "<|im_end|>\n<|im_start|>assistant\n")
    assert row["question"][1]["content"] == "What is 2+2?"  # the row itself is not changed
    plain = build_prompt(row, TaskConfig(instruction="Answer with a number.", chat_template=False), tok)
    assert plain == "S.\nWhat is 2+2? Answer with a number.\n"
    # A string question gets the same text as the one-message list.
    assert build_prompt({"question": "What is 2+2?"}, TaskConfig(system_prompt="S.", instruction="Answer with a "
                        "number."), tok) == text


def test_a_failing_chat_template_is_a_config_error():
    tok = char_tokenizer()
    tok.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                         "{% endif %}" + CHAT_TEMPLATE)
    with pytest.raises(ConfigError, match=r"chat template failed on messages with roles \['system', 'user'\]: "
                                          r"System role not supported; unset task\.system_prompt"):
        build_prompt({"question": "hi"}, TaskConfig(system_prompt="Be brief."), tok)
    assert build_prompt({"question": "hi"}, TaskConfig(), tok).endswith("<|im_start|>assistant\n")
