"""random: the spurious-reward probe of Shao et al. 2025. Its draws against the binomial, their
reproducibility and independence from the text, that it never becomes the correctness source, its
option checks, and tiny GRPO runs that log true accuracy beside it and draw the same rewards on resume."""

import hashlib
import json
import math
from pathlib import Path

import pytest

from anabranch import load_config, train
from anabranch.config import ConfigError, RewardConfig, RewardFunctionConfig
from anabranch.eval.accuracy import correctness_source, truth_source
from anabranch.rewards import build_rewards, score_detailed
from anabranch.rewards.random_reward import random_reward
from anabranch.rewards.registry import REWARDS

PROMPTS = [f"Q{g}: what is {g} + 1?" for g in range(4)]


def batch(prompts=PROMPTS, n=8):
    """The trainer's layout: each prompt's n samples in a row, with their group index."""
    return [p for p in prompts for _ in range(n)], [g for g in range(len(prompts)) for _ in range(n)]


def draws(completions=None, prompts=PROMPTS, n=8, **kw):
    ps, groups = batch(prompts, n)
    return random_reward(ps, completions or [f"answer {i}" for i in range(len(ps))], group_index=groups, **kw)


@pytest.mark.parametrize("p", [0.5, 0.2, 0.9])
def test_mean_is_p_within_the_binomial_error(p):
    prompts = [f"problem {i}" for i in range(250)]
    values = draws(prompts=prompts, n=16, p=p)  # 4000 draws
    assert set(values) <= {0.0, 1.0}
    n = len(values)
    std = math.sqrt(p * (1 - p) / n)  # the binomial mean's standard error: 0.0079 at p = 0.5
    assert abs(sum(values) / n - p) < 4 * std, (sum(values) / n, p)


def test_p_zero_and_one_are_exact():
    assert draws(p=0.0) == [0.0] * 32
    assert draws(p=1) == [1.0] * 32


def test_draw_matches_the_documented_hash():
    """u = first 64 bits of SHA-256("anabranch.random_reward|seed|key|g|j") / 2^64, key = SHA-256 of the
    length-prefixed prompts; recomputed here from that description, for one (group, sample)."""
    ps, groups = batch()
    h = hashlib.sha256()
    for prompt in ps:
        h.update(len(prompt.encode()).to_bytes(8, "little") + prompt.encode())
    us = [int.from_bytes(hashlib.sha256(f"anabranch.random_reward|3|{h.hexdigest()}|{g}|{j}".encode()).digest()[:8],
                         "big") / 2 ** 64 for g in range(4) for j in range(8)]
    for p in (0.3, 0.5, 0.8):
        assert draws(p=p, seed=3) == [float(u < p) for u in us]


def test_same_key_same_draw_and_samples_differ():
    first, again = draws(seed=1), draws(seed=1)
    assert first == again  # same (seed, batch, group, sample): same draws
    assert any(first[g * 8:(g + 1) * 8] != first[g * 8:g * 8 + 1] * 8 for g in range(4))  # samples of a group differ
    assert draws(seed=2) != first  # another seed
    assert draws(seed=1, prompts=PROMPTS[::-1]) != first  # another step's batch (the sampler's order)
    assert draws(seed=1, train_step=5) != draws(seed=1, train_step=6) != first  # a step number, when given
    assert draws(seed=1, train_step=[5] * 32) == draws(seed=1, train_step=5)


def test_independent_of_the_completion_text():
    a = draws(completions=["\\boxed{1}"] * 32)
    b = draws(completions=[f"nonsense {i} " * i for i in range(32)])
    c = draws(completions=[""] * 32)
    assert a == b == c


def test_a_prompt_in_two_groups_draws_for_each_group():
    ps = ["same prompt"] * 16
    one = random_reward(ps, ["x"] * 16, group_index=[0] * 8 + [1] * 8)
    assert one[:8] != one[8:]


def sources(*items, isolation="none"):
    return build_rewards(RewardConfig(functions=[RewardFunctionConfig(name=n, weight=w) for n, w in items],
                                      isolation=isolation))


def test_never_the_correctness_source():
    mixed = sources(("random", 1.0), ("math_verify", 0.0))
    assert correctness_source(mixed).name == "math_verify"
    assert correctness_source(sources(("random", 1.0))) is None
    rows = [{"answer": "2"}, {"answer": "3"}]
    # Held-out accuracy of a run on [random] alone is measured against the true answers (math_verify).
    assert truth_source(sources(("random", 1.0)), rows).name == "math_verify"


def test_scored_through_the_guard_in_a_forked_process():
    """The default isolation runs the reward in a forked child: same draws as a direct call, and the
    weight-0 verifier's column is the true correctness, not the random one."""
    ps, groups = batch(n=4)
    comps = ["\\boxed{%d}" % (g + 1) if i % 2 else "no idea" for i, g in enumerate(groups)]
    rows = [{"answer": str(g + 1)} for g in groups]
    out = score_detailed(sources(("random", 1.0), ("math_verify", 0.0), isolation="process"), ps, comps, rows,
                         group_index=groups)
    assert out.metrics["reward/random/failures"] == 0.0
    assert out.per_source["random"] == random_reward(ps, comps, group_index=groups)
    assert out.per_source["math_verify"] == [float(i % 2) for i in range(16)]
    assert out.total == out.per_source["random"]


@pytest.mark.parametrize("params, key", [
    ({"p": -0.1}, "params.p"), ({"p": 1.5}, "params.p"), ({"p": "0.5"}, "params.p"),
    ({"p": True}, "params.p"), ({"p": float("nan")}, "params.p"),
    ({"seed": "7"}, "params.seed"), ({"seed": 1.5}, "params.seed"),
    ({"prob": 0.3}, "unknown option(s) prob"),
])
def test_invalid_options_are_config_errors(params, key):
    cfg = RewardConfig(functions=[RewardFunctionConfig(name="random", params=params)])
    with pytest.raises(ConfigError, match=r"reward\.functions\[random\]") as err:
        build_rewards(cfg)
    assert key in str(err.value)
    if "prob" not in params:  # a direct call checks its values too (unknown names are row fields there)
        with pytest.raises(ConfigError):
            random_reward(["q"], ["a"], **params)


# ---- tiny GRPO runs --------------------------------------------------------------------------


def overrides(model_dir, data, out, **extra):
    base = {
        "model.path": model_dir, "task.name": "file", "task.path": data, "task.eval_size": 4,
        "rollout.n": 4, "rollout.prompts_per_step": 2, "rollout.max_new_tokens": 4, "trainer.device": "cpu",
        "trainer.steps": 3, "trainer.lr": 1e-3, "trainer.output_dir": str(out), "trainer.progress": False,
        "trainer.eval_before": False, "trainer.eval_after": False, "trainer.save_final": False,
        "trainer.tensorboard": False, "algorithm.name": "grpo",
        "reward.functions": "[random, math_verify*0]",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def step_rows(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r]


def test_grpo_on_random_rewards_logs_true_accuracy(tiny_model_dir, write_jsonl, tmp_path):
    data = write_jsonl([{"prompt": f"Q{i}: say seven", "answer": "7"} for i in range(12)])
    steps = step_rows(train(load_config(None, overrides(tiny_model_dir, data, tmp_path, **{
        "trainer.run_name": "probe"}))).run_dir)
    assert len(steps) == 3
    for m in steps:
        assert m["reward/random/failures"] == 0.0 and m["reward/math_verify/failures"] == 0.0
        assert m["reward/mean"] == pytest.approx(m["reward/random"])  # math_verify*0 adds nothing
        assert m["accuracy"] == m["reward/math_verify"]  # accuracy is the verifier's, not the coin's
        assert m["reward/random"] * 8 == pytest.approx(round(m["reward/random"] * 8))  # 8 draws of 0/1
    # The random model never says 7 while the coin pays about half the samples: were the coin the
    # correctness source, accuracy would equal reward/random.
    assert all(m["accuracy"] == 0.0 for m in steps)
    assert sum(m["reward/random"] for m in steps) > 0


def test_resumed_run_draws_the_same_rewards(tiny_model_dir, write_jsonl, tmp_path):
    data = write_jsonl([{"prompt": f"Q{i}: say seven", "answer": "7"} for i in range(12)])
    full = train(load_config(None, overrides(tiny_model_dir, data, tmp_path, **{
        "trainer.steps": 4, "trainer.save_every": 2, "trainer.run_name": "full"})))
    resumed = train(load_config(None, overrides(tiny_model_dir, data, tmp_path, **{
        "trainer.steps": 4, "trainer.run_name": "resumed",
        "trainer.resume": str(Path(full.run_dir) / "checkpoints" / "step-000002")})))
    a, b = step_rows(full.run_dir), step_rows(resumed.run_dir)
    assert [m["reward/random"] for m in b] == [m["reward/random"] for m in a[2:]]
    assert len({m["reward/random"] for m in a}) > 1 or a[0]["reward/std"] > 0  # the draws do vary


KEYS_FILE = {"path": None}  # rewards may be scored in a forked process: the calls are logged to a file


if "random_test_record_step" not in REWARDS:
    @REWARDS.register("random_test_record_step")
    def _record_step(prompts, completions, train_step=None, sample_round=None, **_):
        with open(KEYS_FILE["path"], "a") as f:
            f.write(json.dumps([sorted(set(train_step)), sorted(set(sample_round))]) + "\n")
        return [0.0] * len(completions)


def test_the_trainer_passes_the_step_and_round_so_a_one_prompt_task_draws_anew(tiny_model_dir, write_jsonl,
                                                                                 tmp_path):
    """The draws are keyed on (prompts, step, round): a task whose batch repeats still gets new draws."""
    KEYS_FILE["path"] = str(tmp_path / "keys.jsonl")
    data = write_jsonl([{"prompt": f"Q{i}: say seven", "answer": "7"} for i in range(12)])
    train(load_config(None, overrides(tiny_model_dir, data, tmp_path, **{
        "trainer.steps": 2, "trainer.run_name": "keys", "algorithm.dynamic_sampling": True,
        "algorithm.max_sample_batches": 2, "reward.functions": "[random_test_record_step, math_verify*0]"})))
    # Nothing is ever correct, so dynamic sampling runs both rounds of each step.
    seen = [json.loads(line) for line in Path(KEYS_FILE["path"]).read_text().splitlines()]
    assert seen == [[[1], [1]], [[1], [2]], [[2], [1]], [[2], [2]]]
    same_prompts = ["q"] * 8
    assert draws(prompts=same_prompts, train_step=1, sample_round=1) != draws(prompts=same_prompts, train_step=2,
                                                                              sample_round=1)
    assert draws(prompts=same_prompts, train_step=1, sample_round=1) != draws(prompts=same_prompts, train_step=1,
                                                                              sample_round=2)
