"""SPEAR's replay as its own update (``algorithm.spear.replay_step=separate``, trainer/spear_update.py) and its
tool-call reward curriculum (``algorithm.spear.tool_reward``): hand numbers, the joint mode untouched, refusals,
the DDP decision, a tiny run of each mode."""

from __future__ import annotations

import copy
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from anabranch import load_config, train
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.algorithms.spear import tool_bonus, tool_calls, tool_reward_weight
from anabranch.config import Config, ConfigError
from anabranch.rewards.registry import REWARDS
from anabranch.trainer.replay import Chunk, mark_rows
from anabranch.trainer.spear_replay import Spear, check_config
from anabranch.trainer.spear_update import empty_rows, separate_update
from anabranch.trainer.step import policy_update

from test_rorecomp import _tiny_rollout
from test_spear import _Batch, _cfg, _grpo, _step
from test_train_e2e import tiny_overrides
from two_process import join_gloo, spawn_two

if "spear_modes_parity" not in REWARDS:
    @REWARDS.register("spear_modes_parity", correctness=True)
    def spear_modes_parity(prompts, completions, answer, **_):
        return [float(sum(map(ord, c)) % 2 == 0) for c in completions]

_ONE = SimpleNamespace(policy=lambda m: m, active=None)  # the loop's Distributed for one process


def _model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).float().eval()


def _parts(model, cfg, lr=0.0):
    return SimpleNamespace(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
                           algo=resolve_algorithm(cfg.algorithm), ref_model=None, modules=None)


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()


def _two_steps(sp, rewards=(1.0, 0.0, 0.0, 1.0, 1.0, 0.0)):
    """Step 1 admits its wins; step 2 (its own rows, six 0-rewards: nothing admitted) pops K = 2 of them.
    Rows of _tiny_rollout have 6, 2, 4, 1, 6, 3 response tokens."""
    rw = torch.tensor(rewards)

    def step(s, seed, r_):
        r = _tiny_rollout(6, seed=seed)
        r.group_index = torch.arange(6) // 3
        b = _Batch(r)
        out = sp.step(b, r, _grpo(r_)[:, None] * r.response_mask, {}, r_, s)
        return b, out

    step(1, 1, rw)
    return step(2, 2, torch.zeros(6))


def test_separate_step_loss_is_normalized_over_the_replayed_tokens_alone(tiny_model_dir):
    # Decay recalibration: step 1's A = 2/3, 1/3, 1/3 on rows 0, 3, 4 -> Â = 0.6, 0.3, 0.3; K = 2 replays rows 0
    # (6 tokens) and 3 (1 token). Ratio 1 (the policy has not moved since their behaviour pass), PPO-clip:
    # token-mean loss = −(0.6·6 + 0.3·1) / 7 = −3.9/7. Joint mode would divide the same sum by 7 + this step's
    # 22 tokens (0.134…): the dilution the separate step removes.
    model = _model(tiny_model_dir)
    cfg = _cfg(replay_rows=2, recalibration="decay", replay_step="separate", coef=0.5)
    sp = Spear(cfg, model=model)
    b, out = _two_steps(sp)
    assert out.rollout.completions == [f"2:{i}" for i in range(6)]  # the on-policy update: this step's rows only
    assert "behaviour_rows" not in out.precomputed
    assert b.metrics["spear/replayed_rows"] == 2 and b.metrics["spear/replay_advantage"] == pytest.approx(0.45)
    m = sp.replay_update(_parts(model, cfg), _ONE, cfg)
    assert m["spear/replay/loss"] == pytest.approx(-3.9 / 7, abs=1e-5)  # logged unscaled by c = 0.5
    assert m["spear/cov_clipped_frac"] == 0.0 and m["spear/replay/skipped"] == 0.0
    assert sp.pending is None and sp.replay_update(_parts(model, cfg), _ONE, cfg) == {}  # once per step


def test_the_coefficient_scales_the_replay_gradient_and_it_comes_from_the_replayed_rows_only(tiny_model_dir):
    model = _model(tiny_model_dir)
    grads = {}
    for coef in (1.0, 0.5):
        cfg = _cfg(replay_rows=2, recalibration="decay", replay_step="separate", coef=coef)
        cfg.trainer.grad_clip = 0.0  # a clipped norm would hide the factor
        sp = Spear(cfg, model=model)
        _two_steps(sp)
        chunk, adv_row, _ = sp.pending
        sp.replay_update(_parts(model, cfg), _ONE, cfg)
        grads[coef] = _grads(model)
    assert torch.allclose(grads[0.5], 0.5 * grads[1.0], atol=1e-7)  # c_k multiplies the whole replay loss
    assert grads[1.0].abs().max() > 1e-4
    # The same gradient from a plain update of the replayed rows alone (Â on their tokens, their behaviour marks).
    adv = adv_row[:, None] * chunk.rollout.trained_mask.float()
    policy_update(model, torch.optim.SGD(model.parameters(), lr=0.0), chunk.rollout, adv, chunk.rewards,
                  resolve_algorithm(cfg.algorithm), micro_batch_size=8, grad_clip=cfg.trainer.grad_clip,
                  temperature=1.0, max_response_len=cfg.rollout.max_new_tokens, precomputed=dict(chunk.precomputed))
    assert torch.allclose(_grads(model), grads[1.0], atol=1e-6)


def test_separate_step_changes_the_weights_a_second_time_from_the_replayed_rows(tiny_model_dir):
    model = _model(tiny_model_dir)
    cfg = _cfg(replay_rows=2, recalibration="decay", replay_step="separate")
    cfg.trainer.grad_clip = 0.0
    sp = Spear(cfg, model=model)
    _, out = _two_steps(sp, rewards=(1.0, 0.0, 0.0, 0.0, 1.0, 0.0))
    parts = _parts(model, cfg, lr=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    adv_on = _grpo(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0]))[:, None] * out.rollout.response_mask  # any Â ≠ 0
    policy_update(model, parts.optimizer, out.rollout, adv_on, out.rewards, parts.algo, micro_batch_size=8,
                  grad_clip=0.0, temperature=1.0, max_response_len=6, precomputed=out.precomputed)
    mid = [p.detach().clone() for p in model.parameters()]
    assert any((a - b).abs().max() > 0 for a, b in zip(mid, before))  # the on-policy step
    chunk, adv_row, coef = sp.pending
    twin = copy.deepcopy(model)  # θ' stepped by hand on the replayed rows alone
    policy_update(twin, torch.optim.SGD(twin.parameters(), lr=0.5), chunk.rollout,
                  adv_row[:, None] * chunk.rollout.trained_mask.float(), chunk.rewards, parts.algo,
                  micro_batch_size=8, grad_clip=0.0, temperature=1.0, max_response_len=6,
                  precomputed=dict(chunk.precomputed), rl_loss_scale=coef)
    sp.replay_update(parts, _ONE, cfg)
    after = list(model.parameters())
    assert any((a - b).abs().max() > 1e-6 for a, b in zip(after, mid))  # a second step in the same training step
    for a, t in zip(after, twin.parameters()):
        assert torch.allclose(a, t, atol=1e-6)


class _CountingSGD(torch.optim.SGD):
    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.steps = 0

    def step(self, closure=None):
        self.steps += 1
        return super().step(closure)


def test_separate_step_is_one_optimizer_step_whatever_ppo_epochs(tiny_model_dir):
    model = _model(tiny_model_dir)
    cfg = _cfg(replay_rows=2, recalibration="decay", replay_step="separate")
    cfg.algorithm.ppo_epochs = 2
    sp = Spear(cfg, model=model)
    _two_steps(sp)
    parts = _parts(model, cfg)
    parts.optimizer = _CountingSGD(model.parameters(), lr=0.1)
    assert parts.algo.cfg.ppo_epochs == 2  # the on-policy update's two epochs
    m = sp.replay_update(parts, _ONE, cfg)
    assert parts.optimizer.steps == 1 and m["spear/replay/skipped"] == 0.0


def test_no_replay_step_at_a_zero_coefficient_even_under_adamw(tiny_model_dir):
    # c_k > 0 throughout a run; the guard only protects direct calls: at c_k = 0 (set by hand here) the replay gradient
    # is 0, yet AdamW would move the weights along the on-policy step's first moment and decay them a second time.
    # No step is taken: weights and moments unchanged.
    model = _model(tiny_model_dir)
    cfg = _cfg(replay_rows=2, recalibration="decay", replay_step="separate")
    sp = Spear(cfg, model=model)
    _, out = _two_steps(sp, rewards=(1.0, 0.0, 0.0, 0.0, 1.0, 0.0))
    parts = _parts(model, cfg)
    parts.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    adv_on = _grpo(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0]))[:, None] * out.rollout.response_mask
    policy_update(model, parts.optimizer, out.rollout, adv_on, out.rewards, parts.algo, micro_batch_size=8,
                  grad_clip=0.0, temperature=1.0, max_response_len=6, precomputed=out.precomputed)  # Adam's moments
    chunk, adv_row, _ = sp.pending
    sp.pending = (chunk, adv_row, 0.0)
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in parts.optimizer.state[next(model.parameters())].items()}
    m = sp.replay_update(parts, _ONE, cfg)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))  # (a step here moves them: AdamW)
    assert all(torch.equal(v, parts.optimizer.state[next(model.parameters())][k]) for k, v in state.items())
    assert m == {} and sp.pending is None


def test_separate_clip_cov_reads_the_unscaled_advantage_and_the_policy_after_the_update(monkeypatch):
    # Replayed rows 1:0 (Â = 0.6) and 1:3 (Â = 0.3), width 4, behaviour log π_1 = −1 (test_spear._step). π_θ now
    # (stubbed pass): [−1, −3, −3, −3] and [−3] × 4, mean −2.875: Cov(0, 0) = 1.875·0.15 = 0.28125, every other
    # |Cov| = 0.01875. Band [0.2, 40], ρ = 1/8: token (0, 0). Joint mode's c·Â (c = 0.5) would halve Cov to
    # 0.140625, out of the band. policy_update gets Â unscaled, c as the loss scale, no KL, the run's dist.
    import anabranch.trainer.spear_update as spear_update

    lp = torch.tensor([[-1.0, -3.0, -3.0, -3.0], [-3.0] * 4])
    monkeypatch.setattr(spear_update, "rollout_forward", lambda model, rows, *a, **k: (lp, None))
    seen = {}
    monkeypatch.setattr(spear_update, "policy_update",
                        lambda model, opt, rollout, adv, rewards, algo, **kw: seen.update(adv=adv, algo=algo, **kw)
                        or {"loss": -1.0, "grad_norm": 2.0, "time/optimizer_s": 0.1, "skipped_updates": 0.0})
    cfg = _cfg(replay_rows=2, recalibration="decay", cov_clip_ratio=0.125, cov_clip_low=0.2, coef=0.5,
               replay_step="separate")
    cfg.algorithm.kl_coef = 0.1
    sp = Spear(cfg, model=object())
    _step(sp, 1, [1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    _step(sp, 2, [1.0] * 6)
    dist = SimpleNamespace(policy=lambda m: m, active="the-dist")
    c = SimpleNamespace(model=object(), optimizer=None, algo=resolve_algorithm(cfg.algorithm), ref_model=None,
                        modules=None)
    m = sp.replay_update(c, dist, cfg)
    assert seen["adv"].flatten().tolist() == pytest.approx([0.0, 0.6, 0.6, 0.6] + [0.3] * 4)
    assert seen["rl_loss_scale"] == 0.5 and seen["kl_coef"] == 0.0 and seen["dist"] == "the-dist"
    assert seen["precomputed"]["behaviour_rows"].all() and seen["algo"].epo is None
    assert m == {"spear/replay/loss": -1.0, "spear/replay/grad_norm": 2.0, "spear/replay/skipped": 0.0,
                 "spear/cov_clipped_frac": pytest.approx(1 / 8)}


def test_joint_mode_is_unchanged_one_update_over_both_and_nothing_pending():
    sp = Spear(_cfg(replay_rows=2, recalibration="decay", coef=0.5))  # replay_step=joint, the default
    _step(sp, 1, [1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    out, m = _step(sp, 2, [1.0] * 6)
    assert out.rollout.completions[6:] == ["1:0", "1:3"]  # merged into the step's one update
    assert out.advantages[6:].flatten().tolist() == pytest.approx([0.3] * 4 + [0.15] * 4)  # c·Â
    assert sp.pending is None and sp.replay_update(None, _ONE, None) == {}
    assert not any(k.startswith("spear/replay/") for k in m)


def test_tool_calls_weight_and_bonus_on_hand_numbers():
    # Responses (1 = response token; trained 0 = tool output): no call; one block; three blocks (one at the start).
    resp = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    trained = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 0, 0, 1, 1, 1, 1], [0, 1, 0, 0, 1, 0, 1]])
    assert tool_calls(resp, trained).tolist() == [0.0, 1.0, 3.0]
    assert tool_reward_weight(0, 200) == 1.0
    assert tool_reward_weight(50, 200) == pytest.approx((1 + math.sqrt(0.5)) / 2)
    assert tool_reward_weight(100, 200) == pytest.approx(0.5)
    assert tool_reward_weight(200, 200) == pytest.approx(0.0) and tool_reward_weight(201, 200) == 0.0
    assert tool_reward_weight(10**6, 0) == 1.0  # no decay
    # coef 0.1, cap 0.25: min(0.1·n, 0.25) = 0, 0.1, 0.25, 0.25 for n = 0, 1, 3, 5; times w = 0.5.
    assert tool_bonus(torch.tensor([0.0, 1.0, 3.0, 5.0]), 0.1, 0.25, 0.5).tolist() == pytest.approx(
        [0.0, 0.05, 0.125, 0.125])


def test_tool_reward_adds_the_decayed_bonus_to_the_batch_before_the_advantages():
    from anabranch.rollout.base import Rollout

    cfg = _cfg()
    cfg.rollout.tools = ["python"]
    cfg.algorithm.spear.tool_reward.coef, cfg.algorithm.spear.tool_reward.decay_steps = 0.1, 4
    resp = torch.ones(3, 6, dtype=torch.long)
    ro = Rollout(prompt_ids=torch.ones(3, 2, dtype=torch.long), prompt_mask=torch.ones(3, 2, dtype=torch.long),
                 response_ids=torch.ones(3, 6, dtype=torch.long), response_mask=resp,
                 group_index=torch.zeros(3, dtype=torch.long), prompts=["p"], completions=["a", "b", "c"],
                 truncated=torch.zeros(3, dtype=torch.bool),
                 loss_mask=torch.tensor([[1] * 6, [1, 0, 1, 0, 1, 1], [1, 0, 0, 0, 1, 1]]))
    batch = SimpleNamespace(rollout=ro, total=[1.0, 0.0, 1.0], per_source={"acc": [1.0, 0.0, 1.0]}, metrics={})
    Spear(cfg).tool_reward(batch, 1)  # w_1 = (1 + cos(π/4)) / 2 = 0.8536; calls 0, 2, 1
    w = (1 + math.sqrt(0.5)) / 2
    assert batch.total == pytest.approx([1.0, 0.2 * w, 1.0 + 0.1 * w])
    assert batch.per_source["spear_tool_call"] == pytest.approx([0.0, 0.2 * w, 0.1 * w])
    assert batch.metrics["spear/tool_reward_weight"] == pytest.approx(w)
    assert batch.metrics["spear/tool_calls_mean"] == 1.0
    cfg.algorithm.spear.tool_reward = type(cfg.algorithm.spear.tool_reward)()  # coef 0: nothing
    b2 = SimpleNamespace(rollout=ro, total=[1.0, 0.0, 1.0], per_source={}, metrics={})
    Spear(cfg).tool_reward(b2, 1)
    assert b2.total == [1.0, 0.0, 1.0] and b2.metrics == {}


@pytest.mark.parametrize("key,value,match", [
    ("replay_step", "both", "replay_step must be one of"),
    ("tool_reward.coef", 0.1, "without rollout.tools"),
    ("tool_reward.coef", -0.1, "tool_reward.coef must be >= 0"),
    ("tool_reward.cap", 0.0, "tool_reward.cap must be > 0"),
    ("tool_reward.decay_steps", 50, "no effect with tool_reward.coef=0"),
])
def test_refusals(key, value, match):
    cfg = _cfg()
    obj = cfg.algorithm.spear
    *path, name = key.split(".")
    for part in path:
        obj = getattr(obj, part)
    setattr(obj, name, value)
    with pytest.raises(ConfigError, match=match):
        check_config(cfg)


def test_tool_reward_accepted_with_tools_and_refused_while_spear_is_off():
    from anabranch.config_checks import check_whole_config

    cfg = _cfg()
    cfg.rollout.tools = ["python"]
    cfg.algorithm.spear.tool_reward.coef = 0.1
    cfg.algorithm.spear.replay_step = "separate"
    check_config(cfg)
    off = Config()
    off = dataclasses.replace(off, algorithm=dataclasses.replace(off.algorithm, spear=dataclasses.replace(
        off.algorithm.spear, tool_reward=dataclasses.replace(off.algorithm.spear.tool_reward, coef=0.1))))
    with pytest.raises(ConfigError, match=r"'algorithm\.spear\.tool_reward' has no effect unless algorithm\.spear"):
        check_whole_config(off)
    with pytest.raises(ConfigError, match="without rollout.tools"):  # at config load
        load_config(None, ["algorithm.spear.enabled=true", "algorithm.spear.tool_reward.coef=0.1"])


@pytest.mark.parametrize("mode", ["joint", "separate"])
def test_tiny_run_of_each_mode(tiny_model_dir, write_jsonl, tmp_path, mode):
    data = write_jsonl([{"prompt": f"Q{i}: say seven", "answer": "7"} for i in range(16)])
    over = {"trainer.eval_before": False, "trainer.eval_after": False, "trainer.save_final": False,
            "trainer.steps": 2, "rollout.n": 4, "rollout.max_new_tokens": 6, "reward.isolation": "none",
            "reward.functions": "[spear_modes_parity]", "algorithm.spear.enabled": True,
            "algorithm.spear.replay_rows": 2, "algorithm.spear.warmup_steps": 2,
            "algorithm.spear.cov_clip_ratio": 0.1, "algorithm.spear.replay_step": mode}
    if mode == "separate":  # with the tool-call curriculum on (the tiny model calls no tool: the hook and w_k run)
        over.update({"rollout.tools": "[python]", "algorithm.spear.tool_reward.coef": 0.1,
                     "algorithm.spear.tool_reward.decay_steps": 4})
    hist = train(load_config(None, tiny_overrides(tiny_model_dir, data, tmp_path, **over))).history
    replayed = [m for m in hist if m["spear/replayed_rows"] > 0]
    assert replayed and all(math.isfinite(m["loss"]) for m in hist)
    if mode == "separate":
        assert all(math.isfinite(m["spear/replay/loss"]) and m["spear/replay/grad_norm"] > 0 for m in replayed)
        assert not any("spear/replay/loss" in m for m in hist if m["spear/replayed_rows"] == 0)
        assert [m["spear/tool_reward_weight"] for m in hist] == pytest.approx([(1 + math.sqrt(0.5)) / 2, 0.5])
    else:
        assert not any(k.startswith("spear/replay/") for m in hist for k in m)


def test_a_nonfinite_replay_step_counts_in_the_nonfinite_guard(tiny_model_dir, write_jsonl, tmp_path, monkeypatch):
    # The replay step's loss scale made NaN: its gradient is NaN, its own guard skips it (spear/replay/skipped = 1),
    # and the step's skipped_updates and nonfinite/steps_total count it although the on-policy update was finite.
    import anabranch.trainer.spear_replay as spear_replay

    real = spear_replay.separate_update
    monkeypatch.setattr(spear_replay, "separate_update",
                        lambda sp, chunk, adv_row, coef, *a, **k: real(sp, chunk, adv_row, float("nan"), *a, **k))
    data = write_jsonl([{"prompt": f"Q{i}: say seven", "answer": "7"} for i in range(16)])
    over = {"trainer.eval_before": False, "trainer.eval_after": False, "trainer.save_final": False,
            "trainer.steps": 2, "rollout.n": 4, "rollout.max_new_tokens": 6, "reward.isolation": "none",
            "reward.functions": "[spear_modes_parity]", "algorithm.spear.enabled": True,
            "algorithm.spear.replay_rows": 2, "algorithm.spear.warmup_steps": 0,
            "algorithm.spear.replay_step": "separate"}
    hist = train(load_config(None, tiny_overrides(tiny_model_dir, data, tmp_path, **over))).history
    assert [m["spear/replayed_rows"] > 0 for m in hist] == [False, True]
    assert math.isfinite(hist[1]["grad_norm"]) and hist[1]["spear/replay/skipped"] == 1.0
    assert [m["skipped_updates"] for m in hist] == [0.0, 1.0]
    assert [m["nonfinite/steps_total"] for m in hist] == [0.0, 1.0]


# --- DDP: the separate step is taken by every rank or by none ----------------------------------------------------

# The parity case: 6 replayed rows of _tiny_rollout (6, 2, 4, 1, 6, 3 response tokens), their Â and behaviour
# log-probs; rank 0 replays rows 0-2, rank 1 rows 3-5 (or none: it trains empty_rows).
_ADV = torch.tensor([0.6, -0.2, 0.3, 0.5, 0.1, 0.4])
_SPEAR_OVER = ["algorithm.spear.enabled=true", "algorithm.spear.replay_step=separate", "algorithm.spear.replay_rows=2",
               "algorithm.spear.warmup_steps=0", "algorithm.spear.cov_clip_ratio=0", "algorithm.entropy_coef=0.01"]


def _replay_chunk(rows: list[int]) -> Chunk:
    r = _tiny_rollout(6, seed=4)
    r.group_index = torch.arange(6) // 3
    chunk = Chunk(1, r, torch.zeros(6, 6), {}, torch.ones(6)).take(rows)
    g = torch.Generator().manual_seed(7)
    mark_rows(chunk, (-0.5 - 3 * torch.rand(6, 6, generator=g))[rows])  # ratios ≠ 1, some clipped
    return chunk


def _replay_updates(model_dir: str, dist, cases: dict) -> dict:
    """Per case, separate_update (c = 0.5, AdamW) of its rows (none: empty_rows): its metrics and the gradient."""
    from test_distributed_round_methods import load, step_cfg

    cfg = step_cfg(model_dir, _SPEAR_OVER)
    c = load(model_dir, cfg, dist)
    c.algo, c.ref_model, c.modules = resolve_algorithm(cfg.algorithm), None, None
    out, start = {}, copy.deepcopy(c.model.state_dict())
    for case, rows in cases.items():
        c.model.load_state_dict(start)  # one model for every case: each case's gradient at the same weights
        chunk = _replay_chunk(rows) if rows else empty_rows(_replay_chunk([0, 1]))
        adv = _ADV[rows] if rows else torch.zeros(1)
        m = separate_update(Spear(cfg, dist, c.model), chunk, adv, 0.5, c, dist, cfg)
        out[case] = {"metrics": dist.mean_metrics(m),
                     "grads": {n: p.grad.clone() for n, p in c.model.named_parameters() if p.grad is not None}}
    return out


def _ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    from anabranch.trainer.distributed import Distributed

    join_gloo(rank, world, port)
    res = {}
    for mode in ("separate", "joint"):
        sp = Spear(_cfg(replay_rows=4, replay_step=mode), Distributed(rank=rank, world_size=world))  # K = 2 per rank
        # Step 1: rank 0's wins are rows 0 and 3 (R = 1 > b = P50(1/3, 1/3, 0, 0) = 1/6); rank 1 has none.
        _step(sp, 1, [[1.0, 0.0, 0.0, 1.0, 0.0, 0.0], [0.0] * 6][rank])
        _, m = _step(sp, 2, [0.0] * 6)  # rank 0 alone has K = 2 waiting
        pending = None if sp.pending is None else (len(sp.pending[0]), float(sp.pending[0].rollout.trained_mask.sum()))
        res[mode] = {"metrics": m, "pending": pending}
    torch.save(res, f"{out}/{rank}.pt")


def test_ddp_separate_replay_is_due_when_any_rank_is_ready(tmp_path):
    spawn_two(_ddp_worker, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in (0, 1))
    # Rank 0 has its K = 2 rows due, rank 1 none: both modes replay rank 0's two rows; in separate mode rank 1
    # joins the step with one row without trained tokens (empty_rows), in joint mode it has nothing pending.
    for mode, pending1 in (("separate", (1, 0.0)), ("joint", None)):
        m0, m1 = r0[mode]["metrics"], r1[mode]["metrics"]
        assert m0["spear/replayed_rows"] == 2.0 and m1["spear/replayed_rows"] == 0, mode
        assert m0["spear/buffer_rows"] == 0.0
        assert r1[mode]["pending"] == pending1, mode
    assert r0["separate"]["pending"] == (2, 8.0) and r0["joint"]["pending"] is None  # rows 0 and 3, 4 tokens each


def _ddp_update_worker(rank: int, world: int, port: int, out: str, model_dir: str) -> None:
    from anabranch.trainer.distributed import Distributed
    from test_distributed_round_methods import step_cfg

    join_gloo(rank, world, port)
    dist = Distributed.start(step_cfg(model_dir, _SPEAR_OVER))
    res = _replay_updates(model_dir, dist, {"split": [[0, 1, 2], [3, 4, 5]][rank],
                                            "one_rank_empty": [[0, 1, 2], []][rank]})
    torch.save(res, f"{out}/{rank}.pt")


def test_ddp_separate_replay_step_equals_the_one_process_step(tmp_path, tiny_model_dir):
    from anabranch.trainer.distributed import Distributed

    spawn_two(_ddp_update_worker, str(tmp_path), tiny_model_dir)
    r0, r1 = (torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in (0, 1))
    # One replay step over 2 ranks = the one-process step of the union (global normalizers, DDP's average);
    # a rank with no row (empty_rows) adds nothing: the one-process step of rank 0's rows alone.
    singles = _replay_updates(tiny_model_dir, Distributed(), {"split": list(range(6)), "one_rank_empty": [0, 1, 2]})
    for case, single in singles.items():
        for r in (r0, r1):
            assert r[case]["metrics"]["spear/replay/loss"] == pytest.approx(
                single["metrics"]["spear/replay/loss"], abs=1e-6), case
            assert r[case]["grads"].keys() == single["grads"].keys()
            for n, g in single["grads"].items():
                assert torch.allclose(r[case]["grads"][n], g, atol=1e-6), (case, n)
        assert max(g.abs().max() for g in single["grads"].values()) > 1e-4
