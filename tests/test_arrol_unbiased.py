"""ARRoL without the survivor bias (rollout.arrol.head_probe, trainer/arrol_probe.py) and the head's weighted vote at
test time (anabranch eval --arrol-vote, eval/arrol_vote.py): importance weights and the weighted BCE by hand, the
probe's rows (the middle of the head's ranking) in the head's training set while the policy's batch stays the same,
the weighted vote by hand, refusals, and both ends on the tiny model."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from anabranch.algorithms.arrol import head_loss_sum, probe_columns, probe_count
from anabranch.config import ConfigError, load_config
from anabranch.eval.passk import majority_correct
from anabranch.rollout.base import Rollout
from anabranch.trainer import arrol_rollouts
from anabranch.trainer.arrol_rollouts import ARRoL
from arrol_fixtures import EOS, PAD, FakeModel, ScriptedBackend, Tok, arrol_cfg, phase_one


# ----------------------------------------------------------------------------- importance weights, weighted BCE

def test_probe_columns_draw_pruned_columns_with_weight_m_over_k():
    keep = torch.tensor([[0, 3], [1, 2]])              # n = 2 of n' = 5: pruned {1, 2, 4} and {0, 3, 4}
    cols, w = probe_columns(keep, 5, 0.5, torch.Generator().manual_seed(0))
    assert probe_count(3, 0.5) == 2 and w == pytest.approx(3 / 2)   # k_p = ⌊1.5 + ½⌋ = 2; 1/(2/3)
    assert set(cols[0].tolist()) <= {1, 2, 4} and set(cols[1].tolist()) <= {0, 3, 4}
    assert cols.shape == (2, 2) and all(r == sorted(r) and len(set(r)) == 2 for r in cols.tolist())
    cols, w = probe_columns(keep, 5, 1.0, torch.Generator().manual_seed(0))
    assert cols.tolist() == [[1, 2, 4], [0, 3, 4]] and w == 1.0        # everything finishes: weight 1
    cols, w = probe_columns(keep, 5, 0.1, torch.Generator().manual_seed(0))
    assert cols.shape == (2, 0) and w == 0.0                            # ⌊0.3 + ½⌋ = 0: nothing probed
    # uniform: over 3000 seeded draws of k_p = 1 of 3, each pruned column about a third of the time
    hits = torch.zeros(5)
    for s in range(3000):
        c, w = probe_columns(keep[:1], 5, 0.34, torch.Generator().manual_seed(s))
        hits[c[0]] += 1
    assert w == 3.0 and hits[[0, 3]].sum() == 0
    assert torch.allclose(hits[[1, 2, 4]] / 3000, torch.full((3,), 1 / 3), atol=0.03)


def test_weighted_bce_by_hand_and_unbiased_over_every_draw():
    logits, y = torch.tensor([2.0, -1.0, 0.0]), torch.tensor([1.0, 0.0, 1.0])
    sp = lambda z: math.log1p(math.exp(z))  # noqa: E731  BCE(σ(z), 1) = softplus(−z), BCE(σ(z), 0) = softplus(z)
    assert float(head_loss_sum(logits, y, torch.tensor([1.0, 1.0, 3.0]))) == pytest.approx(
        sp(-2) + sp(-1) + 3 * sp(0), rel=1e-6)
    assert float(head_loss_sum(logits, y)) == pytest.approx(sp(-2) + sp(-1) + sp(0), rel=1e-6)
    # n' = 5 prefixes, survivors {0, 3}, k_p = 1 of the 3 pruned drawn uniformly with weight 3: the mean over the
    # three equally likely draws of Σ w·BCE / Σ w is the mean BCE over all five (Horvitz–Thompson)
    z, c = torch.tensor([1.5, -0.3, 0.7, -2.0, 0.2]), torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0])
    full = float(head_loss_sum(z, c)) / 5
    estimates = []
    for j in (1, 2, 4):
        rows, w = [0, 3, j], torch.tensor([1.0, 1.0, 3.0])
        assert float(w.sum()) == 5.0                                    # the weights sum to n' exactly
        estimates.append(float(head_loss_sum(z[rows], c[rows], w)) / float(w.sum()))
    assert sum(estimates) / 3 == pytest.approx(full, rel=1e-6)
    assert float(head_loss_sum(z[[0, 3]], c[[0, 3]])) / 2 != pytest.approx(full, rel=1e-2)  # the survivors alone: biased


def test_weighted_head_step_by_hand():
    state = ARRoL(arrol_cfg("rollout.arrol.head_lr=0.01"), FakeModel(1))
    with torch.no_grad():
        state.head.net.weight.fill_(1.0)
        state.head.net.bias.fill_(0.0)
    h, y, w = torch.tensor([[2.0], [-1.0]]), torch.tensor([1.0, 1.0]), torch.tensor([1.0, 3.0])
    loss = state.train_head(h, y, w)
    assert loss == pytest.approx((math.log1p(math.exp(-2)) + 3 * math.log1p(math.exp(1))) / 4, rel=1e-6)
    s2, s1 = 1 / (1 + math.exp(-2)), 1 / (1 + math.exp(1))
    assert state.head.net.weight.grad.item() == pytest.approx(((s2 - 1) * 2 + 3 * (s1 - 1) * -1) / 4, rel=1e-5)
    assert state.head.net.bias.grad.item() == pytest.approx(((s2 - 1) + 3 * (s1 - 1)) / 4, rel=1e-5)


# ----------------------------------------------------------------------------- the probe in the two-phase rollout

def open_row_3(prompts, n):
    """This file's phase 1: only row 2 ended (EOS); row 3, group 0's bottom survivor, is continued too."""
    return phase_one(prompts, n, ended=(2,))


H = torch.tensor([[3.0], [1.0], [0.0], [-3.0], [-2.0], [2.0], [0.5], [-0.5]])  # head w = 1: p = σ(h)


def pruning_state(monkeypatch, *extra):
    monkeypatch.setattr(arrol_rollouts, "prefix_features", lambda model, rollout, upto, layer, micro, tokens: H)
    state = ARRoL(arrol_cfg("rollout.arrol.warmup_steps=1", *extra), FakeModel(1))
    with torch.no_grad():
        state.head.net.weight.fill_(1.0)
        state.head.net.bias.fill_(0.0)
    state.updates = 1
    return state


def test_probe_trains_the_head_on_middle_ranked_prefixes_and_leaves_the_batch(monkeypatch):
    survivors = [[20, EOS, PAD], [21, 22, 23], [24, EOS, PAD]]
    off = pruning_state(monkeypatch)
    plain = off.generate(ScriptedBackend([survivors], first=open_row_3), Tok(), ["p", "q"], off.cfg)
    on = pruning_state(monkeypatch, "rollout.arrol.head_probe=0.5")
    backend = ScriptedBackend([survivors, [[30, EOS, PAD]]], first=open_row_3)
    out = on.generate(backend, Tok(), ["p", "q"], on.cfg)
    # the policy's batch: the same rows, token for token; the survivors' continuation is the first call, unseeded
    for f in ("response_ids", "response_mask", "truncated", "group_index", "prompt_ids"):
        assert torch.equal(getattr(out, f), getattr(plain, f)), f
    assert out.completions == plain.completions and backend.continued[0][2] is None
    # group 0 keeps rows 0 (top) and 3 (bottom), group 1 rows 5 and 4: the probe draws one of each group's middle
    probe = on.probe
    rows = [int(r) for r in torch.nonzero((H[None, :, 0] == probe.states[:, None, 0]).any(0)).flatten()]
    assert len(rows) == 2 and rows[0] in (1, 2) and rows[1] in (6, 7) and probe.weight == 2.0
    assert torch.equal(probe.predicted, torch.sigmoid(H[rows, 0]))
    seqs, budgets, seed = backend.continued[1]
    assert seed is not None and budgets == [3] * len(seqs)  # the probe's own seed, the survivors' budget
    opened = [r for r in rows if r != 2]  # row 2 had ended: nothing to continue
    assert probe.rollout.response_ids[:, :2].tolist() == open_row_3(["p", "q"], 4).response_ids[rows].tolist()
    assert on.metrics["arrol/probe_tokens"] == 2 * len(opened)  # "30, EOS" per open probed row
    seen = {}

    def spy(h, y, w=None):
        seen.update(h=h, y=y, w=w)
        return 0.0

    monkeypatch.setattr(on, "train_head", spy)
    metrics = on.observe([1.0, 0.0, 0.0, 1.0], [0.0, 1.0])
    assert torch.equal(seen["h"], H[[0, 3, 4, 5] + rows])  # survivors ⊕ the probed middle
    assert seen["y"].tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0] and seen["w"].tolist() == [1, 1, 1, 1, 2, 2]
    p = torch.sigmoid(H[rows, 0])
    assert metrics["arrol/probe_rows"] == 2.0
    hits = ((p >= 0.5).float() == torch.tensor([0.0, 1.0])).float()
    assert metrics["arrol/probe_acc"] == pytest.approx(float(hits.mean()))
    # every survivor is ranked right (p ≥ ½ exactly where y = 1); each probed row counts twice (weight 2)
    assert metrics["arrol/head_acc_all"] == pytest.approx((4 + 2 * float(hits.sum())) / 8)
    assert on.probe is None and on.pending is None
    # off: no probe key, no probe call, the unweighted step
    assert "arrol/probe_tokens" not in off.metrics and off.probe is None


def test_the_probe_draw_is_seeded_by_seed_update_and_rank(monkeypatch):
    def rows_of(updates, seed="1"):
        state = pruning_state(monkeypatch, "rollout.arrol.head_probe=0.5", f"trainer.seed={seed}")
        state.updates = updates
        state.generate(ScriptedBackend([[[20, EOS]], [[30, EOS]]], first=open_row_3), Tok(), ["p", "q"], state.cfg)
        return state.probe.predicted.tolist()

    assert rows_of(3) == rows_of(3)
    assert len({tuple(rows_of(u)) for u in range(1, 12)}) > 1  # another update, another draw


def test_real_backend_batch_and_rng_unchanged_by_the_probe(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from anabranch.rollout.hf_generate import HFGenerateBackend

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    results = {}
    for probe in ("0", "1.0"):
        cfg = load_config(None, ["rollout.arrol.enabled=true", "rollout.n=2", "rollout.max_new_tokens=8",
                                 "rollout.arrol.prune_at=2", "rollout.arrol.warmup_steps=1",
                                 f"rollout.arrol.head_probe={probe}"])
        state = ARRoL(cfg, model)
        state.updates = 1
        torch.manual_seed(0)
        out = state.generate(HFGenerateBackend(model, tok, cfg.rollout), tok, ["abc", "de"], cfg)
        results[probe] = (out, torch.get_rng_state(), state.probe)
    (a, rng_a, none), (b, rng_b, probe) = results["0"], results["1.0"]
    assert none is None and probe is not None and probe.rollout.response_ids.shape[0] == 4  # all 2·(4 − 2) pruned
    for f in ("response_ids", "response_mask", "truncated", "prompt_ids"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert torch.equal(rng_a, rng_b)  # the probe sampled in forked generators
    # its cost: the probed rows' tokens past the 2-token prefix (the random tiny model does not stop at once)
    assert probe.tokens == float(probe.rollout.response_mask[:, 2:].sum()) > 0


def test_probe_correct_judges_each_probed_row_against_its_own_groups_answer():
    from anabranch.rewards import build_rewards
    from anabranch.trainer.arrol_probe import Probe, probe_correct

    cfg = arrol_cfg("reward.isolation=none")
    c = SimpleNamespace(rewards=build_rewards(cfg.reward), model=None, tokenizer=None, arrol=SimpleNamespace(cfg=cfg))
    # the round's scored batch: group 0's survivors are about "7", group 1's about "3"
    seven, three = {"prompt": "p", "answer": "7"}, {"prompt": "q", "answer": "3"}
    batch = SimpleNamespace(rollout=SimpleNamespace(group_index=torch.tensor([0, 0, 1, 1])),
                            rows=[seven, seven, three, three])
    # probed rows out of group order: (group, answer) = (1, 3), (0, 7), (1, 7), (0, 3)
    said = ["3", "7", "7", "3"]
    k = len(said)
    rollout = Rollout(prompt_ids=torch.ones(k, 1, dtype=torch.long), prompt_mask=torch.ones(k, 1, dtype=torch.long),
                      response_ids=torch.ones(k, 2, dtype=torch.long), response_mask=torch.ones(k, 2, dtype=torch.long),
                      group_index=torch.tensor([1, 0, 1, 0]), prompts=["p", "q"],
                      completions=[f"so the answer is \\boxed{{{a}}}" for a in said],
                      truncated=torch.zeros(k, dtype=torch.bool))
    probe = Probe(rollout, torch.zeros(k, 1), torch.zeros(k), 2.0, 0.0)
    # right exactly where the answer is its own group's (mapped by group, not by position in the batch)
    assert probe_correct(c, probe, batch) == [1.0, 1.0, 0.0, 0.0]


# ----------------------------------------------------------------------------- the weighted vote

def test_weighted_vote_by_hand():
    answers, correct = ["1", "2", "2", None], [True, False, False, False]
    assert majority_correct(answers, correct, [0.9, 0.2, 0.3, 0.99]) == 1.0  # "1": 0.9 > "2": 0.5
    assert majority_correct(answers, correct, [0.4, 0.2, 0.3, 0.99]) == 0.0  # "2": 0.5 > 0.4
    assert majority_correct(answers, correct, [0.5, 0.25, 0.25, 0.0]) == 0.5  # a tie: the mean
    assert majority_correct([None, None], [True, True], [1.0, 1.0]) == 0.0
    from anabranch.eval.arrol_vote import vote_entry

    assert majority_correct(answers, correct, [1, 1, 1, 1]) == majority_correct(answers, correct) == 0.0
    e = vote_entry([answers, ["7", "7"]], [correct, [True, True]], [[0.9, 0.2, 0.3, 0.99], [0.1, 0.2]], 4)
    assert e["majority"] == 0.5 and e["weighted"] == 1.0 and e["prune_at"] == 4
    # the plain vote is the entry's maj@n when it has one (not computed again)
    assert vote_entry([answers], [correct], [[0.9, 0.2, 0.3, 0.99]], 4, majority=0.25)["majority"] == 0.25
    assert e["mean_weight"] == pytest.approx((0.9 + 0.2 + 0.3 + 0.99 + 0.1 + 0.2) / 6)


# ----------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("overrides,match", [
    (["rollout.arrol.head_probe=0.5"], r"rollout\.arrol\.head_probe"),  # while ARRoL is off
    (["rollout.arrol.enabled=true", "rollout.arrol.head_probe=-0.1"], r"head_probe must be in \[0, 1\]"),
    (["rollout.arrol.enabled=true", "rollout.arrol.head_probe=1.5"], r"head_probe must be in \[0, 1\]"),
    # n = 8, n' = 16: ⌊0.05·8 + ½⌋ = 0 of the 8 pruned
    (["rollout.arrol.enabled=true", "rollout.arrol.head_probe=0.05"], r"head_probe=0\.05 probes .* = 0"),
    (["rollout.arrol.enabled=true", "rollout.arrol.head_probe=0.5", "reward.functions=[format]"],
     r"head_probe judges .* correctness reward"),
])
def test_bad_probe_values_are_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_arrol_vote_refuses_models_without_a_head(tmp_path):
    from anabranch.eval.runner import EvalSettings, run_eval

    with pytest.raises(ConfigError, match="checkpoint folder"):
        run_eval(["packaged:smollm2-135m-instruct"], None, [], EvalSettings(n=2, arrol_vote=True), tmp_path / "o")
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- both ends on the tiny model

def test_probe_run_then_weighted_vote_eval(tiny_model_dir, write_jsonl, tmp_path, monkeypatch):
    from anabranch import train
    from anabranch.eval import arrol_vote
    from anabranch.eval.runner import EvalSettings, run_eval
    from anabranch.trainer import arrol_probe, loop

    data = write_jsonl([{"prompt": f"Q{i}: say seven", "answer": "7"} for i in range(8)])
    base = {
        "model.path": tiny_model_dir, "task.name": "file", "task.path": data, "task.eval_size": 0,
        "rollout.n": 2, "rollout.prompts_per_step": 2, "rollout.max_new_tokens": 6,
        "rollout.arrol.enabled": "true", "rollout.arrol.prune_at": 2, "rollout.arrol.warmup_steps": 1,
        "trainer.steps": 2, "trainer.output_dir": str(tmp_path), "trainer.progress": False, "trainer.device": "cpu",
        "trainer.eval_before": False, "trainer.eval_after": False, "trainer.save_final": False,
        "reward.isolation": "none",  # inline: a forked scorer per call is most of this test's time
        "rollout.arrol.head_probe": 1.0, "trainer.save_every": 2, "trainer.run_name": "probe_on",
    }
    # One run with the probe (that the probe leaves the policy's batch as it was is
    # test_real_backend_batch_and_rng_unchanged_by_the_probe's, on the same model; a probe-off run here would repeat it)
    trained, probes, real_update, real_draw = [], [], loop.policy_update, arrol_probe.draw_probe

    def spy_update(model, optimizer, rollout, *args, **kwargs):
        trained.append(rollout)
        return real_update(model, optimizer, rollout, *args, **kwargs)

    def spy_draw(*args, **kwargs):
        probes.append(real_draw(*args, **kwargs))
        return probes[-1]

    monkeypatch.setattr(loop, "policy_update", spy_update)
    monkeypatch.setattr(arrol_probe, "draw_probe", spy_draw)
    cfg = load_config(None, [f"{k}={v}" for k, v in base.items()])
    run = Path(train(cfg).run_dir)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r.get("arrol/probe_rows") for r in steps] == [None, 4.0]  # 2 prompts × (4 − 2) pruned, all probed
    # step 2's probe cost: the probed rows' tokens past the 2-token prefix (a random tiny model rarely stops at 6)
    assert len(probes) == 1 and probes[0].rollout.response_ids.shape[0] == 4
    cont = float(probes[0].rollout.response_mask[:, 2:].sum())
    assert steps[0]["arrol/probe_tokens"] == 0.0 and steps[1]["arrol/probe_tokens"] == cont > 0
    # head_probe = 1: every pruned prefix finishes with weight m/k_p = 1, so the importance-weighted accuracy is the
    # plain mean over the 4 survivors and the 4 probed rows
    s2 = steps[1]
    assert s2["arrol/head_acc_all"] == pytest.approx((4 * s2["arrol/head_acc"] + 4 * s2["arrol/probe_acc"]) / 8)
    # the probed rows are never trained: the update sees n = 2 survivors per prompt
    assert len(trained) == 2 and all(t.group_index.tolist() == [0, 0, 1, 1] for t in trained)
    # the eval: the head from the step-2 checkpoint (trained on survivors and probe) weighs each sample's vote
    ckpt = run / "checkpoints" / "step-000002"
    seen = {}
    real_entry = arrol_vote.vote_entry

    def spy_entry(answers, correct, weights, prune_at, majority=None):
        seen.update(weights=weights, prune_at=prune_at, majority=majority)
        return real_entry(answers, correct, weights, prune_at, majority)

    monkeypatch.setattr(arrol_vote, "vote_entry", spy_entry)
    settings = EvalSettings(n=2, greedy=False, embeddings=False, effective_rank=False, sparse_tokens=0,
                            arrol_vote=True)
    result = run_eval([str(ckpt)], None, ["task.eval_size=2", "reward.isolation=none"], settings, tmp_path / "eval")
    vote = result["models"][0]["arrol_vote"]
    assert seen["prune_at"] == 2 and len(seen["weights"]) == 2 and all(len(w) == 2 for w in seen["weights"])
    assert all(0.0 < w < 1.0 for ws in seen["weights"] for w in ws)
    # the plain vote is the entry's maj@n, handed over (default --k includes n), not recomputed
    assert vote["majority"] == seen["majority"] == result["models"][0]["maj@k"]["2"]
    saved = torch.load(ckpt / "trainer_state.pt", weights_only=False)["stateful"]["arrol"]["head"]
    head = arrol_vote.load_head(SimpleNamespace(path=str(ckpt / "model"), config_file=run / "config.yaml"),
                                None, torch.device("cpu"))
    assert all(torch.equal(head.head.state_dict()[k], v) for k, v in saved.items()) and head.prune_at == 2
