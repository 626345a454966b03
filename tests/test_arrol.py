"""ARRoL (algorithms/arrol.py, trainer/arrol_rollouts.py): the balanced keep rule, the head's BCE step, the
two-phase rollout (scripted backend), the warm-up, learning a separable toy, refusals, a short run."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from anabranch.algorithms.arrol import balanced_keep, binary_auc, keep_count
from anabranch.config import ConfigError, load_config
from anabranch.trainer import arrol_rollouts
from anabranch.trainer.arrol_rollouts import ARRoL
from arrol_fixtures import EOS, PAD, FakeModel, ScriptedBackend, Tok, arrol_cfg, phase_one


def hand_head(state, weight, bias=0.0):
    with torch.no_grad():
        state.head.net.weight.copy_(torch.tensor(weight, dtype=torch.float32))
        state.head.net.bias.fill_(bias)


# ----------------------------------------------------------------------------- the keep rule

def test_balanced_keep_takes_the_top_k_and_the_bottom_n_minus_k_per_group():
    probs = torch.tensor([[0.9, 0.1, 0.5, 0.8, 0.3, 0.7, 0.2, 0.6],
                          [0.5, 0.5, 0.5, 0.5, 0.4, 0.6, 0.5, 0.5]])
    # ρ = 0.5, n = 4: k = 2 -> group 0 keeps 0.9, 0.8 (cols 0, 3) and 0.1, 0.2 (cols 1, 6)
    # group 1: top 0.6 (col 5), then the first of the ties (col 0); bottom 0.4 (col 4), then the last tie (col 7)
    assert balanced_keep(probs, 4, 0.5).tolist() == [[0, 1, 3, 6], [0, 4, 5, 7]]
    assert balanced_keep(probs[:1], 4, 0.75).tolist() == [[0, 1, 3, 5]]   # k = 3: 0.9, 0.8, 0.7 and 0.1
    assert balanced_keep(probs[:1], 4, 0.0).tolist() == [[1, 2, 4, 6]]    # k = 0: the four least likely
    assert balanced_keep(probs[:1], 4, 1.0).tolist() == [[0, 3, 5, 7]]    # k = 4: the four most likely
    assert balanced_keep(probs[:1], 8, 0.5).tolist() == [list(range(8))]  # n = n': nothing pruned
    assert keep_count(3, 0.5) == 2 and keep_count(5, 0.5) == 3 and keep_count(4, 0.3) == 1  # round half up
    with pytest.raises(ValueError):
        balanced_keep(probs, 9, 0.5)


def test_binary_auc_by_hand():
    assert binary_auc(torch.tensor([0.9, 0.2, 0.6, 0.4]), torch.tensor([1.0, 0.0, 0.0, 1.0])) == pytest.approx(0.75)
    assert binary_auc(torch.tensor([0.5, 0.5]), torch.tensor([1.0, 0.0])) == pytest.approx(0.5)
    assert binary_auc(torch.tensor([0.5, 0.7]), torch.tensor([1.0, 1.0])) is None


# ----------------------------------------------------------------------------- the head's update

def test_head_bce_step_by_hand():
    state = ARRoL(arrol_cfg("rollout.arrol.head_lr=0.01"), FakeModel(2))
    hand_head(state, [[1.0, 0.0]])
    h = torch.tensor([[2.0, 0.0], [-1.0, 0.0]])
    loss = state.train_head(h, torch.tensor([1.0, 0.0]))
    # logits 2, −1: mean BCE = (softplus(−2) + softplus(−1)) / 2
    assert loss == pytest.approx((math.log1p(math.exp(-2)) + math.log1p(math.exp(-1))) / 2, rel=1e-6)
    s2, s1 = 1 / (1 + math.exp(-2)), 1 / (1 + math.exp(1))
    grad_w0 = ((s2 - 1) * 2 + s1 * -1) / 2   # mean (σ(z) − c)·h
    grad_b = ((s2 - 1) + s1) / 2
    assert state.head.net.weight.grad[0, 0].item() == pytest.approx(grad_w0, rel=1e-5)
    assert state.head.net.bias.grad[0].item() == pytest.approx(grad_b, rel=1e-5)
    # Adam's first step moves each parameter by lr against its gradient's sign; a zero gradient moves nothing
    assert state.head.net.weight[0].tolist() == pytest.approx([1.0 + 0.01, 0.0], abs=1e-6)
    assert state.head.net.bias.item() == pytest.approx(-0.01, abs=1e-6)
    assert state.updates == 1


def test_head_learns_a_separable_toy():
    g = torch.Generator().manual_seed(0)

    def draw(k):
        y = (torch.rand(k, generator=g) < 0.5).float()
        h = torch.randn(k, 8, generator=g) + (2 * y[:, None] - 1)  # correct ~ N(+1, I), wrong ~ N(−1, I)
        return h, y

    state = ARRoL(arrol_cfg("rollout.arrol.head_lr=0.05"), FakeModel(8))
    for _ in range(60):
        state.train_head(*draw(32))
    h, y = draw(400)
    acc = ((state.predict(h) >= 0.5).float() == y).float().mean().item()
    assert acc > 0.9
    assert state.updates == 60


def test_state_round_trips():
    cfg = arrol_cfg()
    a = ARRoL(cfg, FakeModel(3))
    a.train_head(torch.randn(4, 3), torch.tensor([1.0, 0.0, 1.0, 0.0]))
    b = ARRoL(cfg, FakeModel(3))
    b.load_state_dict(a.state_dict())
    h = torch.randn(5, 3)
    assert torch.equal(a.predict(h), b.predict(h)) and b.updates == 1
    assert b.optimizer.state_dict()["state"][0]["step"] == a.optimizer.state_dict()["state"][0]["step"]


# ----------------------------------------------------------------------------- the two-phase rollout

def test_two_phase_rollout_keeps_prefix_plus_continuation_of_the_survivors(monkeypatch):
    h = torch.tensor([[3.0], [1.0], [0.0], [-3.0], [-2.0], [2.0], [0.5], [-0.5]])
    monkeypatch.setattr(arrol_rollouts, "prefix_features", lambda model, rollout, upto, layer, micro, tokens: h)
    state = ARRoL(arrol_cfg("rollout.arrol.warmup_steps=1"), FakeModel(1))
    hand_head(state, [[1.0]])
    state.updates = 1  # past the warm-up
    backend = ScriptedBackend([[[20, EOS, PAD], [21, 22, 23, 24], [25, EOS]]])
    out = state.generate(backend, Tok(), ["p", "q"], state.cfg)
    assert backend.generated == [(4, 2)]  # n' = 2·(1 + 1) prefixes of prune_at = 2 tokens
    # group 0 keeps the top (row 0, h = 3) and the bottom (row 3, h = −3, already ended); group 1 rows 5 and 4
    seqs, budgets, _ = backend.continued[0]
    assert seqs == [[1, 5, 6], [2, 4, 11, 12], [2, 4, 13, 14]]  # unpadded prompt ⊕ prefix of the open survivors
    assert budgets == [3, 3, 3]  # max_new_tokens − prune_at
    assert out.response_ids.tolist() == [[5, 6, 20, EOS, PAD], [10, EOS, PAD, PAD, PAD],
                                         [11, 12, 21, 22, 23], [13, 14, 25, EOS, PAD]]
    assert out.response_mask.tolist() == [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert out.truncated.tolist() == [False, False, True, False]
    assert out.group_index.tolist() == [0, 0, 1, 1] and out.prompt_ids.tolist() == [[PAD, 1]] * 2 + [[2, 4]] * 2
    # sampler log-probs: phase 1's on the prefix, the continuation's after, 0 past the response
    assert torch.allclose(out.sample_log_probs, torch.tensor([
        [0.0, -0.1, -0.5, -0.6, 0], [-0.6, -0.7, 0, 0, 0], [-0.8, -0.9, -0.5, -0.6, -0.7], [-1.0, -1.1, -0.5, -0.6, 0]]))
    assert out.loss_mask is None and out.completions[0] == "5 6 20"
    assert torch.equal(state.pending[0], h[[0, 3, 4, 5]])  # the survivors' prefix states, in row order
    m = state.metrics
    assert m["arrol/pruning"] == 1.0 and m["arrol/pruned_frac"] == 0.5
    assert m["arrol/tokens_saved"] == 3 * 3  # rows 1, 6, 7 were open when pruned (row 2 had ended)
    assert m["arrol/phase1_tokens"] == 16 and m["arrol/phase2_tokens"] == 2 + 3 + 2
    # the head trains on the survivors: predictions before the update judged against their flags
    metrics = state.observe([1.0, 0.0, 0.0, 1.0])
    assert metrics["arrol/head_acc"] == 1.0 and metrics["arrol/head_auc"] == 1.0 and state.updates == 2
    assert state.pending is None


def test_no_pruning_during_the_warm_up(monkeypatch):
    monkeypatch.setattr(arrol_rollouts, "prefix_features",
                        lambda model, rollout, upto, layer, micro, tokens: torch.zeros(rollout.response_ids.shape[0], 1))
    state = ARRoL(arrol_cfg("rollout.arrol.warmup_steps=2"), FakeModel(1))

    def plain(prompts, n):
        assert n == 2
        return phase_one(prompts, 4).take([0, 1, 4, 5])

    backend = ScriptedBackend([[[20, EOS]]], first=plain)  # a script for the pruning round after the warm-up
    for step in range(2):
        out = state.generate(backend, Tok(), ["p", "q"], state.cfg)
        assert out.response_ids.shape[0] == 4 and state.metrics["arrol/pruning"] == 0.0
        assert state.metrics["arrol/pruned_frac"] == 0.0
        state.observe([1.0, 0.0, 1.0, 0.0])
    assert backend.generated == [(2, None), (2, None)] and backend.continued == []  # full plain samples
    backend.first = phase_one
    state.generate(backend, Tok(), ["p", "q"], state.cfg)
    assert backend.generated[-1] == (4, 2) and state.metrics["arrol/pruning"] == 1.0


def test_prefix_features_read_the_last_prefix_token(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).train()
    r = phase_one(["p", "q"], 4)
    feats = arrol_rollouts.prefix_features(model, r, 1, -1, 3)
    assert model.training  # restored
    # row 4: prompt [2, 4] ⊕ its first response token 11, alone and unpadded
    with torch.no_grad():
        ref = model.eval()(input_ids=torch.tensor([[2, 4, 11]]), output_hidden_states=True).hidden_states[-1][0, -1]
    assert torch.allclose(feats[4], ref, atol=1e-5)
    # row 0: left-padded prompt [pad, 1] ⊕ 5 equals the unpadded [1, 5]
    with torch.no_grad():
        ref0 = model(input_ids=torch.tensor([[1, 5]]), output_hidden_states=True).hidden_states[-1][0, -1]
    assert torch.allclose(feats[0], ref0, atol=1e-5)
    # packed by a token budget (trainer.micro_batch_tokens; rows 0-3 keep 1 prompt column), the same states
    packed = arrol_rollouts.prefix_features(model, r, 1, -1, 3, micro_batch_tokens=6)
    assert torch.allclose(packed, feats, atol=1e-5)
    # another layer: hidden_states[1] (the first block's output)
    mid = arrol_rollouts.prefix_features(model, r, 1, 1, 8)
    with torch.no_grad():
        ref1 = model(input_ids=torch.tensor([[2, 4, 11]]), output_hidden_states=True).hidden_states[1][0, -1]
    assert torch.allclose(mid[4], ref1, atol=1e-5) and not torch.allclose(mid[4], feats[4], atol=1e-3)


# ----------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("overrides,key", [
    (["rollout.arrol.prune_at=4"], "rollout.arrol.prune_at"),  # an option while ARRoL is off
    (["rollout.arrol.enabled=true", "rollout.arrol.prune_at=32"], "rollout.arrol.prune_at"),
    (["rollout.arrol.enabled=true", "rollout.arrol.oversample=0.0"], "rollout.arrol.oversample"),
    (["rollout.arrol.enabled=true", "rollout.arrol.target_ratio=1.5"], "rollout.arrol.target_ratio"),
    (["rollout.arrol.enabled=true", "rollout.arrol.warmup_steps=0"], "rollout.arrol.warmup_steps"),
    (["rollout.arrol.enabled=true", "rollout.tools=[calculator]"], "rollout.tools"),
    (["rollout.arrol.enabled=true", "rollout.retry_turns=2"], "rollout.retry_turns"),
    (["rollout.arrol.enabled=true", "rollout.extra_rollouts=dars"], "rollout.extra_rollouts"),
    (["rollout.arrol.enabled=true", "rollout.extra_rollouts=cure", "rollout.n=16"], "rollout.extra_rollouts"),
    (["rollout.arrol.enabled=true", "rollout.min_new_tokens=2"], "rollout.min_new_tokens"),
    (["rollout.arrol.enabled=true", "algorithm.name=flowrl"], "algorithm.loss=flowrl"),
    (["rollout.arrol.enabled=true", "algorithm.guide.enabled=true"], "algorithm.guide.enabled"),
])
def test_bad_configs_are_refused(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


def test_default_is_off_and_a_good_config_loads():
    cfg = load_config(None, [])
    assert cfg.rollout.arrol.enabled is False
    cfg = load_config(None, ["rollout.arrol.enabled=true", "algorithm.name=dapo"])
    assert arrol_rollouts.prune_length(cfg) == 8 and arrol_rollouts.oversampled(cfg) == 8


# ----------------------------------------------------------------------------- a short run

def test_three_steps_on_the_tiny_model(tiny_model_dir, write_jsonl, tmp_path, monkeypatch):
    from anabranch import train
    from anabranch.trainer import loop

    trained, real_update = [], loop.policy_update

    def spy_update(model, optimizer, rollout, *args, **kwargs):
        trained.append(rollout)
        return real_update(model, optimizer, rollout, *args, **kwargs)

    monkeypatch.setattr(loop, "policy_update", spy_update)
    data = write_jsonl([{"prompt": f"Q{i}: say seven", "answer": "7"} for i in range(8)])
    overrides = {
        "model.path": tiny_model_dir, "task.name": "file", "task.path": data, "task.eval_size": 0,
        "rollout.n": 2, "rollout.prompts_per_step": 2, "rollout.max_new_tokens": 6,
        "rollout.arrol.enabled": "true", "rollout.arrol.prune_at": 2, "rollout.arrol.warmup_steps": 1,
        "trainer.steps": 3, "trainer.output_dir": str(tmp_path), "trainer.run_name": "arrol",
        "trainer.progress": False, "trainer.device": "cpu", "trainer.eval_before": False,
        "trainer.eval_after": False, "trainer.save_final": False,
    }
    result = train(load_config(None, [f"{k}={v}" for k, v in overrides.items()]))
    rows = [json.loads(line) for line in (Path(result.run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 3 and all(math.isfinite(r["loss"]) for r in steps)
    assert [r["arrol/pruning"] for r in steps] == [0.0, 1.0, 1.0]
    assert [r["arrol/pruned_frac"] for r in steps] == [0.0, 0.5, 0.5]
    assert [r["arrol/head_updates"] for r in steps] == [1.0, 2.0, 3.0]
    assert all(math.isfinite(r["arrol/head_loss"]) for r in steps)
    # the update sees n = 2 survivors per prompt, whatever was generated
    assert [t.group_index.tolist() for t in trained] == [[0, 0, 1, 1]] * 3
    assert all(int(t.response_mask.sum(-1).max()) <= 6 for t in trained)


# ----------------------------------------------------------------------------- DDP: one head on every rank

def toy_rounds():
    """Two rounds of 8 (state, flag) rows; round 1 split 3/5 over the ranks, round 2 0/8 (rank 0 idle)."""
    g = torch.Generator().manual_seed(1)
    h, y = torch.randn(2, 8, 4, generator=g), (torch.rand(2, 8, generator=g) < 0.5).float()
    return [(h[0], y[0], 3), (h[1], y[1], 0)]


# Per-row importance weights of the two toy rounds (1: a survivor, m/k_p: a probed row): rank 0's rows of round 1
# weigh 3 in all, rank 1's 11, so a per-rank Σw (or a plain row count) in the division would give another step.
PROBE_WEIGHTS = [torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 3.0, 3.0, 3.0]),
                 torch.tensor([1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0])]


def head_cfg(weights):
    """The toy head's config; with per-row weights, the probe is on (rollout.arrol.head_probe) as it would be."""
    probe = [] if weights is None else ["rollout.arrol.head_probe=0.5"]
    return arrol_cfg("rollout.arrol.head_lr=0.1", "rollout.arrol.head_updates=2", *probe)


def toy_round_weights(weights):
    """Each toy round's per-row weights: ``weights``' own, or None (the unweighted step) for both rounds."""
    return [None, None] if weights is None else weights


def _ddp_worker(rank: int, world: int, port: int, out: str, weights=None) -> None:
    from two_process import join_gloo

    join_gloo(rank, world, port)

    def all_reduce_sum(t):
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
        return t

    state = ARRoL(head_cfg(weights), FakeModel(4), SimpleNamespace(world_size=world, all_reduce_sum=all_reduce_sum))
    losses = []
    for (h, y, cut), w in zip(toy_rounds(), toy_round_weights(weights)):
        mine = slice(0, cut) if rank == 0 else slice(cut, None)
        losses.append(state.train_head(h[mine], y[mine], None if w is None else w[mine]))
    torch.save({"head": state.head.state_dict(), "losses": losses}, Path(out) / f"rank{rank}.pt")


@pytest.mark.parametrize("weights", [None, PROBE_WEIGHTS], ids=["plain", "probe_importance_weighted"])
def test_two_ranks_take_the_one_process_head_step(tmp_path, weights):
    # plain: the mean BCE over both ranks' rows. Weighted (docs/distributed.md): with head_probe, Σ w·BCE and Σ w
    # take the place of the BCE sum and the row count in the head's all-reduce, so the two ranks' step is the
    # one-process step on the union of their rows
    from two_process import spawn_two

    spawn_two(_ddp_worker, str(tmp_path), weights)
    single = ARRoL(head_cfg(weights), FakeModel(4))
    losses = [single.train_head(h, y, w) for (h, y, _), w in zip(toy_rounds(), toy_round_weights(weights))]
    if weights is not None:
        plain = ARRoL(head_cfg(weights), FakeModel(4))
        for h, y, _ in toy_rounds():
            plain.train_head(h, y)
        # the weights matter: the unweighted step ends elsewhere
        unweighted = plain.head.state_dict()
        assert any(not torch.allclose(unweighted[k], v, atol=1e-4) for k, v in single.head.state_dict().items())
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        assert got["losses"] == pytest.approx(losses, rel=1e-5)  # (Σ w·)BCE / (Σ w or the row count), both ranks' rows
        for k, v in single.head.state_dict().items():
            assert torch.allclose(got["head"][k], v, atol=1e-6), k
