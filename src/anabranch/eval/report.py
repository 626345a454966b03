"""``anabranch report RUN_DIR...``: one self-contained HTML page comparing runs side by side.

Every plot is a PNG embedded as a base64 ``data:`` URI and the only styling is an inline
``<style>`` block, so the file opens from disk with no server and no internet. Sections: reward
and held-out accuracy over steps, entropy over steps, pass@k curves and diversity (from each
run's ``eval_passk.json``, written by ``anabranch eval RUN_DIR``; a table gives the diversity metrics
side by side, Self-BLEU among them, lower = more diverse), and the fit of the
reward–entropy law R = −a·exp(H) + b (:mod:`anabranch.eval.entropy_law`; "–" and a "no fit" legend
when a run has fewer than 3 steps or a constant reward). The pass@k numbers are labelled with the n
and problem count of the evaluation they came from. When two or more runs' evaluations hold their
samples for the same problems, a table gives each run's empirical support against the first run's
(preserved / shrunk / expanded problems and answers, :mod:`anabranch.eval.support`), and a run evaluated
after a base (``anabranch eval BASE RUN``) gets a table of where its top next token departs from the
base's (:mod:`anabranch.eval.sparse_selection`) and tables of its gain decomposition and interference
against that base (:mod:`anabranch.eval.gain_decomposition`, :mod:`anabranch.eval.interference`). A plot whose data is
missing is replaced by an image saying what is missing and how to produce it. A run that stopped
before its end (no ``summary.json``) shows the last step it logged, marked "unfinished", and the
accuracy it logged at step 0; a last metrics row cut short by the stop is left out.
"""

from __future__ import annotations

import base64
import html
import json
import tempfile
from pathlib import Path

from anabranch.eval import plots
from anabranch.eval.entropy_law import fit_reward_entropy, why_no_fit

PLOTS = ["reward", "accuracy", "entropy", "passk", "diversity", "entropy_law"]


def read_run(run_dir: str | Path) -> dict:
    run = Path(run_dir)
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{run} is not a run directory: it has no metrics.jsonl")
    rows = []
    text = metrics.read_text()
    lines = text.splitlines()
    for i, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                if i == len(lines) and not text.endswith("\n"):
                    # The last row of a run killed while writing it: report what was logged before.
                    print(f"anabranch report: {metrics} ends in a partial line (a run stopped while "
                          "writing it); it is left out")
                    continue
                raise ValueError(f"{metrics} line {i} is not JSON: {exc}") from exc
    data = {"label": run.name, "path": str(run), "rows": rows, "summary": {}, "evals": [], "algorithm": ""}
    if (run / "summary.json").is_file():
        data["summary"] = _load_json(run / "summary.json") or {}
    if (run / "eval_passk.json").is_file():
        saved = _load_json(run / "eval_passk.json") or {}
        # Each `anabranch eval RUN_DIR` replaces the file, so the sample size it used travels with
        # the numbers: older files only have it in "settings".
        n = (saved.get("settings") or {}).get("n")
        data["evals"] = [{**e, "n": e.get("n", n)} for e in saved.get("models", [])]
    if (run / "config.yaml").is_file():
        import yaml

        cfg = yaml.safe_load((run / "config.yaml").read_text()) or {}
        data["algorithm"] = (cfg.get("algorithm") or {}).get("name", "")
    return data


def _load_json(path: Path):
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:  # e.g. cut short when the run was killed
        raise ValueError(f"{path} is not valid JSON ({exc}); move it aside to report the run without it") from None


def series(run: dict, key: str) -> tuple[list, list]:
    pts = [(r["step"], r[key]) for r in run["rows"] if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def make_plots(runs: list[dict], folder: Path) -> dict[str, tuple[Path, str]]:
    """name -> (png, caption) for every plot in PLOTS."""
    out = {}

    def over_steps(name, key, ylabel, title, missing):
        data = {r["label"]: series(r, key) for r in runs}
        data = {k: v for k, v in data.items() if v[0]}
        path = folder / f"{name}.png"
        if data:
            out[name] = (plots.plot_over_steps(data, path, ylabel, title), title)
        else:
            out[name] = (plots.placeholder(path, f"{title}: {missing}"), title)

    over_steps("reward", "reward/mean", "mean reward", "training reward per step", "no reward/mean in metrics.jsonl")
    if any(series(r, "eval/accuracy")[0] for r in runs) or not any(series(r, "eval/reward")[0] for r in runs):
        over_steps("accuracy", "eval/accuracy", "held-out accuracy (greedy)", "held-out accuracy",
                   "no eval/accuracy rows (set trainer.eval_every)")
    else:  # held-out problems without a right/wrong reward: the trainer logs their mean reward
        over_steps("accuracy", "eval/reward", "held-out reward (greedy)", "held-out reward", "")
    over_steps("entropy", "entropy", "mean token entropy", "policy entropy per step", "no entropy in metrics.jsonl")

    evals = {f"{r['label']}" if len(r["evals"]) == 1 else f"{r['label']}/{e['label']}": e
             for r in runs for e in r["evals"]}
    missing_eval = "no eval_passk.json in the run directories: run `anabranch eval RUN_DIR`"
    if evals:
        basis = "; ".join(f"{k}: {eval_basis(e)}" for k, e in evals.items())
        curves = {k: e.get("pass@k") or {} for k, e in evals.items()}
        out["passk"] = (plots.plot_passk(curves, folder / "passk.png"),
                        f"pass@k on held-out problems (from eval_passk.json, the latest `anabranch eval`: {basis})")
        bars = {k: {m: v for m, v in e.get("diversity", {}).items() if isinstance(v, (int, float))}
                for k, e in evals.items()}
        out["diversity"] = (plots.plot_bars(bars, folder / "diversity.png", "diversity of sampled completions"),
                            "diversity, one axis per metric (distinct answers per problem, distinct-n, Self-BLEU: "
                            "lower = more diverse, embedding diversity)")
    else:
        out["passk"] = (plots.placeholder(folder / "passk.png", missing_eval), "pass@k")
        div = {r["label"]: series(r, "groups/distinct_answers") for r in runs}
        div = {k: v for k, v in div.items() if v[0]}
        if div:
            out["diversity"] = (plots.plot_over_steps(div, folder / "diversity.png", "distinct answers per group",
                                                      "distinct final answers per prompt (training)"),
                                "diversity: distinct final answers per prompt during training")
        else:
            out["diversity"] = (plots.placeholder(folder / "diversity.png", missing_eval), "diversity")

    points = {}
    for r in runs:
        steps_h, h = series(r, "entropy")
        by_step = dict(zip(*series(r, "reward/mean")))
        pairs = [(x, by_step[s]) for s, x in zip(steps_h, h) if s in by_step]
        if len(pairs) >= 2:
            hs, rs = [p[0] for p in pairs], [p[1] for p in pairs]
            fit = fit_reward_entropy(hs, rs)
            # No fit (too few steps, or a constant reward): say so in the legend instead of a curve.
            label = r["label"] if fit else f"{r['label']} (no fit: {why_no_fit(hs, rs)})"
            points[label] = (hs, rs, fit)
            r["entropy_fit"] = fit
    if points:
        out["entropy_law"] = (plots.plot_entropy_law(points, folder / "entropy_law.png"),
                              "reward–entropy law R = −a·exp(H) + b (Cui et al. 2025), per training step")
    else:
        out["entropy_law"] = (plots.placeholder(folder / "entropy_law.png", "fewer than two steps with entropy and reward"),
                              "reward–entropy law")
    return out


def eval_basis(entry: dict) -> str:
    """What the pass@k numbers rest on, e.g. "n=16, 50 problems"."""
    n = entry.get("n")
    problems = entry.get("num_problems")
    if problems is None and isinstance(entry.get("problems"), list):
        problems = len(entry["problems"])
    parts = [f"n={n}" if n is not None else "n unknown"]
    if problems is not None:
        parts.append(f"{problems} problems")
    return ", ".join(parts)


def _img(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


def _fmt(v) -> str:
    if v is None or v == "":
        return "–"
    return f"{v:.3f}" if isinstance(v, float) else html.escape(str(v))


def summary_table(runs: list[dict]) -> str:
    head = ["run", "algorithm", "steps", "accuracy before", "accuracy after", "final reward",
            "collapse step", "a", "b", "R²", "greedy", "pass@1", "pass@max", "pass@k from"]
    lines = ["<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for r in runs:
        s = r["summary"]
        rewards = series(r, "reward/mean")[1]
        fit = r.get("entropy_fit")
        ev = r["evals"][0] if r["evals"] else {}
        pk = ev.get("pass@k", {})
        kmax = max(pk, key=int) if pk else None
        collapse = (s.get("model_collapse") or {}).get("collapse_step")
        steps = s.get("steps")
        if steps is None:  # no summary.json: the run stopped or failed before its end
            logged = [row["step"] for row in r["rows"] if isinstance(row.get("step"), int)]
            steps = f"{max(logged)} (unfinished)" if logged else None
        before = s.get("accuracy_before")
        if before is None and not s:  # logged at step 0 before training, even by a run that then failed
            before = next((row["eval/accuracy"] for row in r["rows"] if row.get("step") == 0
                           and isinstance(row.get("eval/accuracy"), (int, float))), None)
        cells = [r["label"], r["algorithm"], steps, before, s.get("accuracy_after"),
                 rewards[-1] if rewards else None, collapse,
                 fit.a if fit else None, fit.b if fit else None, fit.r2 if fit else None,
                 # pass@1 = c/n = mean@n, also when --k left 1 out
                 ev.get("greedy_accuracy"), pk.get("1", ev.get("mean@n")), pk.get(kmax) if kmax else None,
                 eval_basis(ev) if ev else None]
        lines.append("<tr>" + "".join(f"<td>{_fmt(c)}</td>" for c in cells) + "</tr>")
    return "\n".join(lines) + "</table>"


def support_table(runs: list[dict]) -> str:
    """Empirical support of each run's latest evaluation against the first run's (Wu et al. 2025,
    :mod:`anabranch.eval.support`); empty when fewer than two runs have per-problem samples."""
    from anabranch.eval.support import support_change

    evaluated = [r for r in runs if r["evals"] and isinstance(r["evals"][0].get("problems"), list)]
    if len(evaluated) < 2:
        return ""
    base = evaluated[0]
    head = ["run", "preserved", "shrunk", "expanded", "out of support", "SRR", "NDR", "SDS", "NSCR",
            "answers preserved", "answers shrunk", "answers expanded"]
    lines = [f"<h2>Support against {html.escape(base['label'])}</h2><p>Problems solved within the n samples "
             "by both runs (preserved), only the reference (shrunk), only this run (expanded) or neither; "
             "the same for distinct correct answers (Wu et al. 2025, \"The Invisible Leash\").</p><table><tr>"
             + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for r in evaluated[1:]:
        try:
            sc = support_change(base["evals"][0]["problems"], r["evals"][0]["problems"])
        except (ValueError, KeyError, TypeError) as exc:
            lines.append(f"<tr><td>{html.escape(r['label'])}</td><td colspan='{len(head) - 1}'>"
                         f"{html.escape(str(exc))}</td></tr>")
            continue
        pr, an = sc["problems"], sc["answers"]
        cells = [r["label"], pr["preserved"], pr["shrunk"], pr["expanded"], pr["out_of_support"], pr["SRR"],
                 pr["NDR"], pr["SDS"], pr["NSCR"], an["preserved"], an["shrunk"], an["expanded"]]
        lines.append("<tr>" + "".join(f"<td>{_fmt(c)}</td>" for c in cells) + "</tr>")
    return "\n".join(lines) + "</table>"


def sparse_selection_table(runs: list[dict]) -> str:
    """Where each run's top next token departs from its base's, from the latest ``anabranch eval BASE
    RUN`` (Akgül et al. 2026, :mod:`anabranch.eval.sparse_selection`); empty when no run has it."""
    rows = [(r["label"], r["evals"][0]["sparse_selection"]) for r in runs
            if r["evals"] and isinstance(r["evals"][0].get("sparse_selection"), dict)]
    if not rows:
        return ""
    head = ["run", "base", "positions", "changed", "in base top-1", "top-2", "top-3", "top-4", "top-5", "top-10",
            "beyond 10", "KL(run‖base)", "base entropy", "base entropy where changed"]
    lines = ["<h2>Sparse selection</h2><p>Along each run's own sampled completions: the fraction of positions "
             "where its most likely next token differs from its base model's, and among those, how often the "
             "base ranks the run's choice in its top-k (Akgül et al. 2026, \"Rethinking RL for LLM Reasoning: "
             "It's Sparse Policy Selection, Not Capability Learning\").</p><table><tr>"
             + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for label, sel in rows:
        if "error" in sel:
            lines.append(f"<tr><td>{html.escape(label)}</td><td>{html.escape(str(sel.get('base', '')))}</td>"
                         f"<td colspan='{len(head) - 2}'>{html.escape(str(sel['error']))}</td></tr>")
            continue
        top = sel.get("changed_in_base_top_k") or {}
        cells = [label, sel.get("base"), sel.get("positions"), sel.get("changed_fraction"),
                 *[top.get(k) for k in ("1", "2", "3", "4", "5", "10")], sel.get("changed_beyond_base_top_10"),
                 sel.get("kl_trained_base_mean"), sel.get("base_entropy_mean"), sel.get("base_entropy_changed_mean")]
        lines.append("<tr>" + "".join(f"<td>{_fmt(c)}</td>" for c in cells) + "</tr>")
    return "\n".join(lines) + "</table>"


def gain_interference_tables(runs: list[dict]) -> str:
    """Each run's gain decomposition (Nath et al. 2025, :mod:`anabranch.eval.gain_decomposition`) and
    interference (Nguyen et al. 2025, :mod:`anabranch.eval.interference`) against its base, from the
    latest ``anabranch eval BASE RUN``; empty when no run has them."""
    rows = [(r["label"], r["evals"][0]) for r in runs if r["evals"]
            and isinstance(r["evals"][0].get("gain_decomposition"), dict)
            and isinstance(r["evals"][0].get("interference"), dict)]
    if not rows:
        return ""

    def table(title, intro, head, key, cells_of):
        lines = [f"<h2>{title}</h2><p>{intro}</p><table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
        for label, ev in rows:
            d = ev[key]
            if "error" in d:
                lines.append(f"<tr><td>{html.escape(label)}</td><td>{html.escape(str(d.get('base', '')))}</td>"
                             f"<td colspan='{len(head) - 2}'>{html.escape(str(d['error']))}</td></tr>")
                continue
            lines.append("<tr>" + "".join(f"<td>{_fmt(c)}</td>" for c in [label, d.get("base"), *cells_of(d)])
                         + "</tr>")
        return "\n".join(lines) + "</table>"

    gain = table("Gain decomposition", "Change of pass@1 against the base, split into problems the base solved "
                 "within its samples (compression of its pass@k into pass@1) and problems it never solved "
                 "(capability gain); compressed: trained pass@1 ≥ base pass@k (Nath et al. 2025, \"Adaptive "
                 "Guidance Accelerates Reinforcement Learning of Reasoning Models\").",
                 ["run", "base", "k", "pass@1 change", "compression", "capability", "capability share",
                  "compression ratio", "in reach", "compressed", "gained", "unreached"], "gain_decomposition",
                 lambda d: [d.get("k"), d.get("pass1_gain"), d.get("compression"), d.get("capability"),
                            d.get("capability_share"), d.get("compression_ratio"), d.get("in_reach"),
                            d.get("compressed"), d.get("gained"), d.get("unreached")])
    wta_head = [f"Δpass@1 base {b}" for b in ("0", "(0,¼]", "(¼,½]", "(½,¾]", "(¾,1]")]
    inter = table("Interference", "Problems whose pass@k fell against the base (degraded), solved by the base "
                  "but never by the run (lost), the pass@k lost and won on them; then the mean pass@1 change "
                  "by the base's pass@1 (winner-take-all gap: upper half minus lower non-zero half) (Nguyen et "
                  "al. 2025, \"The Reasoning Boundary Paradox\").",
                  ["run", "base", "k", "degraded", "lost", "degraded share", "pass@k lost", "pass@k won",
                   *wta_head, "winner-take-all gap"], "interference",
                  lambda d: [d.get("k"), d.get("degraded"), d.get("lost"), d.get("degraded_share"),
                             d.get("interference"), d.get("improvement"),
                             *[b.get("delta_pass1") for b in (d.get("winner_take_all") or {}).get("bins", [])],
                             (d.get("winner_take_all") or {}).get("wta_gap")])
    return gain + inter


# The eval's diversity metrics, side by side (eval/runner.py ``diversity_of``): key, column head.
DIVERSITY_COLUMNS = [("distinct_answers", "distinct answers ↑"), ("answer_entropy", "answer entropy ↑"),
                     ("distinct_1", "distinct-1 ↑"), ("distinct_2", "distinct-2 ↑"),
                     ("self_bleu", "Self-BLEU ↓"), ("embedding_diversity", "embedding diversity ↑"),
                     ("effective_rank", "effective rank")]


def diversity_table(runs: list[dict]) -> str:
    """Each run's latest evaluation's diversity metrics; empty when no run was evaluated. The
    arrows say which way is more diverse: Self-BLEU is a similarity, lower is more diverse."""
    evaluated = [r for r in runs if r["evals"]]
    if not evaluated:
        return ""
    lines = ["<h2>Diversity</h2><p>From each run's latest <code>anabranch eval</code>, per problem then "
             "averaged; ↑ / ↓: a higher / lower value is more diverse (Self-BLEU, Zhu et al. 2018, is the "
             "BLEU-4 of each sample against the problem's other samples).</p><table><tr><th>run</th>"
             + "".join(f"<th>{h}</th>" for _, h in DIVERSITY_COLUMNS) + "</tr>"]
    for r in evaluated:
        div = r["evals"][0].get("diversity") or {}
        cells = [r["label"]] + [div.get(key) for key, _ in DIVERSITY_COLUMNS]
        lines.append("<tr>" + "".join(f"<td>{_fmt(c)}</td>" for c in cells) + "</tr>")
    return "\n".join(lines) + "</table>"


STYLE = """body{font-family:sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}th{background:#f3f3f3}
.grid{display:flex;flex-wrap:wrap;gap:12px}figure{margin:0;border:1px solid #ddd;padding:6px}
figcaption{font-size:12px;color:#555;max-width:500px}img{max-width:520px}"""


def write_report(run_dirs: list[str | Path], out: str | Path, title: str = "anabranch report") -> Path:
    from anabranch.eval.contamination import report_table as contamination_table
    from anabranch.eval.judge_probe import report_table as judge_probe_table

    if not run_dirs:
        raise ValueError("name at least one run directory")
    runs = [read_run(d) for d in run_dirs]
    labels = [r["label"] for r in runs]
    for i, r in enumerate(runs):
        if labels.count(r["label"]) > 1:
            r["label"] = f"{r['label']}#{i + 1}"
    out = Path(out)
    if out.is_dir():
        raise ValueError(f"--out {out} is a folder; name the HTML file to write, e.g. {out / 'report.html'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    from anabranch.eval import bon_frontier  # its table (Yang et al. 2024)

    with tempfile.TemporaryDirectory() as tmp:
        figs = make_plots(runs, Path(tmp))
        body = "\n".join(
            f'<figure id="plot-{name}"><img alt="{name}" src="{_img(figs[name][0])}">'
            f"<figcaption>{html.escape(figs[name][1])}</figcaption></figure>" for name in PLOTS)
    page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<p>Runs: {', '.join(html.escape(r['path']) for r in runs)}</p>"
            f"<h2>Summary</h2>{summary_table(runs)}{diversity_table(runs)}{support_table(runs)}"
            f"{sparse_selection_table(runs)}{gain_interference_tables(runs)}{bon_frontier.report_table(runs)}"
            f"{contamination_table(runs)}{judge_probe_table(runs)}"
            f"<h2>Plots</h2><div class='grid'>{body}</div></body></html>")
    out.write_text(page, encoding="utf-8")
    return out
