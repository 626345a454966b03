"""SAFE's double soft-min critic (algorithms/double_critic.py, ``algorithm.vf_double_critic``): the soft-min on
hand numbers, GAE on V_soft against a hand computation, both heads stepping and learning on the returns, the
checkpoint round trip, the refusals, and a short end-to-end run."""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from anabranch import load_config, train
from anabranch.algorithms.aggregation import masked_mean
from anabranch.algorithms.double_critic import double_value_loss, head_values, make_second_value_head
from anabranch.algorithms.ppo_value import (VALUE_HEAD, VALUE_HEAD2, ValueHead, gae, make_value_head, response_values,
                                            rollout_values, split_rollout_values, value_loss)
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.algorithms.safe import soft_min
from anabranch.config import AlgorithmConfig, ConfigError
from anabranch.trainer.checkpoint import list_checkpoints, load_state

from test_train_e2e import digit_task, tiny_overrides

S = -0.3 * (math.log(1 + math.exp(-1 / 0.3)) - math.log(2))  # soft-min of (0, 1) at α = 0.3 (0.19743)


def t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def test_soft_min_on_hand_numbers():
    # −α·log(½e^{−V1/α} + ½e^{−V2/α}) at (0, 1): −0.3·log(½(1 + e^{−10/3})).
    assert soft_min(t(0.0), t(1.0), 0.3).item() == pytest.approx(0.197429, abs=1e-6)
    assert soft_min(t(1.0), t(0.0), 0.3).item() == pytest.approx(S, rel=1e-12)  # symmetric
    # Equal heads give the head's value, exactly.
    assert soft_min(t(2.0, -1.5), t(2.0, -1.5), 0.3).tolist() == pytest.approx([2.0, -1.5], abs=1e-12)
    # α → 0 approaches min(V1, V2) (within α·log 2), a large α the mean.
    assert soft_min(t(0.5), t(-0.25), 1e-3).item() == pytest.approx(-0.25 + 1e-3 * math.log(2), abs=1e-9)
    assert soft_min(t(0.5), t(-0.25), 1e4).item() == pytest.approx(0.125, abs=1e-4)
    # Between the min and the mean.
    v = soft_min(t(0.0), t(1.0), 0.3).item()
    assert 0.0 < v < 0.5


def linear_head(w: float, b: float) -> ValueHead:
    head = ValueHead(1)
    with torch.no_grad():
        head.proj.weight.fill_(w)
        head.proj.bias.fill_(b)
    return head


def test_gae_reads_the_soft_min_on_a_three_token_example():
    # hidden (1 prompt token + 3 response tokens) [0, .5, 1, 9]; V1 = h, V2 = 1 − h at the states tokens were sampled
    # in (positions 0..2): V1 = (0, .5, 1), V2 = (1, .5, 0), so V_soft = (S, .5, S).
    second = linear_head(-1.0, 1.0)
    second.soft_min_alpha = 0.3
    modules = {VALUE_HEAD: linear_head(1.0, 0.0), VALUE_HEAD2: second}
    hidden = torch.tensor([[[0.0], [0.5], [1.0], [9.0]]])
    with torch.no_grad():
        rv = rollout_values(modules, hidden, 3)
    assert rv.shape == (1, 3, 3)
    pre = split_rollout_values(rv)
    assert pre["values"][0].tolist() == pytest.approx([S, 0.5, S], abs=1e-6)
    assert pre["value_heads"][0].flatten().tolist() == pytest.approx([0, 1, 0.5, 0.5, 1, 0], abs=1e-6)
    assert torch.equal(response_values(modules, hidden, 3), pre["values"])
    # Reward 1 on the last token, γ = 1, λ = 0.5, by hand:
    # δ = (.5 − S, S − .5, 1 − S); A2 = 1 − S, A1 = δ1 + .5·A2 = .5·S, A0 = δ0 + .5·A1 = .5 − .75·S; R = A + V_soft.
    adv, ret = gae(torch.tensor([[0.0, 0.0, 1.0]]), pre["values"], torch.ones(1, 3), gamma=1.0, lam=0.5)
    assert adv[0].tolist() == pytest.approx([0.5 - 0.75 * S, 0.5 * S, 1 - S], abs=1e-6)
    assert ret[0].tolist() == pytest.approx([0.5 + 0.25 * S, 0.5 + 0.5 * S, 1.0], abs=1e-6)


def heads_and_batch(vf_clip=0.2):
    cfg = AlgorithmConfig(name="ppo", advantage="gae", vf_double_critic=True, vf_clip=vf_clip)
    mc = SimpleNamespace(hidden_size=8)
    modules = {VALUE_HEAD: make_value_head(mc, cfg), VALUE_HEAD2: make_second_value_head(mc, cfg)}
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 5, 8, generator=gen)  # 6 rows, 1 prompt + 4 response columns
    # Returns a linear head can fit (so that learning shows as a loss that falls far).
    returns = hidden[:, :4] @ (0.3 * torch.randn(8, generator=gen)) + 0.5
    mask = torch.ones(6, 4)
    mask[0, 3] = 0.0
    with torch.no_grad():
        old = rollout_values(modules, hidden, 4)
    pre = split_rollout_values(old)
    ctx = SimpleNamespace(cfg=cfg, hidden=hidden, modules=modules,
                          extras={"values": pre["values"], "value_heads": pre["value_heads"], "returns": returns},
                          aggregate=lambda x, m: masked_mean(x, m))
    return cfg, modules, ctx, mask


def test_second_head_starts_elsewhere_and_is_the_same_every_build():
    cfg, modules, _, _ = heads_and_batch()
    assert torch.count_nonzero(modules[VALUE_HEAD].proj.weight) == 0  # V1 as the single critic: zero
    w2 = modules[VALUE_HEAD2].proj.weight
    assert torch.count_nonzero(w2) == w2.numel()
    again = make_second_value_head(SimpleNamespace(hidden_size=8), cfg)
    assert torch.equal(again.proj.weight, w2)  # a fixed seed: every rank builds the same V2
    state = torch.get_rng_state()
    make_second_value_head(SimpleNamespace(hidden_size=8), cfg)
    assert torch.equal(torch.get_rng_state(), state)  # the run's RNG is left as it was


def test_second_head_starts_small_whatever_the_width():
    # w ~ N(0, (0.02/√H)²), b = 0: on states of rms r its value has std 0.02·r at every width H (PyTorch's default
    # init, std 1/√(3H), would give 0.58·r: a pessimistic V_soft ≈ min(0, V2) early, set by the model's hidden norm)
    cfg = AlgorithmConfig(name="ppo", advantage="gae", vf_double_critic=True)
    gen = torch.Generator().manual_seed(3)
    for size in (64, 1024):
        head = make_second_value_head(SimpleNamespace(hidden_size=size), cfg)
        assert head.proj.bias.item() == 0.0
        assert head.proj.weight.norm().item() == pytest.approx(0.02, rel=0.25)  # ‖w‖ ≈ √H·0.02/√H
        h = 2.0 * torch.randn(4000, size, generator=gen)  # rms 2, as SmolLM2-135M's final-norm states
        with torch.no_grad():
            v2 = head(h)
        assert v2.mean().abs().item() < 0.01 and 0.02 < v2.std().item() < 0.06  # std 2‖w‖ ≈ 0.04


def test_each_head_gets_the_single_critics_gradient_toward_the_returns():
    # The loss is ℓ(V1, V1_old) + ℓ(V2, V2_old): each head's gradient is the single critic's loss on that head alone,
    # clipped against its own old value (not V_soft's).
    _, modules, ctx, mask = heads_and_batch()
    with torch.no_grad():  # move the heads away from their rollout values so that the clip acts
        modules[VALUE_HEAD].proj.bias.fill_(0.5)
        modules[VALUE_HEAD2].proj.bias.add_(-0.4)
    # Rollout values where V2 was 3 lower: the old V_soft is then far from the old V1 (a clip against it would differ).
    heads = ctx.extras["value_heads"] - torch.tensor([0.0, 3.0])
    ctx.extras.update(value_heads=heads, values=soft_min(heads[..., 0], heads[..., 1], 0.3))
    loss, metrics = double_value_loss(ctx, mask)
    loss.backward()
    assert 0 < metrics["critic/vf_clip_frac"] < 1
    for name, k in ((VALUE_HEAD, 0), (VALUE_HEAD2, 1)):
        single = {VALUE_HEAD: modules[name]}
        grads = [p.grad.clone() for p in modules[name].parameters()]
        for p in modules[name].parameters():
            p.grad = None
        one = SimpleNamespace(cfg=ctx.cfg, hidden=ctx.hidden, modules=single, aggregate=ctx.aggregate,
                              extras={"values": ctx.extras["value_heads"][..., k], "returns": ctx.extras["returns"]})
        value_loss(one, mask)[0].backward()
        for g, p in zip(grads, modules[name].parameters()):
            assert torch.allclose(g, p.grad, atol=1e-7), name


def test_both_heads_step_and_learn_on_a_fixed_batch():
    _, modules, ctx, mask = heads_and_batch(vf_clip=0.0)
    params = [p for m in modules.values() for p in m.parameters()]
    start = [p.detach().clone() for p in params]
    opt = torch.optim.Adam(params, lr=0.1)
    losses, gaps = [], []
    for _ in range(100):
        opt.zero_grad()
        loss, metrics = double_value_loss(ctx, mask)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        gaps.append(metrics["value/head_gap"])
    assert all(not torch.equal(a, p.detach()) for a, p in zip(start, params))  # both heads moved
    assert losses[-1] < 0.1 * losses[0], losses
    with torch.no_grad():
        vals = head_values(modules, ctx.hidden, 4)
    r = ctx.extras["returns"]
    for k in (1, 2):  # each head fits the returns on its own
        err0 = masked_mean((ctx.extras["value_heads"][..., k - 1] - r) ** 2, mask)
        assert masked_mean((vals[..., k] - r) ** 2, mask) < 0.1 * err0
    assert gaps[-1] < gaps[0]  # fitted to the same target, the heads come together
    # V_soft stays between the min and the mean of the heads.
    lo, mean = torch.minimum(vals[..., 1], vals[..., 2]), vals[..., 1:].mean(-1)
    assert bool((vals[..., 0] >= lo - 1e-6).all() and (vals[..., 0] <= mean + 1e-6).all())


def test_off_the_value_path_is_the_single_head():
    algo = resolve_algorithm(AlgorithmConfig(name="ppo", advantage="gae", loss="ppo_clip"))
    assert set(algo.module_factories) == {VALUE_HEAD}
    v = torch.randn(2, 3)
    assert split_rollout_values(v)["values"] is v and set(split_rollout_values(v)) == {"values"}
    on = resolve_algorithm(AlgorithmConfig(name="ppo", advantage="gae", loss="ppo_clip", vf_double_critic=True))
    assert set(on.module_factories) == {VALUE_HEAD, VALUE_HEAD2}


def test_refusals(tmp_path):
    with pytest.raises(ConfigError, match=r"vf_double_critic=true .*advantage='grpo' uses no value head: set "
                                          r"algorithm.advantage=gae"):
        load_config(None, ["algorithm.vf_double_critic=true"])
    with pytest.raises(ConfigError, match=r"vf_soft_min_alpha.*algorithm.vf_double_critic=true"):
        load_config(None, ["algorithm.name=ppo", "algorithm.vf_soft_min_alpha=0.5"])
    for bad in ("0", "-1", "nan"):
        with pytest.raises(ConfigError, match="vf_soft_min_alpha must be a finite number > 0"):
            load_config(None, ["algorithm.name=ppo", "algorithm.vf_double_critic=true",
                               f"algorithm.vf_soft_min_alpha={bad}"])
    load_config(None, ["algorithm.name=ppo", "algorithm.vf_double_critic=true", "algorithm.vf_soft_min_alpha=0.1"])
    # vf_coef = 0: the heads' only gradient is the critic's loss, so they would stay at their init
    with pytest.raises(ConfigError, match=r"algorithm.vf_coef=0.0 gives them no gradient.*set algorithm.vf_coef > 0"):
        load_config(None, ["algorithm.name=ppo", "algorithm.vf_double_critic=true", "algorithm.vf_coef=0"])
    load_config(None, ["algorithm.name=ppo", "algorithm.vf_coef=0"])  # the single critic: not this check's to refuse


def run_cfg(model_dir, data, out, **extra):
    base = {"trainer.eval_before": False, "trainer.eval_after": False, "task.eval_size": 4, "rollout.n": 4,
            "rollout.max_new_tokens": 4, "trainer.lr": 1e-3, "rollout.prompts_per_step": 2, "trainer.tensorboard": False,
            "algorithm.name": "ppo", "algorithm.vf_double_critic": "true"}
    base.update(extra)
    return load_config(None, tiny_overrides(model_dir, data, out, **base))


def test_train_end_to_end_and_exact_resume(tiny_model_dir, write_jsonl, tmp_path):
    data = digit_task(write_jsonl, n=16)
    full = train(run_cfg(tiny_model_dir, data, tmp_path, **{"trainer.steps": 2, "trainer.save_every": 1,
                                                            "trainer.run_name": "full"}))
    for m in full.history:
        for key in ("value/v1_mean", "value/v2_mean", "value/soft_min_mean", "value/head_gap", "critic/vf_loss"):
            assert math.isfinite(m[key]), (key, m)
        assert m["value/head_gap"] > 0 and m["skipped_updates"] == 0
    half = list_checkpoints(Path(full.run_dir) / "checkpoints")[0]
    state = load_state(half)
    assert set(state["modules"]) == {VALUE_HEAD, VALUE_HEAD2}
    assert state["modules"][VALUE_HEAD]["proj.weight"].abs().sum() > 0  # V1 learned from its zero start
    resumed = train(run_cfg(tiny_model_dir, data, tmp_path, **{"trainer.steps": 2, "trainer.resume": str(half),
                                                               "trainer.run_name": "resumed"}))
    strip = [{k: v for k, v in m.items() if not k.startswith("time/")} for m in full.history]
    assert [{k: v for k, v in m.items() if not k.startswith("time/")} for m in resumed.history] == strip


def test_both_heads_are_in_the_optimizer_as_extra_parameters():
    # Distributed.extra_params (every optimizer parameter outside the wrapped policy) is what DDP's step broadcasts at
    # the start and all-reduces before clipping: V2 is there exactly as V1, at the critic's learning rate.
    from anabranch.trainer.components import build_optimizer

    cfg = load_config(None, ["algorithm.name=ppo", "algorithm.vf_double_critic=true"])
    policy = torch.nn.Linear(8, 8)
    mc = SimpleNamespace(hidden_size=8)
    modules = {VALUE_HEAD: make_value_head(mc, cfg.algorithm), VALUE_HEAD2: make_second_value_head(mc, cfg.algorithm)}
    opt = build_optimizer(cfg, policy, modules)
    policy_ids = {id(p) for p in policy.parameters()}
    extra = {id(p): g["lr"] for g in opt.param_groups for p in g["params"] if id(p) not in policy_ids}
    for head in modules.values():
        assert {id(p) for p in head.parameters()} <= set(extra)
        assert all(extra[id(p)] == pytest.approx(cfg.trainer.lr * cfg.algorithm.vf_lr_multiplier)
                   for p in head.parameters())
