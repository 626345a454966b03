"""Evaluation metrics and reports against hand-computed values: the collapse margin at its exact
boundary, maj@k with ties and unparseable answers, and report tables that must equal the runs'
own files, including runs that stopped midway."""

import json
import re
from fractions import Fraction

import pytest

from anabranch import cli
from anabranch.eval.collapse import collapse_report, model_collapse_step
from anabranch.eval.passk import maj_at_k, pass_at_k, sample_metrics
from anabranch.eval.report import write_report


# ----------------------------------------------------------------------------- Model Collapse Step

def test_collapse_counts_a_fall_of_exactly_the_margin():
    # 0.3 -> 0.2 falls by exactly the default margin 0.1; in floats 0.3 - 0.1 = 0.19999999999999998.
    out = model_collapse_step([0, 10], [0.3, 0.2], margin=0.1)
    assert (out["collapse_step"], out["fell_at_step"], out["peak_accuracy"]) == (0, 10, 0.3)


@pytest.mark.parametrize("problems", [50, 64])
@pytest.mark.parametrize("margin", [0.05, 0.1, 0.2])
def test_collapse_agrees_with_exact_arithmetic_on_real_accuracies(problems, margin):
    # Held-out accuracy is always count / problems: compare every (peak, later) pair with the
    # rule computed in exact fractions.
    exact_margin = Fraction(str(margin))
    for best in range(problems + 1):
        for later in range(best):
            fell = Fraction(best - later, problems) >= exact_margin
            out = model_collapse_step([0, 1], [best / problems, later / problems], margin)
            assert (out["collapse_step"] == 0) == fell, (best, later, problems, margin)


def test_collapse_report_reads_a_real_metrics_file(tmp_path):
    rows = [{"step": 0, "eval/accuracy": 0.25}, {"step": 1, "reward/mean": 0.5},
            {"step": 2, "eval/accuracy": 0.3}, {"step": 3, "eval/accuracy": "nan"},  # NaN is written as a string
            {"step": 4, "eval/accuracy": 0.2}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = collapse_report(path, 0.1)
    assert (out["collapse_step"], out["fell_at_step"], out["metric"]) == (2, 4, "eval/accuracy")
    path.write_text(json.dumps(rows[0]) + "\n")
    assert collapse_report(path, 0.1) is None  # one evaluation: nothing to say


# ----------------------------------------------------------------------------- pass@k and maj@k

def test_maj_at_k_hand_values_with_ties_and_unparseable_answers():
    answers = ["7", None, "3", "7"]
    correct = [True, True, False, True]  # the verifier accepted the sample with no extractable answer
    # Pairs: (7,None) 1, (7,3) tie 0.5, (7,7) 1, (None,3) 0, (None,7) 1, (3,7) 0.5 -> 4/6.
    assert maj_at_k(answers, correct, 2) == pytest.approx(4 / 6)
    # k = 1: a sample with no answer does not vote, so it scores 0 though it is correct.
    assert maj_at_k(answers, correct, 1) == pytest.approx(2 / 4)
    assert maj_at_k(answers, correct, 4) == 1.0  # "7" wins 2 to 1
    assert maj_at_k([None] * 3, [True] * 3, 2) == 0.0  # nobody votes
    with pytest.raises(ValueError):
        maj_at_k(answers, correct, 5)


def test_sample_metrics_edge_problems():
    # c = 0, c = n and c = 1 of n = 3; k = n; pass@1 = mean@n = c/n.
    correct = [[False] * 3, [True] * 3, [False, True, False]]
    answers = [["1", "2", None], ["5", "5", "5"], ["1", "4", "1"]]
    m = sample_metrics(correct, answers, [1, 3])
    assert m["pass@k"]["1"] == pytest.approx((0 + 1 + 1 / 3) / 3) == m["mean@n"]
    assert m["pass@k"]["3"] == pytest.approx((0 + 1 + 1) / 3)
    assert m["maj@k"]["3"] == pytest.approx((0 + 1 + 0) / 3)  # "1" outvotes the right "4"
    assert pass_at_k(3, 1, 3) == 1.0 and pass_at_k(3, 0, 3) == 0.0
    with pytest.raises(ValueError, match="outside 1..n"):
        sample_metrics(correct, answers, [4])


# ----------------------------------------------------------------------------- reports

def write_run(root, name, rewards, *, evals=(), summary=None, eval_entry=None, tail=""):
    """A run directory as the trainer writes it: eval rows at step 0 / later steps, one row per step."""
    run = root / name
    run.mkdir(parents=True)
    rows = []
    for step, acc in evals:
        if step == 0:
            rows.append({"step": 0, "eval/accuracy": acc})
    for s, r in enumerate(rewards, 1):
        rows.append({"step": s, "reward/mean": r, "entropy": 1.0 - 0.05 * s})
        rows.extend({"step": s, "eval/accuracy": acc} for step, acc in evals if step == s)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    (run / "config.yaml").write_text(f"algorithm:\n  name: {name}\n")
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    if eval_entry is not None:
        (run / "eval_passk.json").write_text(json.dumps({"n": eval_entry["n"], "models": [eval_entry]}))
    return run


HEAD = ["run", "algorithm", "steps", "accuracy before", "accuracy after", "final reward", "collapse step",
        "a", "b", "R²", "greedy", "pass@1", "pass@max", "pass@k from"]


def table(page):
    """The summary table's rows by run (the diversity and support tables below it have rows per run too)."""
    summary = page[page.index("<h2>Summary</h2>"):]
    summary = summary[:summary.index("</table>")]
    rows = {}
    for tr in re.findall(r"<tr><td>(.*?)</td></tr>", summary):
        cells = tr.split("</td><td>")
        rows[cells[0]] = dict(zip(HEAD, cells))
    return rows


def test_report_table_equals_the_run_files(tmp_path):
    long = write_run(tmp_path, "grpo", [0.1, 0.25, 0.4, 0.55, 0.6, 0.62], evals=[(0, 0.375), (3, 0.5), (6, 0.4375)],
                     summary={"accuracy_before": 0.375, "accuracy_after": 0.4375, "steps": 6,
                              "model_collapse": {"collapse_step": 3}},
                     eval_entry={"label": "grpo", "n": 8, "num_problems": 16, "mean@n": 0.3125,
                                 "pass@k": {"2": 0.5, "8": 0.8125}, "greedy_accuracy": 0.4375, "diversity": {}})
    short = write_run(tmp_path, "dapo", [0.2, 0.3, 0.35], evals=[(0, 0.375)],
                      summary={"accuracy_before": 0.375, "accuracy_after": 0.5, "steps": 3, "model_collapse": None})
    rows = table(write_report([long, short], tmp_path / "r.html").read_text())
    g, d = rows["grpo"], rows["dapo"]
    assert (g["steps"], g["accuracy before"], g["accuracy after"], g["final reward"], g["collapse step"]) == \
        ("6", "0.375", "0.438", "0.620", "3")
    # --k 2,8 left k = 1 out: pass@1 is still known, it is mean@n = c/n.
    assert (g["greedy"], g["pass@1"], g["pass@max"], g["pass@k from"]) == \
        ("0.438", "0.312", "0.812", "n=8, 16 problems")
    assert (d["steps"], d["accuracy after"], d["final reward"], d["collapse step"], d["pass@1"]) == \
        ("3", "0.500", "0.350", "–", "–")


def test_report_of_a_run_killed_while_writing_its_metrics(tmp_path, capsys):
    # No summary.json (written at the end) and a last row cut short by the kill.
    done = write_run(tmp_path, "grpo", [0.1, 0.2, 0.3, 0.4], evals=[(0, 0.25)],
                     summary={"accuracy_before": 0.25, "accuracy_after": 0.5, "steps": 4})
    killed = write_run(tmp_path, "flowrl", [0.1, 0.3, 0.45], evals=[(0, 0.25)], tail='{"step": 4, "reward/me')
    out = write_report([done, killed], tmp_path / "r.html")
    assert "ends in a partial line" in capsys.readouterr().out
    page = out.read_text()
    row = table(page)["flowrl"]
    # The steps it got through, the accuracy it measured before training, its last complete reward.
    assert (row["steps"], row["accuracy before"], row["accuracy after"], row["final reward"]) == \
        ("3 (unfinished)", "0.250", "–", "0.450")
    assert page.count("data:image/png;base64,") == 6
    # A damaged line in the middle is not a crash artefact: still an error that names the line.
    (killed / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "rew\n{"step": 3}\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        write_report([killed], tmp_path / "r2.html")


def test_report_out_naming_a_folder_is_a_one_line_error(tmp_path, capsys):
    run = write_run(tmp_path, "grpo", [0.1, 0.2, 0.3], summary={"steps": 3})
    assert cli.main(["report", str(run), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("anabranch report: error: ") and "is a folder" in err and err.count("\n") == 1


def test_compare_says_why_a_run_without_a_final_model_is_not_evaluated(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    from anabranch.eval import compare, report, runner
    from anabranch.eval.runner import EvalSettings
    from anabranch.trainer import loop

    evaluated = []
    monkeypatch.setattr(loop, "train", lambda cfg: SimpleNamespace(run_dir=tmp_path / cfg.trainer.run_name,
                                                                   final_model_dir=None))
    monkeypatch.setattr(runner, "run_eval", lambda *a, **k: evaluated.append(a))
    monkeypatch.setattr(report, "write_report", lambda runs, out, title: out)
    compare.run_compare(["grpo"], None, [f"trainer.output_dir={tmp_path}", "trainer.run_name=cmp",
                                         "trainer.save_final=false"], EvalSettings(n=2))
    assert evaluated == []
    assert "grpo: no final model (trainer.save_final=false), so no pass@k evaluation" in capsys.readouterr().out


def test_report_names_a_damaged_summary_file(tmp_path):
    run = write_run(tmp_path, "grpo", [0.1, 0.2, 0.3])
    (run / "summary.json").write_text('{"accuracy_before": 0.2, "acc')
    with pytest.raises(ValueError, match=r"summary\.json is not valid JSON"):
        write_report([run], tmp_path / "r.html")
