"""Sparse selection (Akgül et al. 2026): changed top tokens and the base rank of the trained choice."""

import json
import math

import pytest
import torch

from anabranch.eval import sparse_selection as ss
from anabranch.eval.runner import EvalSettings, run_eval

from test_eval_e2e import eval_overrides
from test_train_e2e import digit_task


def hand_logits():
    """4 positions, vocabulary 12. Base / trained argmax and the base rank of the trained argmax:
    0: 0 / 0 (same, rank 1); 1: 0 / 2 (rank 3); 2: 11 / 0 (rank 12); 3: tie 0,1 → 0 / 1 (rank 1)."""
    v = 12
    base = torch.zeros(4, v)
    trained = torch.zeros(4, v)
    base[0, 0], trained[0, 0] = 5.0, 3.0
    base[1, :6] = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.5])
    trained[1, 2] = 4.0
    base[2] = torch.arange(v, dtype=torch.float)
    trained[2, 0] = 9.0
    base[3, :2] = 2.0
    trained[3, 1] = 1.0
    return trained, base


def test_position_stats_match_hand_computed_changes_and_ranks():
    trained, base = hand_logits()
    st = ss.position_stats(trained, base)
    assert st["changed"].tolist() == [False, True, True, True]
    assert st["rank"].tolist() == [1, 3, 12, 1]


def test_kl_and_base_entropy_by_hand_and_masked_logits_stay_finite():
    # π_T = (1/2, 1/2), π_B = (3/4, 1/4).
    st = ss.position_stats(torch.tensor([[0.0, 0.0]]), torch.tensor([[math.log(3.0), 0.0]]))
    assert st["kl"].item() == pytest.approx(0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25), abs=1e-6)
    assert st["base_entropy"].item() == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)), abs=1e-6)
    # A token both models mask out (−inf) adds 0, not NaN.
    st = ss.position_stats(torch.tensor([[0.0, 0.0, -math.inf]]), torch.tensor([[math.log(3.0), 0.0, -math.inf]]))
    assert st["kl"].item() == pytest.approx(0.5 * math.log(4 / 3), abs=1e-6)
    assert math.isfinite(st["base_entropy"].item())


def test_summary_fractions_by_hand():
    trained, base = hand_logits()
    s = ss.summarize(ss.position_stats(trained, base), sequences=1)
    assert (s["positions"], s["changed_positions"], s["changed_fraction"]) == (4, 3, 0.75)
    # Changed ranks 3, 12, 1.
    assert s["changed_in_base_top_k"] == pytest.approx({"1": 1 / 3, "2": 1 / 3, "3": 2 / 3, "4": 2 / 3,
                                                         "5": 2 / 3, "10": 2 / 3})
    assert s["changed_beyond_base_top_10"] == pytest.approx(1 / 3)
    assert s["changed_base_rank_median"] == 3.0
    none = ss.summarize(ss.position_stats(base, base), sequences=1)
    assert none["changed_positions"] == 0 and none["changed_in_base_top_k"]["5"] is None
    assert none["kl_trained_base_mean"] == pytest.approx(0.0, abs=1e-6)


def seq(problem, sample, n, counted=None):
    counted = torch.tensor(counted) if counted is not None else torch.ones(n, dtype=torch.long)
    return ss.Sequence(problem, sample, torch.tensor([1, 2]), torch.arange(3, 3 + n), torch.ones(n, dtype=torch.long),
                       counted)


def test_pick_spreads_the_cap_over_problems_and_cuts_the_last_sequence():
    seqs = [seq(0, 0, 3), seq(0, 1, 3, [1, 0, 1]), seq(1, 0, 3)]
    kept, capped = ss.pick(seqs, 7)
    assert capped and [(s.problem, s.sample) for s in kept] == [(0, 0), (1, 0), (0, 1)]
    # One counted position left for (0, 1): its first token only.
    assert kept[2].response.tolist() == [3] and int(sum(int(s.counted.sum()) for s in kept)) == 7
    kept, capped = ss.pick(seqs, 8)  # room for both counted tokens of (0, 1): cut after the second (position 3)
    assert capped is False and kept[2].response.tolist() == [3, 4, 5]
    kept, capped = ss.pick(seqs, 100)
    assert capped is False and [k is s for k, s in zip(kept, [seqs[0], seqs[2], seqs[1]])] == [True] * 3


def perturbed(model_dir, out):
    """The tiny model with its last MLP output scaled up 30x. (Random tiny models, even with other
    seeds, agree on every argmax: with tied embeddings the residual keeps the input token on top.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        model.model.layers[-1].mlp.down_proj.weight.mul_(30)
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="module")
def two_models(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    other = perturbed(tiny_model_dir, tmp_path_factory.mktemp("ss") / "b")
    return (AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(),
            AutoModelForCausalLM.from_pretrained(other).eval())


def random_sequences():
    g = torch.Generator().manual_seed(0)
    out = []
    for i, (p, r) in enumerate([(3, 5), (6, 2), (4, 7)]):
        counted = torch.ones(r, dtype=torch.long)
        if i == 2:
            counted[2:4] = 0  # a tool output: context, not counted
        out.append(ss.Sequence(i, 0, torch.randint(5, 40, (p,), generator=g), torch.randint(5, 40, (r,), generator=g),
                               torch.ones(r, dtype=torch.long), counted))
    return out


@torch.no_grad()
def reference_stats(trained, base, seqs):
    """Each sequence alone, unpadded, full logits: position P+t−1 predicts response token t."""
    parts = []
    for s in seqs:
        ids = torch.cat([s.prompt, s.response])[None]
        p = len(s.prompt)
        keep = s.counted.bool()
        lt = trained(input_ids=ids).logits[0, p - 1:-1][keep]
        lb = base(input_ids=ids).logits[0, p - 1:-1][keep]
        parts.append(ss.position_stats(lt, lb))
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


@pytest.mark.parametrize("chunked_head", [True, False])
def test_measure_matches_unbatched_reference(two_models, monkeypatch, chunked_head):
    a, b = two_models
    if not chunked_head:
        monkeypatch.setattr(ss, "supports_chunked_head", lambda model: False)
    seqs = random_sequences()
    got = ss.measure(a, b, seqs, chunk=2, rows=3)
    want = reference_stats(a, b, seqs)
    assert got["changed"].numel() == 5 + 2 + 5
    assert got["changed"].tolist() == want["changed"].tolist() and got["changed"].any()
    assert got["rank"].tolist() == want["rank"].tolist()
    torch.testing.assert_close(got["kl"], want["kl"], atol=1e-4, rtol=1e-4)
    same = ss.measure(a, a, seqs)
    assert not same["changed"].any() and same["kl"].abs().max() < 1e-5


def test_negative_cap_is_rejected_naming_the_option(capsys):
    from anabranch.cli import main

    assert main(["eval", "some/model", "--sparse-tokens", "-1"]) == 2
    assert "--sparse-tokens must be >= 0" in capsys.readouterr().err


def test_eval_writes_sparse_selection_for_each_later_model(tiny_model_dir, write_jsonl, tmp_path, capsys):
    other = perturbed(tiny_model_dir, tmp_path / "other" / "model")
    settings = EvalSettings(n=2, greedy=False, embeddings=False, effective_rank=False, sparse_tokens=5)
    overrides = eval_overrides(tiny_model_dir, digit_task(write_jsonl))
    run_eval([tiny_model_dir, other, tiny_model_dir], None, overrides, settings, tmp_path / "ev")
    saved = json.loads((tmp_path / "ev" / "passk.json").read_text())
    base, diff, same = saved["models"]
    assert "sparse_selection" not in base
    d, s = diff["sparse_selection"], same["sparse_selection"]
    assert d["base"] == base["label"] and d["positions"] == 5 and d["capped"] is True and d["max_tokens"] == 5
    assert d["changed_positions"] > 0 and d["kl_trained_base_mean"] > 0
    assert s["changed_positions"] == 0 and s["kl_trained_base_mean"] == pytest.approx(0.0, abs=1e-5)
    line = "sparse selection of model#3 vs model#1: top token changed at 0.00% of 5 positions"
    assert line in capsys.readouterr().out


def test_eval_with_zero_cap_skips_the_analysis(tiny_model_dir, write_jsonl, tmp_path):
    settings = EvalSettings(n=1, greedy=False, embeddings=False, effective_rank=False, sparse_tokens=0)
    out = run_eval([tiny_model_dir, tiny_model_dir], None, eval_overrides(tiny_model_dir, digit_task(write_jsonl)),
                   settings, tmp_path / "ev")
    assert all("sparse_selection" not in m for m in out["models"])


def test_report_shows_the_sparse_selection_table(tmp_path):
    from test_eval_report import fake_run

    from anabranch.eval.report import read_run, sparse_selection_table, write_report

    base = fake_run(tmp_path, "base", 1.0, 2.0)
    run = fake_run(tmp_path, "grpo", 1.0, 2.0)
    saved = json.loads((run / "eval_passk.json").read_text())
    trained, basel = hand_logits()
    saved["models"][0]["sparse_selection"] = {"base": "base", **ss.summarize(ss.position_stats(trained, basel), 1)}
    (run / "eval_passk.json").write_text(json.dumps(saved))
    page = write_report([base, run], tmp_path / "r.html").read_text()
    assert "<h2>Sparse selection</h2>" in page
    assert "<tr><td>grpo</td><td>base</td><td>4</td><td>0.750</td><td>0.333</td>" in page
    saved["models"][0]["sparse_selection"] = {"base": "base", "error": "the tokenizers differ"}
    (run / "eval_passk.json").write_text(json.dumps(saved))
    assert "the tokenizers differ</td>" in sparse_selection_table([read_run(base), read_run(run)])
    assert sparse_selection_table([read_run(base)]) == ""


def test_out_of_memory_with_the_base_keeps_the_entry(tiny_model_dir, write_jsonl, tmp_path, monkeypatch):
    import anabranch.eval.sparse_selection as sparse

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(sparse, "against_base", oom)
    settings = EvalSettings(n=2, greedy=False, embeddings=False, effective_rank=False, sparse_tokens=5)
    run_eval([tiny_model_dir, tiny_model_dir], None, eval_overrides(tiny_model_dir, digit_task(write_jsonl)),
             settings, tmp_path / "ev")
    second = json.loads((tmp_path / "ev" / "passk.json").read_text())["models"][1]
    assert "pass@k" in second and "out of memory" in second["sparse_selection"]["error"]
