"""End to end with a tiny random model: reward really rises, the run directory is complete, and
the exported checkpoint loads with plain transformers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from anabranch import load_config, train


def digit_task(write_jsonl, n=40):
    # Every answer is 7: a random model must learn to end its reply with "7".
    return write_jsonl([{"prompt": f"Q{i}: say seven", "answer": "7"} for i in range(n)])


def tiny_overrides(model_dir, data, out, **extra):
    base = {
        "model.path": model_dir, "task.name": "file", "task.path": data, "task.eval_size": 8,
        "rollout.n": 8, "rollout.prompts_per_step": 4, "rollout.max_new_tokens": 4,
        "trainer.steps": 30, "trainer.lr": 1e-2, "trainer.output_dir": str(out),
        "trainer.run_name": "tiny", "trainer.progress": False, "trainer.micro_batch_size": 32,
        # The learning these tests assert was calibrated on the CPU's sampling RNG streams; on a GPU
        # (CUDA RNG) the tiny model's trajectories differ. GPU runs: benchmarks/gpu_check.sh.
        "trainer.device": "cpu",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def test_grpo_reward_rises_and_run_dir_is_complete(tiny_model_dir, write_jsonl, tmp_path):
    cfg = load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path))
    result = train(cfg)
    rewards = [m["reward/mean"] for m in result.history]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.3, rewards
    assert result.accuracy_after > result.accuracy_before

    run = Path(result.run_dir)
    assert load_config(run / "config.yaml") == cfg  # the resolved config reloads to the same
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    for key in ("loss", "entropy", "grad_norm", "accuracy", "clip_frac", "approx_kl", "time/step_s"):
        assert all(isinstance(r[key], float) for r in steps), key
    # The step's wall time holds its parts.
    parts = ("time/generate_s", "time/forward_backward_s", "time/optimizer_s", "time/sync_weights_s")
    assert all(0 < sum(r[k] for k in parts) <= r["time/step_s"] for r in steps)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and {"step", "completion", "reward", "answer"} <= set(samples[0])
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))

    # The exported checkpoint is plain Hugging Face: load it in a fresh interpreter with no anabranch.
    code = ("import sys; sys.modules['anabranch'] = None\n"
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f"m = AutoModelForCausalLM.from_pretrained({str(result.final_model_dir)!r})\n"
            f"t = AutoTokenizer.from_pretrained({str(result.final_model_dir)!r})\n"
            "print(type(m).__name__, len(t))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["LlamaForCausalLM", "99"]
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(result.final_model_dir)
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    w = dict(reloaded.named_parameters())
    changed = [n for n, p in start.named_parameters() if not torch.equal(p, w[n])]
    assert changed  # training changed the saved weights


def test_kl_to_reference_loads_reference_and_logs_kl(tiny_model_dir, write_jsonl, tmp_path):
    cfg = load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path,
                                           **{"trainer.steps": 3, "algorithm.kl_coef": 0.1,
                                              "algorithm.ppo_epochs": 2, "trainer.eval_before": False}))
    result = train(cfg)
    assert all("kl_ref" in m and m["kl_ref"] >= 0 for m in result.history)
    assert result.history[0]["kl_ref"] < 1e-6  # policy == reference before the first update


def run_cli(*args, cwd=None):
    import os

    src = str(Path(__file__).parents[1] / "src")  # this checkout's code, installed or not
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "anabranch", *args], capture_output=True, text=True,
                          timeout=600, cwd=cwd, env=env)


def test_cli_rejects_unknown_key_before_any_work():
    out = run_cli("train", "rollout.nn=8")
    assert out.returncode == 2
    assert "unknown config key 'rollout.nn'" in out.stderr and "'rollout.n'" in out.stderr


def test_cli_print_config(tmp_path):
    out = run_cli("train", "--print-config", "rollout.n=3")
    assert out.returncode == 0 and "n: 3" in out.stdout


def test_cli_trains_tiny_model(tiny_model_dir, write_jsonl, tmp_path):
    out = run_cli("train", *tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path,
                                           **{"trainer.steps": 2}))
    assert out.returncode == 0, out.stderr
    assert "held-out accuracy: before" in out.stdout
    assert (tmp_path / "tiny" / "final" / "config.json").is_file()


def test_group_estimator_needs_two_samples(tiny_model_dir, write_jsonl, tmp_path):
    from anabranch.config import ConfigError

    cfg = load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path,
                                           **{"rollout.n": 1}))
    with pytest.raises(ConfigError, match="rollout.n"):
        train(cfg)


@pytest.mark.parametrize("tokens,expected", [(-1, 1), (0, 4)])
def test_cpu_default_packs_micro_batches_by_tokens(tiny_model_dir, write_jsonl, tmp_path, tokens, expected):
    """trainer.micro_batch_tokens=-1 (the default) is a token budget on CPU: the 4 groups of 8 short
    rows fit one micro-batch, where rows of trainer.micro_batch_size=2 give one per group (groups stay whole)."""
    cfg = load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path, **{
        "trainer.steps": 2, "trainer.micro_batch_size": 2, "trainer.micro_batch_tokens": tokens,
        "trainer.eval_before": False, "trainer.eval_after": False}))
    assert load_config(None, []).trainer.micro_batch_tokens == -1  # the default
    result = train(cfg)
    assert [m["micro_batches"] for m in result.history] == [float(expected)] * 2
