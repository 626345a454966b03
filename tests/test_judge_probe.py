"""Judge-robustness probe (Zhao et al. 2025, "One Token to Fool LLM-as-a-Judge"): false-positive rates of
master-key responses under the configured rewards, the key file, the report table and `anabranch eval`."""

import argparse
import json

import pytest

from anabranch.config import ConfigError, RewardConfig, RewardFunctionConfig
from anabranch.eval import judge_probe
from anabranch.eval.judge_probe import DEFAULT_MASTER_KEYS, load_keys, probe, report_table
from anabranch.eval.runner import EvalSettings, run_eval
from anabranch.rewards import build_rewards
from anabranch.rewards import judge as judge_mod
from anabranch.rewards.compose import RewardSource
from anabranch.rewards.judge import is_trivial

ROWS = [{"question": "What is 2+2?", "answer": "4"}, {"question": "What is 6*7?", "answer": "42"}]


def sources(judge_params, verifier_weight=0.5):
    return build_rewards(RewardConfig(functions=[
        RewardFunctionConfig("judge", 1.0, {"model_path": "unused", **judge_params}),
        RewardFunctionConfig("math_verify", verifier_weight, {})], isolation="thread"))


def test_always_yes_judge_is_fooled_every_time_and_the_rule_verifier_never(monkeypatch):
    monkeypatch.setattr(judge_mod, "judge_generate", lambda texts, *a, **k: ["Score: 10"] * len(texts))
    res = probe(sources({"reject_trivial": False}), ROWS, [":", "Solution", "かいせつ"])
    assert res["problems"] == 2 and res["keys"] == [":", "Solution", "かいせつ"]
    judge, verifier = res["rewards"]["judge"], res["rewards"]["math_verify"]
    assert judge["false_positive_rate"] == 1.0 and judge["mean_reward"] == 1.0
    assert verifier["false_positive_rate"] == 0.0 and verifier["mean_reward"] == 0.0
    assert all(v == {"false_positive_rate": 1.0, "mean_reward": 1.0} for v in judge["per_key"].values())
    # What training would see: 1.0 * judge + 0.5 * verifier.
    assert res["total_mean"] == {":": 1.0, "Solution": 1.0, "かいせつ": 1.0}
    assert res["metrics"]["reward/judge/trivial_rejected"] == 0.0
    # With the judge's guard on (its default), none of these reaches the judge: FPR 0.
    guarded = probe(sources({}), ROWS, [":", "Solution", "かいせつ"])
    assert guarded["rewards"]["judge"]["false_positive_rate"] == 0.0
    assert guarded["metrics"]["reward/judge/trivial_rejected"] == 6.0


def test_per_key_breakdown_against_hand_computed_rates(monkeypatch):
    # The judge says 10 to ":" on the first problem only, 5 to "Solution" everywhere.
    def fake(texts, *a, **k):
        out = []
        for t in texts:
            if "Answer to grade:\n<<<\n:\n>>>" in t:
                out.append("Score: 10" if "2+2" in t else "Score: 0")
            else:
                out.append("Score: 5")
        return out

    monkeypatch.setattr(judge_mod, "judge_generate", fake)
    res = probe(sources({"reject_trivial": False}, verifier_weight=2.0), ROWS, [":", "Solution"])
    per_key = res["rewards"]["judge"]["per_key"]
    assert per_key[":"] == {"false_positive_rate": 0.5, "mean_reward": 0.5}
    assert per_key["Solution"] == {"false_positive_rate": 0.0, "mean_reward": 0.5}  # partial credit is no FP
    assert res["rewards"]["judge"]["false_positive_rate"] == 0.25  # 1 of 4 pairs
    assert res["rewards"]["judge"]["mean_reward"] == 0.5
    # A lower threshold counts the half-credit answers as correct too.
    half = probe(sources({"reject_trivial": False}), ROWS, [":", "Solution"], threshold=0.5)
    assert half["rewards"]["judge"]["per_key"]["Solution"]["false_positive_rate"] == 1.0


def test_rewards_that_cannot_score_a_fixed_text_are_skipped_not_zeroed():
    called = []
    fake = RewardSource("needs_policy", 1.0, lambda p, c, **k: called.append(1) or [1.0] * len(c), {},
                        {"needs_policy_forward": True})
    tokens = RewardSource("needs_tokens", 1.0, lambda p, c, **k: [1.0] * len(c), {}, {"needs_fields": ("token_ids",)})
    res = probe([fake, tokens], ROWS, [":"])
    assert res["rewards"] == {} and not called
    assert set(res["skipped"]) == {"needs_policy", "needs_tokens"} and "token_ids" in res["skipped"]["needs_tokens"]


def test_key_files_and_their_errors(tmp_path):
    lines = tmp_path / "keys.txt"
    lines.write_text(" \n:\n\nThought process:\n:\n", encoding="utf-8")
    assert load_keys(lines) == [" ", ":", "Thought process:"]  # blank-space key kept, empty line and repeat dropped
    js = tmp_path / "keys.json"
    js.write_text(json.dumps([".", "解"]), encoding="utf-8")
    assert load_keys(js) == [".", "解"]
    for bad in ("[]", "[1, 2]", "{\"a\": 1}", "not json"):
        js.write_text(bad)
        with pytest.raises(ConfigError, match="--judge-probe"):
            load_keys(js)
    with pytest.raises(ConfigError, match="--judge-probe .*no such file"):
        load_keys(tmp_path / "missing.txt")
    with pytest.raises(ConfigError, match="--judge-probe"):
        EvalSettings(n=1, judge_probe=[]).check()


def test_cli_flag_default_keys_file_and_off(tmp_path):
    from anabranch.eval.cli_eval import add_subcommands, run, settings_from

    parser = argparse.ArgumentParser()
    add_subcommands(parser.add_subparsers(dest="command"))
    assert settings_from(parser.parse_args(["eval", "m"])).judge_probe is None  # off by default
    assert settings_from(parser.parse_args(["eval", "m", "--judge-probe"])).judge_probe == list(DEFAULT_MASTER_KEYS)
    f = tmp_path / "k.txt"
    f.write_text("Solution\n")
    assert settings_from(parser.parse_args(["eval", "m", f"--judge-probe={f}"])).judge_probe == ["Solution"]
    assert run(parser.parse_args(["eval", "m", f"--judge-probe={tmp_path / 'none.txt'}"])) == 2


def test_default_keys_are_all_caught_by_the_judge_guard():
    assert all(is_trivial(k) for k in DEFAULT_MASTER_KEYS)
    assert not is_trivial("Respuesta: 42") and not is_trivial("かいせつ 7")


def test_report_table_lists_every_key_and_the_overall_rate(monkeypatch):
    monkeypatch.setattr(judge_mod, "judge_generate", lambda texts, *a, **k: ["Score: 10"] * len(texts))
    res = probe(sources({"reject_trivial": False}), ROWS, [":", "<b>"])
    page = report_table([{"label": "run<1>", "evals": [{"judge_probe": res}]}])
    assert "Judge robustness" in page
    assert page.count("<tr>") == 1 + 2 * 3  # head, then per reward: all keys + one row per key
    assert "run&lt;1&gt;" in page and "&#x27;&lt;b&gt;&#x27;" in page  # escaped
    assert report_table([{"label": "r", "evals": [{}]}]) == "" and report_table([{"label": "r", "evals": []}]) == ""


def eval_config(tmp_path, tiny_model_dir, eval_size=3):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(json.dumps({
        "model": {"path": tiny_model_dir},
        "task": {"name": "random_calculation", "eval_size": eval_size, "train_size": 10},
        "rollout": {"max_new_tokens": 4}, "trainer": {"eval_max_new_tokens": 4, "device": "cpu"},
        "reward": {"functions": [
            {"name": "judge", "weight": 1.0,
             "params": {"model_path": tiny_model_dir, "max_new_tokens": 4, "reject_trivial": False}},
            {"name": "math_verify", "weight": 1.0}]}}))
    return str(cfg)


QUIET = dict(n=1, greedy=False, embeddings=False, effective_rank=False, sparse_tokens=0)


def test_eval_flag_with_a_tiny_random_judge(tiny_model_dir, tmp_path):
    out = run_eval([tiny_model_dir], eval_config(tmp_path, tiny_model_dir), [],
                   EvalSettings(**QUIET, judge_probe=[":", "Solution"]), tmp_path / "ev")
    res = out["models"][0]["judge_probe"]
    assert res["problems"] == 3 and set(res["rewards"]) == {"judge", "math_verify"}
    # A random judge writes no "Score: N": every pair is unparseable, reward 0, no false positive.
    assert res["metrics"]["reward/judge/unparseable"] == 6.0
    assert res["rewards"]["judge"]["false_positive_rate"] == 0.0
    assert res["rewards"]["math_verify"]["per_key"][":"]["false_positive_rate"] == 0.0
    saved = json.loads((tmp_path / "ev" / "passk.json").read_text())
    assert saved["models"][0]["judge_probe"] == json.loads(json.dumps(res))
    assert saved["settings"]["judge_probe"] == [":", "Solution"]
    off = run_eval([tiny_model_dir], eval_config(tmp_path, tiny_model_dir), [], EvalSettings(**QUIET),
                   tmp_path / "ev2")
    assert "judge_probe" not in off["models"][0]


def test_probe_errors_come_before_any_model_loads(tiny_model_dir, tmp_path, monkeypatch):
    from anabranch.eval import runner

    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(runner, "evaluate_model", no_load)
    monkeypatch.setattr(judge_probe, "probe", lambda *a, **k: (_ for _ in ()).throw(AssertionError("scored")))
    with pytest.raises(ConfigError, match="task.eval_size"):
        run_eval([tiny_model_dir], eval_config(tmp_path, tiny_model_dir, eval_size=0), [],
                 EvalSettings(**QUIET, judge_probe=[":"]), tmp_path / "ev")


def test_report_page_shows_a_runs_probe(tmp_path, monkeypatch):
    from anabranch.eval.report import write_report

    monkeypatch.setattr(judge_mod, "judge_generate", lambda texts, *a, **k: ["Score: 10"] * len(texts))
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n")
    res = probe(sources({"reject_trivial": False}), ROWS, [":"])
    (run / "eval_passk.json").write_text(json.dumps({"settings": {"n": 1}, "models": [{"judge_probe": res}]}))
    page = write_report([run], tmp_path / "r.html").read_text(encoding="utf-8")
    assert "Judge robustness" in page and "<td>judge</td><td>&#x27;:&#x27;</td><td>1.000</td>" in page
