"""Throughput of finished training runs, read from their run directories (no re-run).

For each run directory: the steps after the first ``--skip`` (warm-up: CUDA kernels, allocator,
compilation), the mean seconds per step and its rollout and update parts, generated tokens per
second over the rollout time and over the whole step (response tokens: the mean response length
times the step's prompts × n), the reward of the first and last steps, the held-out accuracy
before and after, and the peak GPU memory when it was logged.

    python benchmarks/run_speed.py runs/grpo-*/            # a table, one row per run
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml


def run_speed(run_dir: Path, skip: int = 1) -> dict:
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "time/step_s" in r]
    timed = steps[skip:] or steps
    if not timed:
        raise SystemExit(f"{run_dir}: no training steps in metrics.jsonl")
    batch = cfg["rollout"]["prompts_per_step"] * cfg["rollout"]["n"]

    def mean(key: str) -> float:
        return sum(r[key] for r in timed) / len(timed)

    step_s, gen_s = mean("time/step_s"), mean("time/generate_s")
    tokens = mean("response_length/mean") * batch
    # Written at the end of a run; an interrupted run has no before/after accuracy to report.
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    return {
        "run": run_dir.name, "steps": len(steps), "timed": len(timed), "batch": batch,
        "s_per_step": step_s, "rollout_s": gen_s, "update_s": step_s - gen_s,
        "gen_tok_s_rollout": tokens / gen_s if gen_s else float("nan"), "gen_tok_s_step": tokens / step_s,
        "reward_first": steps[0].get("reward/mean"), "reward_last": steps[-1].get("reward/mean"),
        "acc_before": summary.get("accuracy_before"), "acc_after": summary.get("accuracy_after"),
        "gpu_peak_gib": max((r.get("memory/gpu_peak_gib", 0.0) for r in steps), default=0.0) or None,
    }


def fmt(value) -> str:
    if value is None:
        return "—"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--skip", type=int, default=1, help="leading steps left out of the means (warm-up)")
    ap.add_argument("--json", action="store_true", help="one JSON object per run instead of a table")
    args = ap.parse_args()
    results = [run_speed(r, args.skip) for r in args.runs if (r / "metrics.jsonl").is_file()]
    if args.json:
        for r in results:
            print(json.dumps(r))
        return
    cols = list(results[0]) if results else []
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(fmt(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
