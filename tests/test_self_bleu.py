"""Self-BLEU (Zhu et al. 2018) in `anabranch eval`: the numbers, the report, and the diversity plot's axes."""

import json
import math
import random

import pytest

from anabranch.eval import plots
from anabranch.eval.diversity import mean_self_bleu, self_bleu


def test_identical_generations_score_one_and_disjoint_ones_zero():
    assert self_bleu(["the answer is 42 so"] * 4) == pytest.approx(1.0)
    # No token shared between any two completions: every precision has no match.
    assert self_bleu(["a b c d e", "f g h i j", "k l m n o"]) == pytest.approx(0.0, abs=1e-9)


def test_hand_computed_three_completions():
    # BLEU of each against the other two, smoothing 0.1/total for an order with no match, the
    # orders a 3-word text has (1..3), equal lengths so BP = 1:
    #   "the cat sat" vs {the cat ran, a dog sat}: p = 3/3, 1/2, 0.1/1 -> (0.05)^(1/3)
    #   "the cat ran" vs {the cat sat, a dog sat}: p = 2/3, 1/2, 0.1/1 -> (1/30)^(1/3)
    #   "a dog sat"   vs {the cat sat, the cat ran}: p = 1/3, 0.1/2, 0.1/1 -> (1/600)^(1/3)
    expected = (0.05 ** (1 / 3) + (1 / 30) ** (1 / 3) + (1 / 600) ** (1 / 3)) / 3
    assert self_bleu(["the cat sat", "the cat ran", "a dog sat"]) == pytest.approx(expected, rel=1e-9)


def test_brevity_penalty_and_duplicates_as_references():
    # "a b" against {"a b c d", "a b c d"}: p1 = p2 = 1, BP = exp(1 - 4/2);
    # each "a b c d" against {the other "a b c d", "a b"}: identical reference -> 1.
    expected = (2 * 1.0 + math.exp(1 - 4 / 2)) / 3
    assert self_bleu(["a b c d", "a b c d", "a b"]) == pytest.approx(expected, rel=1e-9)


def test_agrees_with_sacrebleu_sentence_score_leave_one_out():
    from sacrebleu.metrics.bleu import BLEU

    bleu = BLEU(tokenize="none", smooth_method="floor", smooth_value=0.1, effective_order=True)
    rng = random.Random(3)
    words = "x y z w v u".split()
    for _ in range(20):
        group = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 9))) for _ in range(rng.randint(2, 6))]
        slow = [bleu.sentence_score(h, group[:i] + group[i + 1:]).score / 100 for i, h in enumerate(group)]
        assert self_bleu(group) == pytest.approx(min(1.0, sum(slow) / len(slow)), abs=1e-9), group


def test_lower_when_more_diverse_and_problems_with_one_sample_skipped():
    alike = ["we add 3 and 4 to get 7", "we add 3 and 4 to get 7", "we add 4 and 3 to get 7"]
    varied = ["we add 3 and 4 to get 7", "seven is four plus three", "count up from 3: 4 5 6 7"]
    assert self_bleu(varied) < self_bleu(alike)
    assert self_bleu(["only one"]) is None and self_bleu([]) is None
    assert mean_self_bleu([alike, ["only one"]]) == pytest.approx(self_bleu(alike))
    assert mean_self_bleu([["x"], []]) is None


def test_cap_scores_a_fixed_seeded_subset():
    rng = random.Random(0)
    group = [" ".join(rng.choice("abcdefgh") for _ in range(6)) for _ in range(12)]
    full = self_bleu(group)
    capped = self_bleu(group, max_hypotheses=5, seed=1)
    assert capped == self_bleu(group, max_hypotheses=5, seed=1)  # same seed, same subset
    assert capped != pytest.approx(full)  # a subset, not all 12
    assert self_bleu(group, max_hypotheses=12) == full
    with pytest.raises(ValueError, match="max_hypotheses"):
        self_bleu(group, max_hypotheses=0)


def test_eval_reports_self_bleu_in_json(tiny_model_dir, write_jsonl, tmp_path):
    from anabranch.eval.runner import EvalSettings, run_eval

    from test_eval_e2e import eval_overrides
    from test_train_e2e import digit_task

    settings = EvalSettings(n=3, ks=[1, 3], greedy=False, embeddings=False, effective_rank=False)
    out = run_eval([tiny_model_dir], None, eval_overrides(tiny_model_dir, digit_task(write_jsonl)),
                   settings, tmp_path / "ev")
    saved = json.loads((tmp_path / "ev" / "passk.json").read_text())["models"][0]
    div = saved["diversity"]
    texts = [[s["completion"] for s in p["samples"]] for p in saved["problems"]]
    assert isinstance(div["self_bleu"], float) and 0 <= div["self_bleu"] <= 1
    assert div["self_bleu"] == pytest.approx(mean_self_bleu(texts))
    assert "lower = more diverse" in div["self_bleu_note"]
    assert list(div).index("self_bleu") == list(div).index("distinct_2") + 1  # next to distinct-n
    assert out["models"][0]["diversity"]["self_bleu"] == div["self_bleu"]


def test_report_table_shows_self_bleu_with_its_direction(tmp_path):
    from anabranch.eval.report import write_report

    from test_eval_report import fake_run

    runs = []
    for name, sb in (("grpo", 0.625), ("flowrl", 0.375)):
        run = fake_run(tmp_path, name, 0.3, 1.2)
        data = json.loads((run / "eval_passk.json").read_text())
        data["models"][0]["diversity"]["self_bleu"] = sb
        (run / "eval_passk.json").write_text(json.dumps(data))
        runs.append(run)
    page = write_report(runs, tmp_path / "report.html").read_text()
    assert "<th>Self-BLEU ↓</th>" in page and "<th>distinct-2 ↑</th>" in page
    assert "<td>grpo</td><td>2.500</td><td>–</td><td>0.400</td><td>0.600</td><td>0.625</td>" in page
    assert "<td>flowrl</td><td>2.500</td><td>–</td><td>0.400</td><td>0.600</td><td>0.375</td>" in page


def test_plot_puts_count_and_fractions_on_different_axes(tmp_path, monkeypatch):
    figs = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: (figs.append(fig), save(fig, path))[1])
    groups = {"base": {"distinct_answers": 12.0, "distinct_2": 0.55, "self_bleu": 0.62},
              "rl": {"distinct_answers": 3.0, "distinct_2": 0.35, "self_bleu": 0.81}}
    plots.plot_bars(groups, tmp_path / "diversity.png", "diversity")
    axes = {ax.get_title(): ax for ax in figs[-1].axes if ax.patches}
    assert set(axes) == {"distinct_answers", "distinct_2", "self_bleu"}
    assert len({id(ax) for ax in axes.values()}) == 3
    # Each fraction's axis is scaled to the fractions (not to the count 12), and says its direction.
    for name in ("distinct_2", "self_bleu"):
        assert axes[name].get_ylim()[1] <= 1.0
        assert [p.get_height() for p in axes[name].patches] == pytest.approx([groups["base"][name], groups["rl"][name]])
    assert axes["distinct_answers"].get_ylim()[1] >= 12.0
    assert "lower = more diverse" in axes["self_bleu"].get_ylabel()
