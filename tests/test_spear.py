"""SPEAR (algorithms/spear.py, trainer/spear_replay.py): baseline and recalibration on hand numbers, the buffer's
admission / drop / age / cap, replay against behaviour log-probs, Clip-Cov's tokens, refusals, DDP, a tiny run."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from anabranch import load_config, train
from anabranch.algorithms.spear import (BaselineHistory, covariance_keep, group_reward_stats, recalibrated,
                                        replay_coef)
from anabranch.config import Config, ConfigError
from anabranch.rewards.registry import REWARDS
from anabranch.rollout.base import Rollout
from anabranch.trainer.spear_replay import Spear, check_config

from test_rorecomp import _tiny_rollout, _update
from test_train_e2e import tiny_overrides
from two_process import join_gloo, spawn_two

if "spear_test_parity" not in REWARDS:
    @REWARDS.register("spear_test_parity", correctness=True)
    def spear_test_parity(prompts, completions, answer, **_):
        return [float(sum(map(ord, c)) % 2 == 0) for c in completions]


def _cfg(**spear) -> Config:
    cfg = Config()
    cfg.algorithm.spear.enabled = True
    cfg.algorithm.spear.warmup_steps = 0
    cfg.algorithm.spear.cov_clip_ratio = 0.0
    for k, v in spear.items():
        setattr(cfg.algorithm.spear, k, v)
    return cfg


def _rollout(step: int, n: int = 6, width: int = 4) -> Rollout:
    return Rollout(prompt_ids=torch.ones(n, 2, dtype=torch.long), prompt_mask=torch.ones(n, 2, dtype=torch.long),
                   response_ids=torch.arange(n * width).view(n, width) + 5,
                   response_mask=torch.ones(n, width, dtype=torch.long),
                   group_index=torch.arange(n) // 3, prompts=["p", "q"],
                   completions=[f"{step}:{i}" for i in range(n)], truncated=torch.zeros(n, dtype=torch.bool))


class _Batch:
    def __init__(self, rollout):
        self.rollout, self.metrics = rollout, {}


def _grpo(rewards: torch.Tensor) -> torch.Tensor:
    """Mean-centred group advantages of two groups of three (by hand: R − group mean)."""
    g = rewards.view(2, 3)
    return (g - g.mean(-1, keepdim=True)).flatten()


def _step(sp: Spear, s: int, rewards: list[float]):
    r = _rollout(s)
    rw = torch.tensor(rewards)
    adv = _grpo(rw)[:, None].expand(6, 4).clone()
    b = _Batch(r)
    out = sp.step(b, r, adv, {"old_log_prob": torch.full((6, 4), -float(s))}, rw, s)
    return out, b.metrics


def test_group_stats_and_the_p50_baseline_over_recent_groups():
    means, stds = group_reward_stats(torch.tensor([0.6, 0.0, 0.0, 1.0, 1.0, 0.0]), torch.tensor([0, 0, 0, 1, 1, 1]))
    assert means == pytest.approx([0.2, 2 / 3])
    assert stds == pytest.approx([math.sqrt(0.12), math.sqrt(1 / 3)])  # unbiased: Σ(r − μ)² / 2
    h = BaselineHistory(capacity=3)
    assert h.baseline() is None
    h.add(1, [0.0, 1.0], [0.1, 0.3])
    assert h.baseline() == pytest.approx((0.5, 0.2))  # the median of two is their midpoint
    h.add(2, [0.5, 0.25], [0.2, 0.4])  # 4 groups > 3: step 1 leaves, whole
    assert h.baseline() == pytest.approx((0.375, 0.3))
    h.add(3, [0.9, 0.8, 0.7, 0.6], [0.0] * 4)  # one step over the cap alone stays
    assert h.baseline() == pytest.approx((0.75, 0.0))


def test_recalibration_on_hand_numbers():
    rewards = torch.tensor([1.0, 0.6, 0.3])
    stored = torch.tensor([2.0, -1.0, 0.5])
    got = recalibrated(rewards, stored, "p50", (0.375, 0.2), 0.9, False, 1e-6)
    assert got.tolist() == pytest.approx([0.625, 0.225, -0.075])
    got = recalibrated(rewards, stored, "p50", (0.375, 0.2), 0.9, True, 0.0)
    assert got.tolist() == pytest.approx([3.125, 1.125, -0.375])
    assert recalibrated(rewards, stored, "decay", None, 0.9, False, 0.0).tolist() == pytest.approx([1.8, -0.9, 0.45])
    assert recalibrated(rewards, stored, "p50", None, 0.9, False, 0.0).tolist() == [0.0, 0.0, 0.0]


def test_replay_coefficient_rises_on_a_half_cosine():
    want = [0.0, (1 - math.cos(math.pi / 4)) / 2, 0.5, (1 - math.cos(3 * math.pi / 4)) / 2, 1.0, 1.0]
    assert [replay_coef(k, 2.0, 4) for k in range(6)] == pytest.approx([2 * w for w in want])
    assert replay_coef(0, 2.0, 0) == 2.0


def test_buffer_admits_positive_wins_drops_recalibrated_losers_and_ages_out():
    sp = Spear(_cfg(replay_rows=4, max_age=1))
    # Step 1: groups [0.6, 0, 0] and [1, 1, 0]: A = [0.4, −0.2, −0.2 | 1/3, 1/3, −2/3]; b = P50(0.2, 2/3) = 0.4333.
    # Rows 0 (0.6 > b), 3 and 4 (1 > b) enter; the negative-advantage rows never do.
    _, m = _step(sp, 1, [0.6, 0.0, 0.0, 1.0, 1.0, 0.0])
    assert m["spear/admitted_rows"] == 3 and m["spear/buffer_rows"] == 3
    assert m["spear/baseline"] == pytest.approx((0.2 + 2 / 3) / 2)
    assert [c.rollout.completions for c in sp.buffer.chunks] == [["1:0", "1:3", "1:4"]]
    # Step 2: all-right groups (A = 0: none enter). b = P50(0.2, 2/3, 1, 1) = 5/6: row 1:0 (R = 0.6) is no
    # longer a win and leaves; 1:3 and 1:4 (Â = 1/6) stay. 2 rows < K = 4: nothing replays.
    out, m = _step(sp, 2, [1.0] * 6)
    assert m["spear/dropped_rows"] == 1 and m["spear/buffer_rows"] == 2 and m["spear/replayed_rows"] == 0
    assert m["spear/baseline"] == pytest.approx(5 / 6) and len(out.rollout.completions) == 6
    # Step 3: rows born at step 1 are 2 > max_age = 1 steps old: expired untrained.
    _, m = _step(sp, 3, [1.0] * 6)
    assert m["spear/expired_rows"] == 2 and m["spear/buffer_rows"] == 0


def test_buffer_cap_keeps_the_newest_wins():
    sp = Spear(_cfg(buffer_size=2, replay_rows=2))
    _, m = _step(sp, 1, [0.6, 0.0, 0.0, 1.0, 1.0, 0.0])
    assert m["spear/admitted_rows"] == 2 and [c.rollout.completions for c in sp.buffer.chunks] == [["1:3", "1:4"]]


def test_due_rows_replay_with_recalibrated_scaled_advantages_and_behaviour_marks():
    sp = Spear(_cfg(replay_rows=2, coef=0.5))
    _step(sp, 1, [0.6, 0.0, 0.0, 1.0, 1.0, 0.0])  # 1:0, 1:3, 1:4 enter
    out, m = _step(sp, 2, [1.0] * 6)  # b = 5/6: 1:0 leaves; the 2 oldest waiting (1:3, 1:4) replay
    assert out.rollout.completions == [f"2:{i}" for i in range(6)] + ["1:3", "1:4"]
    assert out.advantages[:6].abs().sum() == 0  # this step's own advantages (all-right groups: 0)
    # c · (R − b) / (s_b + ε) (algorithm.norm_adv_by_std is on by default): s_b = P50(√0.12, √(1/3), 0, 0) = √0.12/2
    s_b, eps = math.sqrt(0.12) / 2, Config().algorithm.adv_epsilon
    assert out.advantages[6:].flatten().tolist() == pytest.approx([0.5 * (1 - 5 / 6) / (s_b + eps)] * 8)
    pre = out.precomputed
    assert pre["behaviour_rows"].tolist() == [False] * 6 + [True, True]
    assert pre["stale_rows"].tolist() == [False] * 6 + [True, True]
    assert (pre["behaviour_log_prob"][6:] == -1.0).all()  # step 1's π_old (its precomputed old_log_prob)
    assert out.rewards.tolist() == [1.0] * 8
    assert m["spear/replayed_rows"] == 2 and m["spear/replay_coef"] == 0.5 and m["spear/buffer_rows"] == 0
    # checkpoint / resume: buffer and baseline come back
    fresh = Spear(_cfg(replay_rows=2, coef=0.5))
    _step(sp, 3, [0.6, 0.0, 0.0, 1.0, 1.0, 0.0])
    fresh.load_state_dict(sp.state_dict())
    assert [c.rollout.completions for c in fresh.buffer.chunks] == [c.rollout.completions for c in sp.buffer.chunks]
    assert fresh.history.baseline() == sp.history.baseline()


def test_replayed_rows_train_against_their_behaviour_log_probs(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from anabranch.trainer.step import no_grad_log_probs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).float().eval()
    sp = Spear(_cfg(replay_rows=2), model=model)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0])

    def step(s, seed):
        r = _tiny_rollout(6, seed=seed)
        r.group_index = torch.arange(6) // 3
        b = _Batch(r)
        adv = _grpo(rewards)[:, None] * r.response_mask
        return r, sp.step(b, r, adv, {}, rewards, s)

    r1, _ = step(1, seed=1)  # rows 0 and 3 (R = 1 > b = 1/3) enter with π_1's log-probs (no-grad pass)
    lp1 = no_grad_log_probs(model, r1, 8, 1.0)
    with torch.no_grad():  # the policy moves
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    _, out = step(2, seed=2)
    assert out.rollout.completions[6:] == ["1:0", "1:3"]
    pre, mask = out.precomputed, out.rollout.response_mask.bool()
    assert torch.allclose(pre["behaviour_log_prob"][6:][mask[6:]], lp1[[0, 3]][mask[6:]], atol=1e-5)
    lp2 = no_grad_log_probs(model, out.rollout, 8, 1.0)
    gap = (pre["behaviour_log_prob"] - lp2)[6:][mask[6:]]
    assert gap.abs().max() > 1e-3  # ratio π_θ/π_1 is not 1 on the replayed rows
    metrics, g = _update(model, out.rollout, out.advantages, pre)
    assert metrics["approx_kl"] == pytest.approx(float(gap.sum()) / float(mask.sum()), abs=1e-5)
    _, g_ratio_one = _update(model, out.rollout, out.advantages, {})
    assert (g - g_ratio_one).abs().max() > 1e-5


def test_covariance_clip_detaches_the_hand_computed_tokens():
    # Two replayed rows, Â = 2 and 0 (mean 1), log π = [0, −4, −1] and [−1, −1, −1] (mean −4/3):
    # Cov = [4/3, −8/3, 1/3] on row 0 and −1/3 on each token of row 1.
    lp = torch.tensor([[0.0, -4.0, -1.0], [-1.0, -1.0, -1.0]])
    adv = torch.tensor([[2.0] * 3, [0.0] * 3])
    mask = torch.ones(2, 3)
    a = Config().algorithm  # ε_low 0.2, ε_high 0.28 (ppo_clip)
    keep = covariance_keep(lp, lp, adv, mask, a, 0.2, 1.0, 40.0)  # band [1, 40]: token (0, 0) alone; k = 1
    assert keep.tolist() == [[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    keep = covariance_keep(lp, lp, adv, mask, a, 0.5, 0.3, 40.0)  # band [0.3, 40]: (0, 0), (0, 2); k = 3 > 2
    assert keep.tolist() == [[0.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    # Token (0, 0) already cut by the PPO clip (r = e > 1.28 with Â > 0): not a candidate, nothing detached.
    behaviour = lp.clone()
    behaviour[0, 0] -= 1.0
    assert covariance_keep(lp, behaviour, adv, mask, a, 0.2, 1.0, 40.0).tolist() == [[1.0] * 3, [1.0] * 3]
    assert covariance_keep(lp, lp, adv, mask, a, 0.0, 1.0, 40.0).tolist() == [[1.0] * 3, [1.0] * 3]


def test_replay_zeroes_the_advantage_of_the_tokens_clip_cov_picks(monkeypatch):
    # Decay recalibration (Â = 0.9·A): step 1's [1, 0, 0 | 1, 1, 0] gives A = 2/3, 1/3, 1/3 on rows 0, 3, 4; K = 2
    # replays 1:0 (Â = 0.6) and 1:3 (Â = 0.3): Â − mean = ±0.15. π_θ now (the stubbed no-grad pass):
    # log π = [−1, −3, −3, −3] and [−3] × 4, mean −2.875: Cov(0, 0) = 1.875 · 0.15 = 0.28125, every other
    # |Cov| = 0.01875. Band [0.1, 40], ρ = 1/8 of 8 tokens: token (0, 0) alone (ratio to π_1's −1: exactly 1).
    import anabranch.trainer.spear_replay as spear_replay

    lp = torch.tensor([[-1.0, -3.0, -3.0, -3.0], [-3.0] * 4])
    monkeypatch.setattr(spear_replay, "rollout_forward", lambda model, rows, *a, **k: (lp, None))
    sp = Spear(_cfg(replay_rows=2, recalibration="decay", cov_clip_ratio=0.125, cov_clip_low=0.1), model=object())
    _step(sp, 1, [1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    out, m = _step(sp, 2, [1.0] * 6)
    assert out.rollout.completions[6:] == ["1:0", "1:3"]
    assert out.advantages[6:].flatten().tolist() == pytest.approx([0.0, 0.6, 0.6, 0.6] + [0.3] * 4)
    assert m["spear/cov_clipped_frac"] == pytest.approx(1 / 8)


@pytest.mark.parametrize("key,value,match", [
    ("algorithm.rorecomp_fraction", 0.5, "rorecomp_fraction"),
    ("algorithm.loss", "oreal", "loss=oreal"),
    ("algorithm.name", "flowrl", "flowrl"),
    ("algorithm.spear.buffer_size", 0, "buffer_size must be >= 1"),
    ("algorithm.spear.recalibration", "mean", "recalibration must be one of"),
    ("algorithm.spear.advantage_decay", 1.5, "advantage_decay"),
    ("algorithm.spear.cov_clip_low", 50.0, "cov_clip_low"),
    ("algorithm.spear.replay_rows", 4096, "exceeds algorithm.spear.buffer_size"),
    ("algorithm.guide.enabled", True, "guide"),
])
def test_refusals(key, value, match):
    cfg = _cfg()
    section, _, name = key.rpartition(".")
    obj = cfg
    for part in section.split("."):
        obj = getattr(obj, part)
    setattr(obj, name, value)
    with pytest.raises(ConfigError, match=match):
        check_config(cfg)


def test_keys_refused_while_off_and_off_costs_nothing(tiny_model_dir, write_jsonl, tmp_path):
    assert Spear.create(Config()) is None
    data = write_jsonl([{"prompt": "x", "answer": "7"}])
    with pytest.raises(ConfigError, match="algorithm.spear.*algorithm.spear.enabled=true"):
        load_config(None, tiny_overrides(tiny_model_dir, data, tmp_path, **{"algorithm.spear.buffer_size": 8}))
    with pytest.raises(ConfigError, match="rorecomp_fraction"):  # refused at load, not at the first step
        load_config(None, tiny_overrides(tiny_model_dir, data, tmp_path, **{
            "algorithm.spear.enabled": True, "algorithm.rorecomp_fraction": 0.5, "rollout.n": 4}))


@pytest.mark.parametrize("key", [f.name for f in dataclasses.fields(Config().algorithm.spear)
                                 if f.name not in ("enabled", "tool_reward")])  # the nested section: test_spear_modes
def test_every_knob_is_refused_while_spear_is_off(key):
    from anabranch.config_checks import check_whole_config

    section = Config().algorithm.spear
    value = getattr(section, key)
    changed = {bool: lambda v: not v, int: lambda v: v + 7, float: lambda v: v + 0.125, str: lambda v: v + "x"}
    cfg = Config()
    cfg = dataclasses.replace(cfg, algorithm=dataclasses.replace(
        cfg.algorithm, spear=dataclasses.replace(section, **{key: changed[type(value)](value)})))
    with pytest.raises(ConfigError, match=rf"'algorithm\.spear\.{key}' has no effect unless algorithm\.spear\.enabled"):
        check_whole_config(cfg)


def test_tiny_run_replays_wins_logs_spear_metrics_and_checkpoints_the_buffer(tiny_model_dir, write_jsonl, tmp_path):
    data = write_jsonl([{"prompt": f"Q{i}: say seven", "answer": "7"} for i in range(16)])
    over = {"trainer.eval_before": False, "trainer.eval_after": False, "trainer.save_final": False,
            "trainer.steps": 3, "rollout.n": 4, "rollout.max_new_tokens": 6, "reward.isolation": "none",
            "reward.functions": "[spear_test_parity]", "algorithm.spear.enabled": True,
            "algorithm.spear.replay_rows": 2, "algorithm.spear.warmup_steps": 2, "algorithm.spear.cov_clip_ratio": 0.1,
            "trainer.save_every": 3}
    res = train(load_config(None, tiny_overrides(tiny_model_dir, data, tmp_path, **over)))
    hist = res.history
    for key in ("spear/replayed_rows", "spear/buffer_rows", "spear/admitted_rows", "spear/baseline",
                "spear/replay_coef", "spear/cov_clipped_frac", "spear/dropped_rows", "spear/expired_rows"):
        assert all(key in m for m in hist), key
    assert sum(m["spear/admitted_rows"] for m in hist) > 0
    assert any(m["spear/replayed_rows"] == 2 for m in hist[1:])  # wins of an earlier step trained
    assert all(math.isfinite(m["loss"]) for m in hist)
    st = torch.load(Path(res.run_dir) / "checkpoints" / "step-000003" / "trainer_state.pt", weights_only=False)
    saved = st["stateful"]["spear"]
    assert sum(int(c["rewards"].shape[0]) for c in saved["ranks"][0]) == hist[-1]["spear/buffer_rows"]
    assert len(saved["baseline"]) == 3  # one entry of group stats per step


# --- DDP: the baseline is global (every rank's groups), the buffer per rank ---------------------------------------

def _ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    from anabranch.trainer.distributed import Distributed

    join_gloo(rank, world, port)
    sp = Spear(_cfg(replay_rows=4), Distributed(rank=rank, world_size=world))
    # Rank 0's groups [0.6, 0, 0], [1, 1, 0]; rank 1's [1, 1, 1], [1, 1, 0.4]: global means 0.2, 2/3, 1, 0.8.
    rewards = [[0.6, 0.0, 0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0, 0.4]][rank]
    _, m = _step(sp, 1, rewards)
    torch.save({"metrics": m, "state": sp.state_dict(), "k": sp.k, "cap": sp.buffer.capacity}, f"{out}/{rank}.pt")


def test_ddp_baseline_is_global_and_buffers_are_per_rank(tmp_path):
    spawn_two(_ddp_worker, str(tmp_path))  # leaves each rank's process group on exit
    r0, r1 = (torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in (0, 1))
    b = (2 / 3 + 0.8) / 2  # P50 of the 4 global group means (rank 0 alone: 0.4333, rank 1 alone: 0.9)
    assert r0["metrics"]["spear/baseline"] == pytest.approx(b)
    assert r1["metrics"]["spear/baseline"] == pytest.approx(b)
    # Rank 0's row 0 (A = 0.4 > 0, R = 0.6) is a win against its own groups' 0.4333, not against the global b:
    # only rows 3, 4 enter there. Rank 1: its [1, 1, 0.4] group's two 1s (A = 0.2).
    assert r0["metrics"]["spear/admitted_rows"] == 2 and r1["metrics"]["spear/admitted_rows"] == 2
    assert r0["state"]["baseline"] == r1["state"]["baseline"] and len(r0["state"]["ranks"]) == 2
    assert r0["k"] == 2 and r0["cap"] == 1024  # K and the buffer size are global numbers split over the ranks
