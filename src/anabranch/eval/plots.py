"""PNG plots for evaluation and reports (matplotlib, headless Agg backend)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _save(fig, path: Path) -> Path:
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_passk(curves: dict[str, dict], path: Path, title: str = "pass@k") -> Path:
    """One curve per model: pass@k against k (log2 axis), as in the base-vs-RL comparisons."""
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for label, values in curves.items():
        ks = sorted(int(k) for k in values)
        ax.plot(ks, [values[str(k)] for k in ks], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k (samples)")
    ax.set_ylabel("pass@k")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_over_steps(series: dict[str, tuple[list, list]], path: Path, ylabel: str, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for label, (steps, values) in series.items():
        ax.plot(steps, values, marker="." if len(steps) < 40 else None, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    return _save(fig, path)


# What a bar's height is, for the metrics the eval reports (eval/runner.py ``diversity_of``).
BAR_UNITS = {
    "distinct_answers": "distinct answers per problem (count)",
    "distinct_1": "distinct unigrams / unigrams",
    "distinct_2": "distinct bigrams / bigrams",
    "self_bleu": "Self-BLEU-4, 0-1 (lower = more diverse)",
    "embedding_diversity": "mean pairwise cosine distance",
    "answer_entropy": "answer entropy (nats)",
    "effective_rank": "effective rank of hidden states",
}


def plot_bars(groups: dict[str, dict[str, float]], path: Path, title: str) -> Path:
    """One panel per metric, one bar per run, each panel on its own y axis.

    The metrics have different units (a count of distinct answers per problem, which grows with
    the number of samples, next to fractions in [0, 1]): on one shared axis the count would dwarf
    the fractions and their differences between runs would not be readable."""
    metrics = sorted({m for values in groups.values() for m in values})
    labels = list(groups)
    fig, axes = plt.subplots(1, max(len(metrics), 1), figsize=(max(5.5, 2.6 * len(metrics)), 3.6), squeeze=False)
    colors = [f"C{i % 10}" for i in range(len(labels))]
    for ax, metric in zip(axes[0], metrics):
        heights = [groups[label].get(metric, np.nan) for label in labels]
        ax.bar(np.arange(len(labels)), heights, color=colors)
        ax.set_xticks(np.arange(len(labels)))
        ax.set_xticklabels(labels, rotation=15, fontsize=7)
        ax.set_title(metric, fontsize=9)
        ax.set_ylabel(BAR_UNITS.get(metric, metric), fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    if not metrics:
        axes[0][0].axis("off")
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def plot_entropy_law(points: dict[str, tuple], path: Path) -> Path:
    """Reward against entropy per run, with the fitted R = −a·exp(H) + b."""
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for label, (h, r, fit) in points.items():
        dots = ax.scatter(h, r, s=12, alpha=0.7, label=label)
        if fit is not None:
            grid = np.linspace(min(h), max(h), 100)
            ax.plot(grid, fit.predict(grid), color=dots.get_facecolor()[0],
                    label=f"{label}: R=−{fit.a:.3g}·e^H+{fit.b:.3g} (R²={fit.r2:.2f})")
    ax.set_xlabel("entropy H (mean per token)")
    ax.set_ylabel("reward R")
    ax.set_title("reward–entropy law")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_high_reward_map(highs: dict[str, dict], path: Path, max_problems: int) -> dict | None:
    """Per problem, a 2-D PCA map of the high-reward completions of every model, projected
    together so that spread and overlap compare across models. None when no problem has at least
    three such completions."""
    from anabranch.eval.diversity import pca_2d

    problems = sorted({i for high in highs.values() for i in high},
                      key=lambda i: -sum(len(h[i][0]) for h in highs.values() if i in h))
    problems = [i for i in problems if sum(len(h[i][0]) for h in highs.values() if i in h) >= 3][:max_problems]
    if not problems:
        return None
    fig, axes = plt.subplots(1, len(problems), figsize=(3.6 * len(problems), 3.4), squeeze=False)
    summary = {}
    for ax, i in zip(axes[0], problems):
        labels = [lab for lab, h in highs.items() if i in h]
        emb = np.concatenate([highs[lab][i][1] for lab in labels])
        xy = pca_2d(emb)
        start = 0
        summary[str(i)] = {}
        for lab in labels:
            count = len(highs[lab][i][0])
            pts = xy[start:start + count]
            start += count
            ax.scatter(pts[:, 0], pts[:, 1], s=18, alpha=0.7, label=lab)
            summary[str(i)][lab] = pts.round(4).tolist()
        ax.set_title(f"problem {i}", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    axes[0][0].legend(fontsize=7)
    fig.suptitle("high-reward completions (PCA of sentence embeddings)", fontsize=10)
    _save(fig, path)
    return summary


def placeholder(path: Path, text: str) -> Path:
    fig, ax = plt.subplots(figsize=(5.5, 1.6))
    ax.axis("off")
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, fontsize=9)
    return _save(fig, path)
