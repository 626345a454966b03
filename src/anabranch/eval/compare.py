"""``anabranch compare --algorithms grpo,flowrl,dapo``: the same task, model, seed and budget
trained once per algorithm, then one report over the runs.

The runs land in ``trainer.output_dir/<name>/<algorithm>/`` (``<name>`` is ``trainer.run_name``
or ``compare-<task>-<time>``) and the report in ``trainer.output_dir/<name>/report.html``.
Algorithm names are looked up in ``RECIPES`` when the command runs, so every recipe registered by
then (built-in or imported by the user) can be compared. Every algorithm's config is resolved
before the first one trains (a bad combination stops the command at once); an algorithm whose
training then fails does not stop the others: the report covers every run that logged a step, and
the command ends with :class:`CompareFailed` naming the failures.
"""

from __future__ import annotations

import time
from pathlib import Path

from anabranch.config import ConfigError, load_config, one_line
from anabranch.registry import unknown_name_message


class CompareFailed(RuntimeError):
    """Some algorithms' training failed; the others ran and the report was written."""


def parse_algorithms(text: str) -> list[str]:
    import anabranch.algorithms  # noqa: F401  (registers the built-in recipes)
    from anabranch.algorithms.registries import RECIPES

    names = [a.strip() for a in text.split(",") if a.strip()]
    if not names:
        raise ConfigError("--algorithms needs at least one recipe name, e.g. --algorithms grpo,dapo")
    if len(set(names)) != len(names):
        raise ConfigError(f"--algorithms names a recipe twice: {text!r}")
    for name in names:
        if name not in RECIPES:
            raise ConfigError(f"--algorithms: {unknown_name_message('algorithm recipe', name, RECIPES.names())}")
    return names


def run_compare(algorithms: list[str], config_file: str | None, overrides: list[str],
                eval_settings=None) -> tuple[list[Path], Path]:
    """Train each algorithm on the same config; optionally evaluate each final model; write the report."""
    from anabranch.algorithms.resolve import resolve_algorithm
    from anabranch.eval.report import write_report
    from anabranch.trainer.loop import train
    from anabranch.trainer.signals import RunStopped

    base = load_config(config_file, overrides)  # fail on a bad key before any training
    name = base.trainer.run_name or f"compare-{base.task.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    root = Path(base.trainer.output_dir) / name
    configs = []
    for algo in algorithms:  # every combination checked (load_config runs the whole-config check) before training
        try:
            cfg = load_config(config_file, list(overrides) + [
                f"algorithm.name={algo}", f"trainer.output_dir={root}", f"trainer.run_name={algo}"])
            resolve_algorithm(cfg.algorithm)
        except ConfigError as exc:
            raise ConfigError(f"--algorithms {algo}: {exc}") from None
        configs.append(cfg)
    run_dirs, failed = [], {}
    for algo, cfg in zip(algorithms, configs):
        print(f"== {algo} ==")
        try:
            result = train(cfg)
        except RunStopped:  # Ctrl-C / SIGTERM: the user stops the whole comparison
            raise
        except Exception as exc:  # one algorithm's failure (diverged, out of memory, ...) is its own
            failed[algo] = f"{type(exc).__name__}: {one_line(exc)}"[:300]
            print(f"{algo}: training failed ({failed[algo]}); going on with the other algorithms")
            if (root / algo / "metrics.jsonl").is_file():  # what it logged before failing goes in the report
                run_dirs.append(root / algo)
            continue
        run_dirs.append(Path(result.run_dir))
        if eval_settings is not None and result.final_model_dir is None:
            print(f"{algo}: no final model (trainer.save_final=false), so no pass@k evaluation; "
                  f"evaluate a checkpoint with `anabranch eval {result.run_dir}/checkpoints/step-NNNNNN`")
        elif eval_settings is not None:
            from anabranch.eval.runner import run_eval

            run_eval([str(result.run_dir)], config_file, list(overrides), eval_settings, Path(result.run_dir) / "eval")
    if not run_dirs:
        raise CompareFailed("every algorithm failed: " + "; ".join(f"{a}: {why}" for a, why in failed.items()))
    report = write_report(run_dirs, root / "report.html", title=f"anabranch compare: {', '.join(algorithms)}")
    if failed:
        raise CompareFailed(f"{len(failed)} of {len(algorithms)} algorithms failed ("
                            + "; ".join(f"{a}: {why}" for a, why in failed.items())
                            + f"); the report of the others: {report}")
    return run_dirs, report
