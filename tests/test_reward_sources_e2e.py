"""Reward sources inside real (tiny) training runs: metrics logged, failures counted, run survives."""

import json
import sys
import time
import types
from pathlib import Path

from anabranch import load_config, train


def _overrides(model_dir, data, out, **extra):
    base = {
        "model.path": model_dir, "task.name": "file", "task.path": data, "task.eval_size": 4,
        "rollout.n": 4, "rollout.prompts_per_step": 2, "rollout.max_new_tokens": 4,
        "trainer.steps": 2, "trainer.lr": 1e-3, "trainer.output_dir": str(out), "trainer.run_name": "r",
        "trainer.progress": False, "trainer.eval_before": False, "trainer.eval_after": False,
        "trainer.save_final": False, "trainer.tensorboard": False,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _metrics(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r]


def test_label_free_rewards_log_true_accuracy(tiny_model_dir, write_jsonl, tmp_path):
    data = write_jsonl([{"prompt": f"Q{i}: say seven", "answer": "7"} for i in range(12)])
    cfg = load_config(None, _overrides(tiny_model_dir, data, tmp_path,
                                       **{"reward.functions": "[majority_vote, self_certainty*0.1, neg_entropy*0, math_verify*0]"}))
    steps = _metrics(train(cfg).run_dir)
    assert len(steps) == 2
    for m in steps:
        for key in ("reward/majority_vote", "reward/self_certainty", "reward/neg_entropy", "accuracy",
                    "reward/majority_vote/majority_ratio", "reward/majority_vote/true_accuracy",
                    "reward/majority_vote/label_accuracy", "reward/self_certainty/failures"):
            assert isinstance(m[key], float), key
        assert m["reward/self_certainty/failures"] == 0.0
        assert m["reward/self_certainty"] > 0  # KL(U || p) > 0 for a non-uniform model
        assert m["reward/neg_entropy"] < 0


def _hang(prompts, completions, **_):
    time.sleep(60)


def test_code_reward_and_a_hanging_reward_do_not_stop_training(tiny_model_dir, write_jsonl, tmp_path, monkeypatch):
    mod = types.ModuleType("e2e_bad_rewards")
    mod.hang = _hang
    monkeypatch.setitem(sys.modules, "e2e_bad_rewards", mod)
    data = write_jsonl([{"prompt": f"write f{i}", "answer": "", "entry_point": "f",
                         "tests": ["assert f() == 1"], "prompt_code": "def f():\n"} for i in range(12)])
    cfg = load_config(None, _overrides(tiny_model_dir, data, tmp_path, **{
        "reward.functions": "[code_tests, e2e_bad_rewards:hang]", "reward.timeout_s": 20}))
    cfg.reward.functions[1].timeout_s = 1.0  # per-function deadline
    t = time.perf_counter()
    steps = _metrics(train(cfg).run_dir)
    assert time.perf_counter() - t < 60
    assert [m["reward/e2e_bad_rewards:hang/failures"] for m in steps] == [1.0, 1.0]
    assert all(m["reward/code_tests/failures"] == 0.0 for m in steps)
    assert all(m["reward/code_tests"] == 0.0 for m in steps)  # a random model writes no working code
