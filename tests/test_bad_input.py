"""Bad input gives one clear error naming what is wrong and how to fix it, before any model is
loaded. (Already covered elsewhere: negative lr, unknown keys and types in test_config.py; missing
file, missing column, empty file, tokenizer without a chat template in test_data.py; n < 2 for
group advantages in test_train_e2e.py; unknown algorithm in test_grpo_math.py.)"""

import json
import logging
import time

import pytest

from anabranch import load_config, train
from anabranch.config import ConfigError, TaskConfig
from anabranch.data.files import DataError
from anabranch.data.tasks import load_task

from test_train_e2e import tiny_overrides


def file_cfg(path, **kw):
    return TaskConfig(name="file", path=path, eval_size=1, **kw)


def good(i):
    return json.dumps({"prompt": f"Q{i}", "answer": str(i)})


def test_invalid_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([good(0), good(1), '{"prompt": "Q2", "answer": ', good(3)]) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl line 3 is not valid JSON.*task\.skip_bad_rows=true"):
        load_task(file_cfg(str(path)))


def test_non_object_json_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([good(0), "[1, 2]", good(2)]) + "\n")
    with pytest.raises(DataError, match=r"line 2 is a JSON list, not an object"):
        load_task(file_cfg(str(path)))


@pytest.mark.parametrize("bad_row,why", [
    ({"prompt": None, "answer": "1"}, "empty or non-text prompt"),
    ({"prompt": "   ", "answer": "1"}, "empty or non-text prompt"),
    ({"prompt": [{"role": "user"}], "answer": "1"}, "not chat messages"),
    ({"question": "Q", "answer": "1"}, "no column 'prompt'"),
])
def test_malformed_row_names_its_number(write_jsonl, bad_row, why):
    path = write_jsonl([{"prompt": "Q0", "answer": "0"}, {"prompt": "Q1", "answer": "1"}, bad_row])
    with pytest.raises(DataError, match=rf"row 3 .*{why}"):
        load_task(file_cfg(path))


def test_skip_bad_rows_skips_and_counts(tmp_path, caplog):
    path = tmp_path / "d.jsonl"
    lines = [good(0), "not json", good(2), json.dumps({"prompt": "", "answer": "3"}), good(4), good(5)]
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING):
        train_rows, held = load_task(file_cfg(str(path), skip_bad_rows=True))
    assert [r["answer"] for r in train_rows + held] == ["0", "2", "4", "5"]
    text = caplog.text
    assert "skipped 1 malformed rows" in text and "lines: 2" in text  # bad JSON, by line
    assert "rows: 3" in text  # the empty prompt, by row among the parsed rows


def run_build(tiny_model_dir, write_jsonl, tmp_path, **extra):
    data = write_jsonl([{"prompt": f"Q{i}", "answer": "7"} for i in range(8)])
    cfg = load_config(None, tiny_overrides(tiny_model_dir, data, tmp_path, **extra))
    from anabranch.trainer.components import build

    return build(cfg)


@pytest.mark.parametrize("path", ["/no/such/model", "./missing-model", "~/no/such/dir/model"])
def test_missing_local_model_path_fails_fast(write_jsonl, tmp_path, path, monkeypatch):
    import anabranch.trainer.components as components

    def never(*a, **k):
        raise AssertionError("nothing may be loaded before model.path is checked")

    monkeypatch.setattr(components, "load_model", never)
    monkeypatch.setattr(components, "load_tokenizer", never)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=r"model\.path=.*no such folder.*Hub id"):
        run_build(path, write_jsonl, tmp_path)
    assert time.perf_counter() - t0 < 5


def test_folder_without_config_json(write_jsonl, tmp_path):
    (tmp_path / "empty_model").mkdir()
    with pytest.raises(ConfigError, match="without config.json"):
        run_build(str(tmp_path / "empty_model"), write_jsonl, tmp_path)


def test_prompt_longer_than_model_context(tiny_model_dir, write_jsonl, tmp_path):
    # The tiny model has 1024 positions; max_prompt_tokens allows the prompt, the context does not.
    data = write_jsonl([{"prompt": "x" * 1000, "answer": "7"}] + [{"prompt": "Q", "answer": "7"}] * 4)
    cfg = load_config(None, tiny_overrides(tiny_model_dir, data, tmp_path, **{
        "task.max_prompt_tokens": 4096, "rollout.max_new_tokens": 64}))
    with pytest.raises(ConfigError, match=r"model's context is 1024.*rollout\.max_new_tokens"):
        train(cfg)


def test_prompt_longer_than_max_prompt_tokens(tiny_model_dir, write_jsonl, tmp_path):
    data = write_jsonl([{"prompt": "x" * 100, "answer": "7"}] + [{"prompt": "Q", "answer": "7"}] * 4)
    cfg = load_config(None, tiny_overrides(tiny_model_dir, data, tmp_path, **{"task.max_prompt_tokens": 50}))
    with pytest.raises(ConfigError, match=r"task\.max_prompt_tokens=50"):
        train(cfg)


def test_a_hub_id_that_cannot_be_fetched_is_one_line_naming_the_key():
    from anabranch.models.loading import _from_hub

    def offline(path):
        raise OSError(f"We couldn't connect to 'https://huggingface.co' to load the files of {path}.\n"
                      "Check your internet connection ...")

    with pytest.raises(ConfigError, match=r"model\.path='org/name' could not be loaded from the Hugging Face "
                                          r"Hub \(We couldn't connect.*\); without network access give a local"):
        _from_hub(offline, "org/name", "model.path")
    assert _from_hub(lambda p: "loaded " + p, "org/name", "model.path") == "loaded org/name"


def test_prompt_longer_than_the_vllm_engine_context_is_refused_before_loading(tiny_model_dir, write_jsonl, tmp_path,
                                                                                  monkeypatch):
    """The engine's context (rollout.vllm_max_model_len), not only the model's, is checked before the
    model loads; and evaluations' longer trainer.eval_max_new_tokens count too."""
    import anabranch.trainer.components as components

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the prompt lengths were checked")

    monkeypatch.setattr(components, "load_model", no_load)
    data = write_jsonl([{"prompt": "x" * 200 + str(i), "answer": "1"} for i in range(8)])
    base = [f"model.path={tiny_model_dir}", "task.name=file", f"task.path={data}", "task.eval_size=2",
            f"trainer.output_dir={tmp_path}", "trainer.progress=false", "rollout.max_new_tokens=16"]
    with pytest.raises(ConfigError, match=r"vLLM engine's context is 128 \(rollout\.vllm_max_model_len\)"):
        train(load_config(None, base + ["rollout.backend=vllm", "rollout.vllm_max_model_len=128"]))
    with pytest.raises(ConfigError, match=r"with 900 new tokens .* model's context is 1024"):
        train(load_config(None, base + ["trainer.eval_max_new_tokens=900"]))
