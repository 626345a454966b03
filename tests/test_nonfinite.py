"""NaN/inf losses and gradients: the update is skipped, the weights stay as they were (and
finite), the steps are counted and logged, and a long enough streak stops the run with a clear
message and a checkpoint holding the last good weights."""

import json
import math

import pytest
import torch

from anabranch import load_config, train
from anabranch.algorithms.registries import OBJECTIVES
from anabranch.rewards.registry import REWARDS
from anabranch.trainer.checkpoint import list_checkpoints, load_state
from anabranch.trainer.nonfinite import NonFiniteGuard
from anabranch.trainer.signals import RunStopped

from test_train_e2e import tiny_overrides

NAN_FROM_CALL = {"n": 2}  # reward calls from this one on return NaN
CALLS = {"n": 0}


if "test_nan_from_call" not in REWARDS:
    @REWARDS.register("test_nan_from_call")
    def nan_from_call(prompts, completions, **_):
        CALLS["n"] += 1
        value = float("nan") if CALLS["n"] >= NAN_FROM_CALL["n"] else 1.0
        return [value * (i % 2) for i in range(len(completions))]  # varied, so advantages are not all 0

if "test_nan_grad" not in OBJECTIVES:
    @OBJECTIVES.register("test_nan_grad", needs=())
    def nan_grad_loss(log_prob, old_log_prob, advantages, response_mask, ctx):
        # Finite value (0), non-finite gradient: d sqrt(x)/dx at x = 0 is inf, times 0 is NaN.
        return torch.sqrt((log_prob * response_mask).sum() * 0.0), {}


def cfg_for(model_dir, data, out, **extra):
    base = {"trainer.eval_before": False, "trainer.eval_after": False, "task.eval_size": 4,
            "rollout.n": 4, "trainer.save_final": False, "trainer.tensorboard": False}
    base.update(extra)
    return load_config(None, tiny_overrides(model_dir, data, out, **base))


def weights(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path)).state_dict()


@pytest.fixture
def data(write_jsonl):
    return write_jsonl([{"prompt": f"Q{i}: say seven", "answer": "7"} for i in range(16)])


def test_nan_streak_skips_updates_then_stops_with_last_good_checkpoint(tiny_model_dir, data, tmp_path, capsys):
    CALLS["n"], NAN_FROM_CALL["n"] = 0, 2  # step 1 fine, steps 2 and 3 NaN
    cfg = cfg_for(tiny_model_dir, data, tmp_path, **{"reward.functions": "[test_nan_from_call]",
                                                       "trainer.steps": 6, "trainer.save_every": 1,
                                                       "trainer.max_nonfinite_in_a_row": 2,
                                                       # in-process, so the call counter above is shared
                                                       "reward.isolation": "none"})
    with pytest.raises(RunStopped) as e:
        train(cfg)
    assert e.value.exit_code == 3
    assert "2 steps in a row had a non-finite" in str(e.value) and "step 1, the last finite update" in str(e.value)
    assert "trainer.max_nonfinite_in_a_row" in str(e.value)
    captured = capsys.readouterr()
    assert "step 2: non-finite loss" in captured.out + captured.err  # each skipped step is reported

    folder = tmp_path / "tiny" / "checkpoints"
    assert [p.name for p in list_checkpoints(folder)] == ["step-000001", "step-000002", "step-000003"]
    good, last = weights(folder / "step-000001" / "model"), weights(folder / "step-000003" / "model")
    assert all(torch.equal(good[k], last[k]) for k in good)  # the NaN steps changed nothing
    assert all(torch.isfinite(v).all() for v in last.values())
    assert load_state(folder / "step-000003")["nonfinite"]["in_a_row"] == 2

    rows = [json.loads(line) for line in (tmp_path / "tiny" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_updates"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["nonfinite/in_a_row"] for r in rows] == [0.0, 1.0, 2.0]
    assert [r["nonfinite/steps_total"] for r in rows] == [0.0, 1.0, 2.0]
    assert rows[1]["loss"] == "nan"  # logged as a string: JSON has no NaN


def test_non_finite_gradient_with_finite_loss_is_skipped(tiny_model_dir, data, tmp_path, recwarn):
    cfg = cfg_for(tiny_model_dir, data, tmp_path, **{"algorithm.loss": "test_nan_grad", "trainer.steps": 2,
                                                       "trainer.save_final": True})
    result = train(cfg)  # 2 bad steps < the default limit: the run finishes
    # The skipped optimizer steps do not leak torch's scheduler-order warning to the user.
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]
    assert [m["skipped_updates"] for m in result.history] == [1.0, 1.0]
    assert all(math.isfinite(m["loss"]) and not math.isfinite(m["grad_norm"]) for m in result.history)
    start, end = weights(tiny_model_dir), weights(result.final_model_dir)
    assert all(torch.equal(start[k], end[k]) for k in start)  # no NaN reached the weights
    assert result.history[-1]["nonfinite/steps_total"] == 2.0


def test_guard_counts_streaks_and_resets_on_a_good_step():
    g = NonFiniteGuard(limit=2)
    seq = [{"loss": 1.0, "grad_norm": 1.0, "skipped_updates": 0.0},
           {"loss": float("nan"), "grad_norm": float("nan"), "skipped_updates": 1.0},
           {"loss": 0.5, "grad_norm": 2.0, "skipped_updates": 0.0},
           {"loss": float("inf"), "grad_norm": 1.0, "skipped_updates": 1.0}]
    warnings = [g.observe(i + 1, m) for i, m in enumerate(seq)]
    assert [w is not None for w in warnings] == [False, True, False, True]
    assert (g.in_a_row, g.total, g.last_good_step, g.should_stop) == (1, 2, 3, False)
    g.observe(5, {"loss": float("nan"), "grad_norm": 0.0, "skipped_updates": 1.0})
    assert g.should_stop and "weights are those of step 3" in g.stop_message(5)


def test_a_skipped_spear_replay_step_says_the_on_policy_update_was_applied():
    g = NonFiniteGuard(limit=3)
    # the on-policy step finite, SPEAR's separate replay step skipped (loop.py adds it to skipped_updates)
    only_replay = g.observe(1, {"loss": 0.3, "grad_norm": 1.0, "skipped_updates": 1.0, "spear/replay/skipped": 1.0})
    assert "replay step skipped, the on-policy update applied" in only_replay and "weights unchanged" not in only_replay
    # both skipped (the on-policy step too): the weights did not move
    both = g.observe(2, {"loss": 0.3, "grad_norm": 1.0, "skipped_updates": 2.0, "spear/replay/skipped": 1.0})
    assert "weights unchanged" in both
    nan_on_policy = g.observe(3, {"loss": float("nan"), "grad_norm": 1.0, "skipped_updates": 2.0,
                                  "spear/replay/skipped": 1.0})
    assert "weights unchanged" in nan_on_policy and g.in_a_row == 3
