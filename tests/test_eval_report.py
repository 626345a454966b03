"""The HTML report: every plot is present, embedded, and the page needs nothing from outside."""

import base64
import json
import math
import re

import pytest

from anabranch.eval.report import PLOTS, write_report


def fake_run(root, name, a, b, with_eval=True, steps=12):
    run = root / name
    run.mkdir(parents=True)
    rows = []
    for s in range(1, steps + 1):
        h = 1.2 - 0.08 * s
        rows.append({"step": s, "reward/mean": -a * math.exp(h) + b, "entropy": h, "loss": 0.1,
                     "groups/distinct_answers": 3 - s / steps})
        if s % 4 == 0:
            rows.append({"step": s, "eval/accuracy": 0.2 + 0.02 * s})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.yaml").write_text(f"algorithm:\n  name: {name}\n")
    (run / "summary.json").write_text(json.dumps({"accuracy_before": 0.2, "accuracy_after": 0.44, "steps": steps,
                                                  "model_collapse": {"collapse_step": None}}))
    if with_eval:
        entry = {"label": name, "n": 4, "pass@k": {"1": 0.3, "2": 0.45, "4": 0.6},
                 "maj@k": {"1": 0.3, "2": 0.3, "4": 0.35}, "mean@n": 0.3, "greedy_accuracy": 0.4,
                 "diversity": {"distinct_answers": 2.5, "distinct_1": 0.4, "distinct_2": 0.6,
                               "embedding_diversity": 0.2}}
        (run / "eval_passk.json").write_text(json.dumps({"models": [entry]}))
    return run


def images(page):
    return dict(re.findall(r'<figure id="plot-([a-z_]+)"><img alt="[a-z_]+" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page))


def test_report_has_every_plot_embedded_and_no_external_resources(tmp_path):
    runs = [fake_run(tmp_path, "grpo", 0.3, 1.2), fake_run(tmp_path, "flowrl", 0.2, 1.0)]
    out = write_report(runs, tmp_path / "out" / "report.html")
    page = out.read_text()
    imgs = images(page)
    assert sorted(imgs) == sorted(PLOTS)
    for name, data in imgs.items():
        assert base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n", name
    # Opens offline: no links, scripts or stylesheets fetched from anywhere.
    assert not re.search(r"(src|href)=['\"](?!data:)", page)
    assert "<script" not in page and "http" not in page
    # The fitted law recovers the a, b the fake runs were generated with (summary table).
    assert "<td>0.300</td><td>1.200</td><td>1.000</td>" in page
    assert "<td>0.200</td><td>1.000</td><td>1.000</td>" in page


def test_report_without_eval_files_explains_what_is_missing(tmp_path):
    run = fake_run(tmp_path, "grpo", 0.3, 1.2, with_eval=False)
    page = write_report([run], tmp_path / "r.html").read_text()
    assert sorted(images(page)) == sorted(PLOTS)  # placeholders keep every section
    assert "distinct final answers per prompt" in page


def test_report_rejects_a_folder_that_is_not_a_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        write_report([tmp_path], tmp_path / "r.html")


def row_of(page, label):
    return re.search(rf"<tr><td>{label}</td>.*?</tr>", page).group(0)


def test_report_shows_no_fit_instead_of_a_perfect_one_for_degenerate_runs(tmp_path, monkeypatch):
    from anabranch.eval import plots

    drawn = {}
    real = plots.plot_entropy_law
    monkeypatch.setattr(plots, "plot_entropy_law", lambda points, path: drawn.update(points) or real(points, path))
    # a = 0: the reward is 0.5 at every step (zero variance); the old fit reported R² = 1.000.
    flat = fake_run(tmp_path, "flat", 0.0, 0.5, with_eval=False)
    short = fake_run(tmp_path, "short", 0.3, 1.2, with_eval=False, steps=2)  # two points fit any curve
    page = write_report([flat, short], tmp_path / "r.html").read_text()
    for label in ("flat", "short"):
        row = row_of(page, label)
        # collapse step (None here), a, b, R²: all shown as –, none as a perfect 1.000
        assert "<td>–</td><td>–</td><td>–</td><td>–</td>" in row, row
        assert "1.000" not in row
    # The plot's legend says why there is no curve.
    assert sorted(drawn) == ["flat (no fit: reward never changed)", "short (no fit: 2 steps, the fit needs 3)"]
    assert all(fit is None for _, _, fit in drawn.values())


def test_report_says_which_n_and_how_many_problems_passk_came_from(tmp_path):
    run = fake_run(tmp_path, "grpo", 0.3, 1.2, with_eval=False)
    entry = {"label": "grpo", "n": 16, "num_problems": 50, "pass@k": {"1": 0.3, "16": 0.7}, "diversity": {}}
    (run / "eval_passk.json").write_text(json.dumps({"settings": {"n": 16}, "n": 16, "num_problems": 50,
                                                     "models": [entry]}))
    # A file from before n was stored in the entry: the settings still say it.
    old = fake_run(tmp_path, "old", 0.2, 1.0, with_eval=False)
    (old / "eval_passk.json").write_text(json.dumps({"settings": {"n": 8}, "models": [
        {"label": "old", "pass@k": {"1": 0.2, "8": 0.5}, "diversity": {}}]}))
    page = write_report([run, old], tmp_path / "r.html").read_text()
    assert "<td>n=16, 50 problems</td>" in row_of(page, "grpo")
    assert "<td>n=8</td>" in row_of(page, "old")
    assert "grpo: n=16, 50 problems; old: n=8" in page  # the pass@k plot's caption
