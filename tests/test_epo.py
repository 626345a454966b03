"""EPO's entropy smoothing (Xu et al. 2025): the band penalty and its gradient against hand computations,
the phase weight schedule, the history across steps and its checkpoint, the term inside policy_update
(off changes nothing, on moves the entropy back into the band), config refusals, and a short run resumed
from a checkpoint that matches the uninterrupted one."""

import math
from pathlib import Path

import pytest
import torch

from anabranch.algorithms.aggregation import aggregate
from anabranch.algorithms.epo import EpoHistory, band_penalty, phase_weight
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.config import AlgorithmConfig, ConfigError
from test_lp_reg import model  # noqa: F401  (the tiny model fixture, shared)


def test_phase_weight_against_hand_values():
    # K = 10: ⌊K/2⌋ = 5; slow phase 1 − 0.2(1 − e^{−2p/5}), fast phase 0.8·e^{−3(p−5)/5}.
    assert phase_weight(0, 10) == 1.0
    assert phase_weight(3, 10) == pytest.approx(1 - 0.2 * (1 - math.exp(-1.2)))
    assert phase_weight(5, 10) == pytest.approx(0.8 + 0.2 * math.exp(-2.0))
    assert phase_weight(6, 10) == pytest.approx(0.8 * math.exp(-0.6))
    assert phase_weight(10, 10) == pytest.approx(0.8 * math.exp(-3.0))
    assert phase_weight(25, 10) == phase_weight(10, 10)  # held at the horizon's value
    assert phase_weight(8, 10, gamma=1.0) == pytest.approx(0.8 * math.exp(-0.6))
    assert phase_weight(7, 0) == 1.0  # no schedule
    ws = [phase_weight(k, 150) for k in range(151)]
    assert all(a >= b for a, b in zip(ws, ws[1:]))


def test_band_penalty_value_and_gradient_by_hand():
    # H̄ = 1, band [0.8, 2.0]: 0.5 is 0.3 below, 1.0 and 1.9 inside, 2.5 is 0.5 above; the last token is padding.
    ent = torch.tensor([[0.5, 1.0, 1.9, 2.5, 9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    pen = band_penalty(ent, mask, 1.0, 0.8, 2.0)
    assert torch.allclose(pen, torch.tensor([[0.3, 0.0, 0.0, 0.5, 0.0]]))
    pen.sum().backward()
    assert torch.equal(ent.grad, torch.tensor([[-1.0, 0.0, 0.0, 1.0, 0.0]]))  # raise below, lower above
    # Floor off (κ_l = 0): only the ceiling acts.
    assert torch.allclose(band_penalty(ent.detach(), mask, 1.0, 0.0, 2.0), torch.tensor([[0.0, 0, 0, 0.5, 0]]))
    # seq mode: row means (0.5+1.0)/2 = 0.75 (0.05 below 0.8) and (3+3)/2 = 3 (1.0 above 2), on every token.
    ent2 = torch.tensor([[0.5, 1.0, 7.0], [3.0, 3.0, 0.0]], requires_grad=True)
    mask2 = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    pen2 = band_penalty(ent2, mask2, 1.0, 0.8, 2.0, mode="seq")
    assert torch.allclose(pen2, torch.tensor([[0.05, 0.05, 0.0], [1.0, 1.0, 0.0]]))
    pen2.sum().backward()  # each row's 2 tokens carry P(mean): d/dH_t = 2 · (∓1) · 1/2
    assert torch.allclose(ent2.grad, torch.tensor([[-1.0, -1.0, 0.0], [1.0, 1.0, 0.0]]))


def test_history_pass_loss_fold_window_and_state():
    state = EpoHistory(coef=2.0, low=0.8, high=1.2, horizon=10)
    ent = torch.tensor([[1.0, 3.0], [2.0, 2.0]], requires_grad=True)
    mask = torch.ones(2, 2)
    agg = lambda x, m: aggregate(x, m, "token-mean")  # noqa: E731
    p = state.begin()
    loss, metrics = p.loss(ent, mask, torch.tensor([0, 1]), agg)
    assert loss.item() == 0.0 and metrics == {}  # no history yet
    assert p.finish() == {"epo/active": 0.0, "epo/weight": 1.0, "epo/batch_entropy": 2.0}
    assert state.mean() == 2.0 and state.steps == 1
    # Step 2: H̄ = 2, band [1.6, 2.4], w = 1 − 0.2(1 − e^{−0.4}); tokens 1.0 (0.6 below) and 3.0 (0.6 above).
    p = state.begin()
    assert p.weight == pytest.approx(1 - 0.2 * (1 - math.exp(-0.4)))
    loss, metrics = p.loss(ent, mask, torch.tensor([0, 1]), agg)
    assert loss.item() == pytest.approx(2.0 * p.weight * (0.6 + 0.6) / 4)
    assert metrics == {"epo/below": 0.25, "epo/above": 0.25, "epo/penalty": pytest.approx(0.3)}
    loss.backward()
    g = 2.0 * p.weight / 4
    assert torch.allclose(ent.grad, torch.tensor([[-g, g], [0.0, 0.0]]))
    # A second epoch over the same rows does not count them twice; the batch entropy is the first forward's.
    p.loss(ent.detach() + 5, mask, torch.tensor([0, 1]), agg)
    out = p.finish()
    assert out["epo/history_entropy"] == 2.0 and out["epo/batch_entropy"] == 2.0 and out["epo/active"] == 1.0
    # Cumulative mean of the per-step values vs a window of the last one.
    for v in (5.0,):
        state.fold(v)
    assert state.mean() == pytest.approx(3.0)
    windowed = EpoHistory(coef=1.0, window=1)
    for v in (2.0, 2.0, 5.0):
        windowed.fold(v)
    assert windowed.mean() == 5.0
    # Checkpoint round trip.
    fresh = EpoHistory(coef=2.0, low=0.8, high=1.2, horizon=10)
    fresh.load_state_dict(state.state_dict())
    assert (fresh.mean(), fresh.steps, fresh.begin().weight) == (state.mean(), 3, state.begin().weight)


def _batch(vocab, n=4, width=6):
    from anabranch.rollout.base import Rollout

    g = torch.Generator().manual_seed(5)
    return Rollout(torch.randint(3, vocab, (n, 3), generator=g), torch.ones(n, 3, dtype=torch.long),
                   torch.randint(3, vocab, (n, width), generator=g), torch.ones(n, width, dtype=torch.long),
                   group_index=torch.arange(n) // 2, prompts=["a"] * (n // 2), completions=[""] * n,
                   truncated=torch.zeros(n, dtype=torch.bool))


def _update(model, algo, adv_scale=1.0, lr=0.1, keep=False):
    from anabranch.trainer.step import policy_update

    ro = _batch(model.config.vocab_size)
    adv = adv_scale * torch.tensor([1.0, -1.0, -1.0, 1.0])[:, None].expand(4, 6).clone()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    metrics = policy_update(model, opt, ro, adv, torch.tensor([1.0, 0.0, 0.0, 1.0]), algo,
                            micro_batch_size=2, grad_clip=0.0, temperature=1.0, max_response_len=6)
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    if not keep:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start[n])
    return metrics, after, start


def test_off_is_identical_and_on_pulls_the_entropy_back_into_the_band(model):
    assert AlgorithmConfig().epo_coef == 0 and resolve_algorithm(AlgorithmConfig(name="grpo")).epo is None
    off, off_w, _ = _update(model, resolve_algorithm(AlgorithmConfig(name="grpo")))
    assert not any(k.startswith("epo/") for k in off)
    algo = resolve_algorithm(AlgorithmConfig(name="grpo", epo_coef=5.0))
    assert not algo.inert_at_zero_advantage  # the penalty has a gradient on rows with Â = 0
    first, first_w, _ = _update(model, algo)  # no history: no term, bit-identical
    assert first["loss"] == off["loss"] and all(torch.equal(off_w[n], first_w[n]) for n in off_w)
    assert first["epo/active"] == 0.0 and algo.epo.mean() == pytest.approx(first["epo/batch_entropy"])
    h0 = first["epo/batch_entropy"]
    # History far below the current entropy (ceiling 1.2·H̄ < H): only the ceiling acts; with Â = 0 the
    # penalty alone drives the update, and the entropy goes down, toward the band, step after step.
    algo.epo.total, algo.epo.count = h0 / 2, 1
    entropies, start = [], None
    for _ in range(3):
        m, _, s = _update(model, algo, adv_scale=0.0, lr=0.5, keep=True)
        start = start or s
        algo.epo.total, algo.epo.count, algo.epo.recent = h0 / 2, 1, []  # keep the band fixed
        entropies.append(m["epo/batch_entropy"])
        assert m["epo/active"] == 1.0 and m["epo/above"] == 1.0 and m["epo/below"] == 0.0 and m["loss"] > 0
    after = _update(model, algo, adv_scale=0.0, lr=0.0)[0]["epo/batch_entropy"]
    assert entropies[0] == pytest.approx(h0, rel=1e-5) and after < entropies[-1] < entropies[0]
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    # History far above: the floor acts and the entropy goes up.
    algo.epo.total, algo.epo.count = h0 * 3, 1
    _update(model, algo, adv_scale=0.0, lr=0.5, keep=True)
    algo.epo.total, algo.epo.count = h0 * 3, 1
    up = _update(model, algo, adv_scale=0.0, lr=0.0)[0]
    assert up["epo/below"] == 1.0 and up["epo/batch_entropy"] > h0
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])


@pytest.mark.parametrize("key,value", [("epo_coef", -1.0), ("epo_coef", float("nan")), ("epo_low", -0.1),
                                       ("epo_high", 0.8), ("epo_high", float("inf")), ("epo_mode", "turn"),
                                       ("epo_window", -1), ("epo_window", 2.5), ("epo_horizon", -3),
                                       ("epo_gamma", 0.0)])
def test_bad_values_are_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=f"algorithm.{key}"):
        resolve_algorithm(AlgorithmConfig(name="grpo", **{"epo_coef": 0.1, key: value}))


def test_knobs_without_epo_are_refused(tiny_model_dir):
    from anabranch import load_config

    base = [f"model.path={tiny_model_dir}"]
    with pytest.raises(ConfigError, match="algorithm.epo_high.*algorithm.epo_coef > 0"):
        load_config(None, base + ["algorithm.epo_high=2.0"])
    with pytest.raises(ConfigError, match="algorithm.epo_gamma.*epo_horizon > 0"):
        load_config(None, base + ["algorithm.epo_coef=0.1", "algorithm.epo_gamma=2.0"])
    cfg = load_config(None, base + ["algorithm.epo_coef=0.1", "algorithm.epo_low=0", "algorithm.epo_high=2",
                                    "algorithm.epo_horizon=150", "algorithm.epo_gamma=3", "algorithm.epo_mode=seq"])
    assert cfg.algorithm.epo_high == 2


def test_short_run_checkpoints_the_history_and_resumes_identically(tiny_model_dir, write_jsonl, tmp_path):
    from anabranch import load_config, train

    data = write_jsonl([{"prompt": f"Q{i}: say seven", "answer": "7" if i % 2 else "3"} for i in range(16)])
    over = {"model.path": tiny_model_dir, "task.name": "file", "task.path": data, "task.eval_size": 4,
            "rollout.n": 4, "rollout.prompts_per_step": 2, "rollout.max_new_tokens": 4, "trainer.steps": 3,
            "trainer.lr": 1e-2, "trainer.output_dir": str(tmp_path), "trainer.progress": False,
            "trainer.save_every": 2, "trainer.micro_batch_size": 8, "trainer.device": "cpu",
            "trainer.eval_before": False, "algorithm.epo_coef": 1.0, "algorithm.epo_horizon": 3}
    cfg = lambda **kw: load_config(None, [f"{k}={v}" for k, v in {**over, **kw}.items()])  # noqa: E731
    full = train(cfg(**{"trainer.run_name": "full"}))
    hist = [m for m in full.history if "epo/weight" in m]
    assert len(hist) == 3 and [m["epo/active"] for m in hist] == [0.0, 1.0, 1.0]
    assert [m["epo/weight"] for m in hist] == pytest.approx([phase_weight(k, 3) for k in range(3)])
    h = [m["epo/batch_entropy"] for m in hist]
    assert [m["epo/history_entropy"] for m in hist[1:]] == pytest.approx([h[0], (h[0] + h[1]) / 2])
    ckpt = Path(full.run_dir) / "checkpoints" / "step-000002"
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False, map_location="cpu")
    assert state["stateful"]["epo"] == {"total": pytest.approx(h[0] + h[1]), "count": 2, "recent": [], "steps": 2}
    resumed = train(cfg(**{"trainer.run_name": "resumed", "trainer.resume": str(ckpt)}))
    again = [m for m in resumed.history if "epo/weight" in m][2:]
    for key in ("epo/history_entropy", "epo/weight", "epo/batch_entropy", "epo/penalty"):
        assert [m[key] for m in again] == pytest.approx([m[key] for m in hist[2:]], rel=1e-5), key
