"""STEER (Hao et al. 2025): the entropy-change estimate Ω and the token weights against hand computations (exp and
linear mappings, the floor), the gradient of the weighted loss by hand, padding never reaching the weights, config
refusals, λ_min = 1 giving GRPO's update exactly, and the entropy moving less than under GRPO: on a tabular softmax
(where Ω describes each token's own position) by more than a uniform down-weighting of the same mean, and on the
tiny model over a few steps from the same start."""

import math
from types import SimpleNamespace

import pytest
import torch

from anabranch.algorithms.grpo import ppo_clip_loss
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.algorithms.steer import entropy_change_estimate, steer_loss, steer_weights
from anabranch.config import AlgorithmConfig, ConfigError
from test_lp_reg import model  # noqa: F401  (the tiny model fixture, shared)

# One response of four tokens, the last one padding. π, π_old, H and Â per token.
P = [0.5, 0.9, 0.2, 0.1]
P_OLD = [0.5, 0.6, 0.2, 0.1]
H = [1.0, 0.3, 2.0, 5.0]
A = [1.0, 1.0, -1.0, 1.0]
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])


def _hand_omega():
    return [A[i] / P_OLD[i] * P[i] * (1 - P[i]) * (math.log(P[i]) + H[i]) for i in range(3)]


def _tensors():
    t = lambda xs: torch.tensor([xs], dtype=torch.float64)  # noqa: E731
    return t([math.log(p) for p in P]), t([math.log(p) for p in P_OLD]), t(H), t(A)


def test_omega_and_exp_weights_against_hand_values():
    omega = entropy_change_estimate(*_tensors(), MASK)
    hand = _hand_omega()  # 0.15343, 0.02919 (π_old = 0.6, not 0.9), −0.31245
    assert omega[0, :3].tolist() == pytest.approx(hand, rel=1e-12) and omega[0, 3] == 0.0
    assert hand[0] == pytest.approx(0.5 * (1 - math.log(2)), rel=1e-12)  # the first by hand: (1/.5)·.25·(ln .5 + 1)
    w = steer_weights(omega, MASK, 0.8)
    k = -math.log(0.8) / abs(hand[2])  # the largest |Ω| is token 3's: it gets exactly λ_min
    assert w[0].tolist() == pytest.approx([math.exp(-k * abs(hand[0])), math.exp(-k * abs(hand[1])), 0.8, 0.0])
    assert w[0, 0].item() == pytest.approx(0.89622, abs=1e-5)
    # Below the floor the scale is capped: k = −ln(0.8)/0.02 and no token reaches λ_min.
    small = omega * 0.01
    ws = steer_weights(small, MASK, 0.8)
    kf = -math.log(0.8) / 0.02
    assert ws[0, :3].tolist() == pytest.approx([math.exp(-kf * abs(0.01 * h)) for h in hand])
    assert ws[0, :3].min() > 0.8


def test_linear_weights_against_hand_values():
    omega = entropy_change_estimate(*_tensors(), MASK)
    size = [abs(h) for h in _hand_omega()]
    lo, hi = min(size), max(size)
    w = steer_weights(omega, MASK, 0.5, 1.5, mapping="linear")
    assert w[0].tolist() == pytest.approx([1.5 - (s - lo) * (1.0 / (hi - lo)) for s in size] + [0.0])
    assert w[0, 1].item() == pytest.approx(1.5) and w[0, 2].item() == pytest.approx(0.5)
    flat = steer_weights(torch.full((1, 4), 0.3), MASK, 0.5, 1.5, mapping="linear")
    assert flat[0].tolist() == [1.0, 1.0, 1.0, 0.0]  # all |Ω| equal: the midpoint


def _ctx(cfg, entropy):
    return SimpleNamespace(cfg=cfg, aggregate=lambda loss, m: (loss * m).sum() / m.sum(), entropy=entropy)


def test_gradient_of_the_weighted_loss_by_hand():
    lp, old, ent, adv = _tensors()
    cfg = resolve_algorithm(AlgorithmConfig(name="steer")).cfg  # clip 0.2 / 0.28, dual-clip 10
    # Token 2's ratio 0.9/0.6 = 1.5 > 1.28 with Â > 0: clipped, no gradient. The others: ρ = 1.
    lp = lp.clone().requires_grad_(True)
    loss, metrics = steer_loss(lp, old, adv, MASK.double(), _ctx(cfg, ent))
    loss.backward()
    hand = _hand_omega()
    k = -math.log(0.8) / abs(hand[2])
    lam = [math.exp(-k * abs(h)) for h in hand]
    # L = (1/3)·Σ λ_t·(−ρ_t·Â_t) on the unclipped tokens ⇒ ∂L/∂log π_t = −λ_t·Â_t·ρ_t/3 (ρ = 1 there).
    assert lp.grad[0].tolist() == pytest.approx([-lam[0] * 1 / 3, 0.0, -lam[2] * (-1) / 3, 0.0], abs=1e-12)
    clipped_term = -1.0 * (1 + 0.28) * lam[1]
    assert loss.item() == pytest.approx((-lam[0] + clipped_term + lam[2]) / 3)
    assert metrics["clip_frac"] == pytest.approx(1 / 3) and metrics["steer/weight_min_mb_mean"] == pytest.approx(0.8)
    assert metrics["steer/omega_mean"] == pytest.approx(sum(hand) / 3)


def test_padding_never_reaches_the_weights_or_the_loss():
    lp, old, ent, adv = _tensors()
    cfg = resolve_algorithm(AlgorithmConfig(name="steer")).cfg
    base_w = steer_weights(entropy_change_estimate(lp, old, ent, adv, MASK), MASK, 0.8)
    base_loss, _ = steer_loss(lp, old, adv, MASK.double(), _ctx(cfg, ent))
    # Junk in the padded slot (a huge Â that would set the max |Ω|, a nan entropy) changes nothing.
    for field, value in (("adv", 1e6), ("ent", float("nan")), ("lp", -1e-9)):
        lp2, ent2, adv2 = lp.clone(), ent.clone(), adv.clone()
        {"adv": adv2, "ent": ent2, "lp": lp2}[field][0, 3] = value
        w = steer_weights(entropy_change_estimate(lp2, old, ent2, adv2, MASK), MASK, 0.8)
        assert torch.equal(w, base_w) and w[0, 3] == 0.0
        loss, _ = steer_loss(lp2, old, adv2, MASK.double(), _ctx(cfg, ent2))
        assert loss.item() == pytest.approx(base_loss.item(), rel=1e-12)
    # The weights alone also ignore a masked slot: a large |Ω| there does not set the scale k.
    omega = entropy_change_estimate(lp, old, ent, adv, MASK)
    omega[0, 3] = 10.0
    assert torch.equal(steer_weights(omega, MASK, 0.8), base_w)
    assert torch.equal(steer_weights(omega, MASK, 0.5, 1.5, "linear"),
                       steer_weights(entropy_change_estimate(lp, old, ent, adv, MASK), MASK, 0.5, 1.5, "linear"))
    none = torch.zeros(1, 4)
    assert torch.equal(steer_weights(torch.ones(1, 4), none, 0.8), none)


@pytest.mark.parametrize("overrides,match", [
    (["algorithm.steer_weight_min=0.5"], "algorithm.steer_weight_min.*algorithm.loss=steer"),
    (["algorithm.name=clip_cov", "algorithm.steer_mapping=linear"], "algorithm.steer_mapping.*algorithm.loss=steer"),
    (["algorithm.name=steer", "algorithm.steer_weight_max=1.2"], "steer_weight_max=1.2 has no effect with steer_mapping=exp"),
    (["algorithm.name=steer", "algorithm.steer_weight_min=0"], "steer_weight_min must be in \\(0, 1\\]"),
    (["algorithm.name=steer", "algorithm.steer_weight_min=1.5"], "steer_weight_min must be in \\(0, 1\\]"),
    (["algorithm.name=steer", "algorithm.steer_mapping=sigmoid"], "steer_mapping must be one of"),
    (["algorithm.name=steer", "algorithm.steer_omega_floor=0"], "steer_omega_floor must be positive"),
    (["algorithm.name=steer", "algorithm.steer_mapping=linear", "algorithm.steer_weight_min=1.2"],
     "min <= max"),
    (["algorithm.name=steer", "algorithm.steer_mapping=linear", "algorithm.steer_omega_floor=0.1"],
     "steer_omega_floor=0.1 has no effect with steer_mapping=linear"),
])
def test_bad_or_inactive_keys_are_refused_at_load(tiny_model_dir, overrides, match):
    from anabranch import load_config

    with pytest.raises(ConfigError, match=match):
        load_config(None, [f"model.path={tiny_model_dir}"] + overrides)


def test_recipe_and_refusals_of_a_config_built_in_code(tiny_model_dir):
    from anabranch import load_config

    cfg = load_config(None, [f"model.path={tiny_model_dir}", "algorithm.name=steer", "algorithm.steer_mapping=linear",
                             "algorithm.steer_weight_min=0.5", "algorithm.steer_weight_max=1.5"]).algorithm
    assert (cfg.loss, cfg.advantage, cfg.clip_ratio_high, cfg.clip_ratio_c) == ("steer", "grpo", 0.28, 10.0)
    algo = resolve_algorithm(cfg)
    assert not algo.inert_at_zero_advantage  # its max |Ω| is over the micro-batch: rows cannot be left out
    from anabranch.config import Config
    from anabranch.config_checks import check_whole_config

    with pytest.raises(ConfigError, match="algorithm.steer_weight_min.*algorithm.loss=steer"):  # train()'s check
        check_whole_config(Config(algorithm=AlgorithmConfig(name="grpo", steer_weight_min=0.5)))
    with pytest.raises(ConfigError, match="steer_weight_max"):
        resolve_algorithm(AlgorithmConfig(name="steer", steer_weight_max=2.0))


def _batch(vocab, n=8, width=6):
    from anabranch.rollout.base import Rollout

    g = torch.Generator().manual_seed(4)
    return Rollout(torch.randint(3, vocab, (n, 3), generator=g), torch.ones(n, 3, dtype=torch.long),
                   torch.randint(3, vocab, (n, width), generator=g), torch.ones(n, width, dtype=torch.long),
                   group_index=torch.arange(n) // 2, prompts=["a"] * (n // 2), completions=[""] * n,
                   truncated=torch.zeros(n, dtype=torch.bool))


def _entropy(model, ro):
    with torch.no_grad():
        ids = torch.cat([ro.prompt_ids, ro.response_ids], 1)
        lp = model(ids).logits[:, ro.prompt_ids.shape[1] - 1:-1].float().log_softmax(-1)
        return -(lp.exp() * lp).sum(-1)


def _train(model, algo, steps, lr=0.5):
    """`steps` SGD updates on one fixed batch from the model's current weights; the entropy change per token and
    the last step's metrics; the weights are put back."""
    from anabranch.trainer.step import policy_update

    ro = _batch(model.config.vocab_size)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0, 1.0])[:, None].expand(8, 6).clone()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    h0 = _entropy(model, ro)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        metrics = policy_update(model, opt, ro, adv, torch.zeros(8), algo, micro_batch_size=8, grad_clip=0.0,
                                temperature=1.0, max_response_len=6)
    delta, after = _entropy(model, ro) - h0, {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    return delta, metrics, after


def test_extreme_metrics_are_the_token_share_mean_of_each_micro_batchs_extreme(model):
    """The trainer averages metrics over micro-batches by token share: a micro-batch's max |Ω| (and min λ) is
    logged as that mean (``_mb_mean``), not as the batch's max, and that is what each micro-batch's k used."""
    from anabranch.trainer.step import policy_update

    ro = _batch(model.config.vocab_size)
    # Rows 0-3 (the first micro-batch of 4) get |Â| = 1, rows 4-7 |Â| = 0.05: Ω ∝ Â, so their maxima differ.
    scale = torch.tensor([1.0, -1.0, -1.0, 1.0, 0.05, -0.05, -0.05, 0.05])
    adv = scale[:, None].expand(8, 6).clone()
    with torch.no_grad():  # π_θ = π_old on the one pass; H from the same forward
        ids = torch.cat([ro.prompt_ids, ro.response_ids], 1)
        lp_all = model(ids).logits[:, ro.prompt_ids.shape[1] - 1:-1].float().log_softmax(-1)
        lp = lp_all.gather(-1, ro.response_ids[..., None])[..., 0]
        ent = -(lp_all.exp() * lp_all).sum(-1)
    omega = entropy_change_estimate(lp, lp, ent, adv, torch.ones(8, 6)).abs()
    tops = [omega[:4].max().item(), omega[4:].max().item()]
    lam_min = [math.exp(math.log(0.8) / max(t, 0.02) * t) for t in tops]  # λ of each micro-batch's largest |Ω|
    assert tops[0] > 2 * tops[1] and tops[1] < 0.02 < tops[0]  # the second micro-batch is under the floor
    algo = resolve_algorithm(AlgorithmConfig(name="steer"))
    m = policy_update(model, torch.optim.SGD(model.parameters(), lr=0.0), ro, adv, torch.zeros(8), algo,
                      micro_batch_size=4, grad_clip=0.0, temperature=1.0, max_response_len=6)
    assert m["steer/abs_omega_max_mb_mean"] == pytest.approx((tops[0] + tops[1]) / 2, rel=1e-4)
    assert m["steer/abs_omega_max_mb_mean"] < 0.9 * max(tops)  # not the batch's max
    assert m["steer/weight_min_mb_mean"] == pytest.approx((lam_min[0] + lam_min[1]) / 2, rel=1e-4)
    assert lam_min[0] == pytest.approx(0.8) and lam_min[1] > 0.8
    assert "steer/abs_omega_max" not in m and "steer/weight_min" not in m


def test_weight_min_one_is_exactly_the_grpo_update(model):
    same = dict(clip_ratio_high=0.28, clip_ratio_c=10.0)
    _, _, grpo = _train(model, resolve_algorithm(AlgorithmConfig(name="grpo", **same)), 1)
    _, m, steer = _train(model, resolve_algorithm(AlgorithmConfig(name="steer", steer_weight_min=1.0)), 1)
    assert m["steer/weight_mean"] == 1.0 and all(torch.equal(grpo[n], steer[n]) for n in grpo)


def test_tiny_model_entropy_moves_less_than_under_grpo_from_the_same_start(model):
    same = dict(clip_ratio_high=0.28, clip_ratio_c=10.0)
    d_grpo, _, _ = _train(model, resolve_algorithm(AlgorithmConfig(name="grpo", **same)), 3)
    d_steer, m, _ = _train(model, resolve_algorithm(AlgorithmConfig(name="steer", steer_weight_min=0.1)), 3)
    assert m["steer/weight_min_mb_mean"] < 1.0 and m["steer/weight_mean"] < 1.0
    assert d_grpo.abs().mean() > 0.005  # GRPO's steps move the entropy
    assert d_steer.abs().mean() < 0.8 * d_grpo.abs().mean() and abs(d_steer.mean()) < abs(d_grpo.mean())


def test_tabular_policy_token_entropy_change_damped_beyond_uniform_downweighting():
    """Free logits per position (each token's update moves only its own position's distribution, the setting of
    the first-order estimate): one STEER step changes the per-token entropies less, in total |ΔH|, than a GRPO step
    whose advantages are all scaled by STEER's mean weight, so it is the choice of tokens, not the smaller step."""
    B, T, V = 8, 16, 12
    cfg_steer = AlgorithmConfig(name="steer", loss="steer", steer_weight_min=0.1)
    cfg_grpo = AlgorithmConfig()

    def entropy(z):
        lp = z.log_softmax(-1)
        return -(lp.exp() * lp).sum(-1)

    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        z0 = torch.randn(B, T, V, generator=g) * 3
        y = torch.multinomial(z0.softmax(-1).view(-1, V), 1, generator=g).view(B, T)
        adv = (torch.randint(0, 2, (B,), generator=g).float() * 2 - 1)[:, None].expand(B, T).clone()

        def step(loss_fn, cfg, a):
            z = z0.clone().requires_grad_(True)
            lp = z.log_softmax(-1).gather(-1, y[..., None])[..., 0]
            loss, metrics = loss_fn(lp, lp.detach(), a, torch.ones(B, T), _ctx(cfg, entropy(z).detach()))
            loss.backward()
            return (entropy(z - 0.05 * B * T * z.grad) - entropy(z0)).detach(), metrics

        d_steer, m = step(steer_loss, cfg_steer, adv)
        d_uniform, _ = step(ppo_clip_loss, cfg_grpo, adv * m["steer/weight_mean"])
        assert 0.3 < m["steer/weight_mean"] < 0.9
        assert d_steer.abs().sum() < 0.95 * d_uniform.abs().sum()
