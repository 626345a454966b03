"""FlowRL's objective, its options and its log Z sources against hand-computed values."""

import math
from functools import partial

import pytest
import torch

from anabranch.algorithms.aggregation import BatchScale, aggregate
from anabranch.algorithms.flowrl import flowrl_loss, importance_weight
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.config import AlgorithmConfig, ConfigError, FlowRLConfig, load_config
from anabranch.models.log_z import LogZHead, ScalarLogZ
from anabranch.trainer.step import LossContext, micro_batches

# Two sequences of one group: lengths 2 and 1.
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
LOG_PROB = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
OLD = LOG_PROB - torch.tensor([[0.1, 0.2], [-0.3, 0.0]])  # sequence log-ratios 0.3 and -0.3
REF = torch.tensor([[-1.5, -1.0], [-1.0, 0.0]])
R_HAT = 1 / (math.sqrt(0.5) + 1e-6) * 0.5  # GRPO advantage of rewards (1, 0): ±0.7071


def run(flowrl: FlowRLConfig, log_z=0.5, log_prob=None, mode="token-mean"):
    cfg = resolve_algorithm(AlgorithmConfig(name="flowrl", flowrl=flowrl)).cfg
    head = ScalarLogZ()
    with torch.no_grad():
        head.log_z.fill_(log_z)
    rewards, groups = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    from anabranch.algorithms.grpo import grpo_advantage

    adv = grpo_advantage(rewards, groups, MASK, cfg)
    lp = (LOG_PROB if log_prob is None else log_prob).clone().requires_grad_()
    ctx = LossContext(cfg=cfg, aggregate=partial(aggregate, mode=mode, scale=BatchScale()), ref_log_prob=REF,
                      rewards=rewards, group_index=groups, prompt_mask=torch.ones(2, 3), modules={"log_z": head})
    loss, metrics = flowrl_loss(lp, OLD, adv, MASK, ctx)
    loss.backward()
    return loss, metrics, lp.grad, head.log_z.grad


def test_loss_hand_computed_with_length_norm_and_reference():
    beta = 2.0
    loss, m, grad, z_grad = run(FlowRLConfig(beta=beta, log_z="scalar", is_mode="unclipped"))
    # δ = log Z + log π/|y| − β r̂ − log π_ref/|y|
    d0 = 0.5 + (-3.0 / 2) - beta * R_HAT - (-2.5 / 2)
    d1 = 0.5 + (-0.5 / 1) + beta * R_HAT - (-1.0 / 1)
    w0, w1 = math.exp(0.3), math.exp(-0.3)
    assert loss.item() == pytest.approx((w0 * d0**2 + w1 * d1**2) / 2, rel=1e-5)
    # Sequence mean whatever loss_agg_mode says.
    loss_tm, *_ = run(FlowRLConfig(beta=beta, log_z="scalar", is_mode="unclipped"), mode="token-mean")
    assert loss_tm.item() == pytest.approx(loss.item())
    # d/dlogZ = mean(2wδ); d/dlogπ_t = w·2δ/|y| / B; padding gets nothing.
    assert z_grad.item() == pytest.approx((2 * w0 * d0 + 2 * w1 * d1) / 2, rel=1e-5)
    assert grad[0, 0].item() == pytest.approx(w0 * 2 * d0 / 2 / 2, rel=1e-5)
    assert grad[1, 0].item() == pytest.approx(w1 * 2 * d1 / 1 / 2, rel=1e-5)
    assert grad[1, 1].item() == 0.0
    assert m["flowrl/residual_mean"] == pytest.approx((d0 + d1) / 2, rel=1e-5)
    assert m["flowrl/log_z_mean"] == pytest.approx(0.5)
    assert m["flowrl/is_weight_mean"] == pytest.approx((w0 + w1) / 2, rel=1e-5)
    assert m["flowrl/is_clip_frac"] == 0.0


def test_trajectory_balance_without_length_norm():
    loss, *_ = run(FlowRLConfig(beta=1.0, log_z="scalar", is_mode="none", length_norm=False), log_z=0.0)
    d0 = (-3.0) - R_HAT - (-2.5)
    d1 = (-0.5) + R_HAT - (-1.0)
    assert loss.item() == pytest.approx((d0**2 + d1**2) / 2, rel=1e-5)


@pytest.mark.parametrize("reference,prior", [("old", OLD), ("none", torch.zeros(2, 2))])
def test_reference_term_options(reference, prior):
    loss, *_ = run(FlowRLConfig(beta=1.0, log_z="scalar", is_mode="none", reference=reference), log_z=0.0)
    p0, p1 = (prior[0].sum() / 2).item(), prior[1, 0].item()
    d0 = -1.5 - R_HAT - p0
    d1 = -0.5 + R_HAT - p1
    assert loss.item() == pytest.approx((d0**2 + d1**2) / 2, rel=1e-5)


@pytest.mark.parametrize("mode,expected,clipped", [
    ("none", [1.0, 1.0, 1.0], [0, 0, 0]),
    ("unclipped", [math.exp(0.5), math.exp(-0.5), math.exp(3.0)], [0, 0, 0]),
    ("clamp_max", [math.exp(0.5), math.exp(-0.5), 10.0], [0, 0, 1]),
    ("clip", [1.2, 0.8, 1.2], [1, 1, 1]),
])
def test_importance_weight_modes(mode, expected, clipped):
    cfg = AlgorithmConfig(flowrl=FlowRLConfig(is_mode=mode, is_max=10.0, is_eps=0.2))
    w, c = importance_weight(torch.tensor([0.5, -0.5, 3.0], requires_grad=True), cfg)
    assert not w.requires_grad
    assert w.tolist() == pytest.approx(expected, rel=1e-6)
    assert c.int().tolist() == clipped


def test_vargrad_is_group_variance_of_the_residual():
    cfg = resolve_algorithm(AlgorithmConfig(name="flowrl", flowrl=FlowRLConfig(beta=1.0, log_z="vargrad",
                                                                               reference="none"))).cfg
    lp = torch.tensor([[-1.0], [-2.0], [-4.0], [-0.5], [-1.5]], requires_grad=True)
    adv = torch.tensor([[1.0], [0.0], [-1.0], [0.5], [-0.5]])  # r̂ given directly
    groups = torch.tensor([0, 0, 0, 1, 1])
    mask = torch.ones(5, 1)
    ctx = LossContext(cfg=cfg, aggregate=partial(aggregate, mode="seq-mean-token-mean"), group_index=groups)
    loss, m = flowrl_loss(lp, lp.detach(), adv, mask, ctx)
    zeta = adv[:, 0] - lp[:, 0].detach()  # β r̂ − log π
    expected = sum(((zeta[g == groups] - zeta[g == groups].mean()) ** 2).sum() for g in (0, 1)) / 5
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert m["flowrl/log_z_mean"] == pytest.approx(zeta.mean().item(), rel=1e-6)  # groups of 3 and 2: not the same
    loss.backward()
    # The gradient equals the one with the group mean held fixed: 2(log Ẑ − ζ)/B per sequence.
    log_z = torch.tensor([zeta[:3].mean()] * 3 + [zeta[3:].mean()] * 2)
    assert lp.grad[:, 0].tolist() == pytest.approx((2 * (log_z - zeta) / 5).tolist(), rel=1e-5, abs=1e-7)


def test_log_z_head_pools_prompt_tokens_only_and_passes_gradient():
    torch.manual_seed(0)
    head = LogZHead(8, dropout=0.0)
    hidden = torch.randn(2, 3, 8, requires_grad=True)
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    out = head(hidden, mask)
    assert out.shape == (2,)
    changed = hidden.detach().clone()
    changed[0, 0] += 100.0  # left padding of row 0
    assert torch.allclose(head(changed, mask), out)
    out.sum().backward()
    assert hidden.grad[0, 0].abs().sum() == 0 and hidden.grad[0, 1].abs().sum() > 0
    # Architecture of the reference code's ProjZ.
    kinds = [type(mod).__name__ for mod in head.net]
    assert kinds == ["Linear", "GELU", "LayerNorm", "Dropout"] * 2 + ["Linear"]


def test_options_decide_what_the_trainer_computes_and_builds():
    def resolved(**kw):
        return resolve_algorithm(AlgorithmConfig(name="flowrl", flowrl=FlowRLConfig(**kw)))

    algo = resolved()
    assert algo.cfg.advantage == "grpo" and algo.cfg.loss == "flowrl"
    assert algo.needs == {"ref_log_prob", "hidden"}
    assert set(algo.module_factories) == {"log_z"}
    cfg = type("C", (), {"hidden_size": 12})()
    head = algo.module_factories["log_z"](cfg, algo.cfg)
    assert isinstance(head, LogZHead) and head.net[0].in_features == 12
    assert resolved(reference="old", log_z="vargrad").needs == {"whole_groups"}  # log Z: a group mean
    assert resolved(reference="none", log_z="vargrad").module_factories == {}
    scalar = resolved(log_z="scalar", log_z_lr_multiplier=10.0)
    assert scalar.needs == {"ref_log_prob"}
    assert scalar.module_factories["log_z"](None, scalar.cfg).lr_multiplier == 10.0


@pytest.mark.parametrize("key,value", [("is_mode", "clamp"), ("reference", "sft"), ("log_z", "mlp")])
def test_bad_option_names_the_key(key, value):
    cfg = load_config(None, ["algorithm.name=flowrl", f"algorithm.flowrl.{key}={value}"])
    with pytest.raises(ConfigError, match=f"algorithm.flowrl.{key}"):
        resolve_algorithm(cfg.algorithm)


@pytest.mark.parametrize("override", ["algorithm.tis_cap=2", "algorithm.entropy_adv_alpha=0.4",
                                      "algorithm.entropy_top_rho=0.2"])
def test_per_token_advantage_rescalings_are_refused(override):
    # FlowRL reads r̂ back from its advantages: a TIS weight or an entropy term would move its
    # target β·r̂, so these are errors for it, and stay allowed for the losses linear in Â.
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"{key}: .*loss='flowrl'"):
        resolve_algorithm(load_config(None, ["algorithm.name=flowrl", override]).algorithm)
    assert resolve_algorithm(load_config(None, ["algorithm.name=grpo", override]).algorithm).cfg.loss == "ppo_clip"


def test_micro_batches_never_split_a_group():
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3])
    slices = micro_batches(10, 4, groups)
    assert [(s.start, s.stop) for s in slices] == [(0, 6), (6, 10)]
    assert [(s.start, s.stop) for s in micro_batches(10, 4)] == [(0, 4), (4, 8), (8, 10)]
    assert [(s.start, s.stop) for s in micro_batches(10, 3, groups)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
