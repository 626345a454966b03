"""FlowRL vs GRPO on an enumerable toy problem: final answer distributions against the target.

    python benchmarks/flowrl_vs_grpo_toy.py [--steps 500] [--out docs/images/flowrl_vs_grpo_toy.png]

Two problems, one prompt each, 8 single-token answers, a tabular softmax policy starting at π_ref,
trained with the registered estimators and objectives (see anabranch.eval.toy_matching):

- "equal": answers 0-2 are correct (reward 1), π_ref puts 0.2/0.1/0.05 on them; default FlowRL
  (β = 15, group-normalized r̂, learned log Z head). Target: π_ref·exp(15·r)/Z.
- "unequal": rewards 1, .8, .6, .4, .2, 0, 0, 0, uniform π_ref; FlowRL with β = 3, centered
  rewards and VarGrad log Z. Target: π_ref·exp(3·r)/Z.

Prints a Markdown table of KL(π||target), entropy and answers above 5% mass, and saves the plot.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from anabranch.config import AlgorithmConfig, FlowRLConfig
from anabranch.eval.toy_matching import describe, target_distribution, train_tabular

PROBLEMS = {
    "equal": {"rewards": [1, 1, 1, 0, 0, 0, 0, 0], "ref": [0.2, 0.1, 0.05, 0.15, 0.15, 0.15, 0.1, 0.1],
              "beta": 15.0, "flowrl": AlgorithmConfig(name="flowrl"),
              "label": "3 correct answers, reward 1 (FlowRL defaults: β=15, r̂ group-normalized, log Z head)"},
    "unequal": {"rewards": [1.0, 0.8, 0.6, 0.4, 0.2, 0.0, 0.0, 0.0], "ref": [1 / 8] * 8, "beta": 3.0,
                "flowrl": AlgorithmConfig(name="flowrl", norm_adv_by_std=False,
                                          flowrl=FlowRLConfig(beta=3.0, log_z="vargrad")),
                "label": "graded rewards 1 .8 .6 .4 .2 0 0 0 (FlowRL: β=3, centered r, VarGrad)"},
}


def run(steps: int, seeds: int) -> dict:
    out = {}
    for name, p in PROBLEMS.items():
        target = target_distribution(p["ref"], p["rewards"], p["beta"])
        rows = {"target": {"probs": target.tolist(), **describe(target, target)},
                "start (π_ref)": {"probs": p["ref"], **describe(target.new_tensor(p["ref"]), target)}}
        for algo_name, cfg in (("FlowRL", p["flowrl"]), ("GRPO", AlgorithmConfig(name="grpo"))):
            for seed in range(seeds):
                probs = train_tabular(cfg, p["rewards"], p["ref"], steps=steps, seed=seed).probs
                rows[f"{algo_name} seed {seed}"] = {"probs": probs.tolist(), **describe(probs, target)}
        out[name] = {"label": p["label"], "rows": rows}
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 3.8))
    for ax, (name, res) in zip(axes, results.items()):
        rows = res["rows"]
        k = len(rows["target"]["probs"])
        x = np.arange(k)
        show = [("target", "black"), ("FlowRL seed 0", "tab:blue"), ("GRPO seed 0", "tab:red")]
        width = 0.27
        for i, (key, color) in enumerate(show):
            label = key.replace(" seed 0", "")
            if key != "target":
                label += f" (KL {rows[key]['kl_to_target']:.3f})"
            ax.bar(x + (i - 1) * width, rows[key]["probs"], width, color=color, label=label,
                   alpha=0.45 if key == "target" else 0.9)
        ax.set_xticks(x)
        ax.set_xlabel("answer")
        ax.set_ylabel("probability")
        ax.set_title(res["label"], fontsize=8)
        ax.legend(fontsize=8)
    fig.suptitle("Final answer distributions vs the target π_ref·exp(β·r)/Z")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def table(results: dict) -> str:
    lines = []
    for name, res in results.items():
        lines += [f"\n**{name}**: {res['label']}\n",
                  "| policy | KL(π‖target) | KL(target‖π) | entropy | answers > 5% | max prob |",
                  "|---|---|---|---|---|---|"]
        for key, r in res["rows"].items():
            lines.append(f"| {key} | {r['kl_to_target']:.4f} | {r['kl_target_to_policy']:.4f} | "
                         f"{r['entropy']:.3f} | {r['modes_over_5pct']} | {r['max_prob']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default="docs/images/flowrl_vs_grpo_toy.png")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    args = ap.parse_args()
    results = run(args.steps, args.seeds)
    plot(results, Path(args.out))
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"\nplot: {args.out}")


if __name__ == "__main__":
    main()
