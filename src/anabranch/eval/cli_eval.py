"""The ``eval``, ``compare``, ``report`` and ``update-stats`` subcommands (registered on the main parser by cli.py)."""

from __future__ import annotations

import argparse
import sys
import time

COMMANDS = ("eval", "compare", "report", "update-stats")


def _ks(text: str) -> list[int]:
    try:
        return [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--k expects integers separated by commas, got {text!r}") from None


def _add_sampling(p) -> None:
    p.add_argument("--n", type=int, default=16, help="samples per problem (default 16)")
    p.add_argument("--k", type=_ks, default=[], help="k values for pass@k and maj@k, e.g. 1,4,16 (default 1,2,4,..,n)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature, >= 0 (0: greedy decoding, allowed only with --n 1)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, in (0, 1] (default 1: off)")
    p.add_argument("--max-new-tokens", type=int, default=0, help="0: the config's eval/rollout length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-greedy", action="store_true", help="skip the greedy-accuracy pass")
    p.add_argument("--no-embeddings", action="store_true", help="skip embedding diversity and the PCA map")
    p.add_argument("--no-effective-rank", action="store_true",
                   help="skip the effective rank of each response's hidden states (one extra forward pass)")
    p.add_argument("--sparse-tokens", type=int, default=2048,
                   help="sparse selection: response positions of each later model's completions at which its top "
                        "next token is compared with the first (base) model's (default 2048; 0: skip)")
    p.add_argument("--gain-k", type=int, default=0,
                   help="the k of the gain decomposition (pass@k->pass@1 compression vs capability gain) and of "
                        "the interference of each later model against the first (default 0: the largest --k)")
    p.add_argument("--bon-frontier", action="store_true",
                   help="did RL beat best-of-n at the same KL? the first model's best-of-n and optimal tilted "
                        "reward-vs-KL curves and each later model's reward and KL to it (one forward pass of "
                        "each model over the later model's samples; bon_frontier.png); needs two or more "
                        "models and --n >= 2")


def _ratios(text: str) -> list[float]:
    try:
        return [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--contamination expects fractions separated by commas, got {text!r}") from None


def add_subcommands(sub) -> None:
    p = sub.add_parser("eval", help="pass@k, maj@k, greedy accuracy and diversity of one or more models")
    p.add_argument("args", nargs="+", metavar="MODEL_OR_KEY=VALUE",
                   help="models (run directory, checkpoint folder RUN/checkpoints/step-NNNNNN, HF folder or "
                        "Hub id org/name, packaged:NAME), then dotted config overrides")
    p.add_argument("--config", "-c", default=None, help="YAML config for the task (default: the first run's config)")
    p.add_argument("--out", "-o", default=None, help="output folder (default eval-<time>)")
    _add_sampling(p)
    p.add_argument("--contamination", type=_ratios, default=[], metavar="FRACTIONS",
                   help="partial-prompt leakage audit (Wu et al. 2025): cut each held-out problem to these "
                        "fractions of its words, e.g. 0.4,0.6,0.8, continue greedily, report completion exact "
                        "match, ROUGE-L and answer accuracy (default: off)")
    p.add_argument("--judge-probe", nargs="?", const="", default=None, metavar="KEYS_FILE",
                   help="judge robustness (Zhao et al. 2025): score \"master key\" responses with no answer "
                        "(':', 'Solution', ...) with the configured rewards on the held-out problems and report "
                        "each reward's false-positive rate; optional file of keys, one per line or a JSON list "
                        "(write --judge-probe=FILE; a bare --judge-probe goes last on the line; default: off)")
    p.add_argument("--arrol-vote", action="store_true",
                   help="ARRoL (Xu et al. 2026): besides the plain majority vote, the vote with each sample's answer "
                        "weighted by the quality head's predicted success at the pruning point; the head is read "
                        "from a checkpoint folder RUN/checkpoints/step-NNNNNN of an ARRoL run (default: off)")

    p = sub.add_parser("compare", help="train the same job with several algorithms and write one report")
    p.add_argument("--algorithms", "-a", required=True, help="comma-separated recipe names, e.g. grpo,flowrl,dapo")
    p.add_argument("--config", "-c", default=None, help="YAML config shared by every run")
    p.add_argument("--eval-n", type=int, default=0, help="after training, sample this many completions per "
                   "held-out problem for pass@k and diversity (0: skip)")
    p.add_argument("overrides", nargs="*", help="dotted overrides shared by every run")

    p = sub.add_parser("update-stats", help="which parameters RL changed: fraction per module/layer, "
                       "overlap of two runs, rank of each update (Mukherjee et al. 2025)")
    p.add_argument("base", metavar="BASE", help="base model: HF folder or packaged:NAME")
    p.add_argument("trained", metavar="TRAINED", help="trained model: HF folder (e.g. RUN/final)")
    p.add_argument("--other", default=None, metavar="TRAINED2", help="a second model trained from BASE: "
                   "report the overlap of the two changed sets")
    p.add_argument("--tol", type=float, default=1e-5, help="a parameter changed when |Δ| > tol (default 1e-5)")
    p.add_argument("--bf16", action="store_true", help="round both models to bfloat16 before comparing")
    p.add_argument("--no-rank", action="store_true", help="skip the rank of each ΔW (an SVD per 2-D weight)")
    p.add_argument("--out", "-o", default="update_stats.json", help="JSON file to write (default update_stats.json)")

    p = sub.add_parser("report", help="one self-contained HTML page comparing run directories")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", "-o", default="report.html", help="HTML file to write (default report.html)")
    p.add_argument("--title", default="anabranch report")


def settings_from(args, n: int | None = None):
    from anabranch.eval.runner import EvalSettings

    return EvalSettings(n=n or args.n, ks=args.k, temperature=args.temperature, top_p=args.top_p,
                        max_new_tokens=args.max_new_tokens, seed=args.seed, greedy=not args.no_greedy,
                        embeddings=not args.no_embeddings, effective_rank=not args.no_effective_rank,
                        sparse_tokens=args.sparse_tokens, gain_k=args.gain_k,
                        contamination=getattr(args, "contamination", []),
                        bon_frontier=args.bon_frontier, judge_probe=_probe_keys(getattr(args, "judge_probe", None)),
                        arrol_vote=getattr(args, "arrol_vote", False))


def _probe_keys(value: str | None) -> list[str] | None:
    """--judge-probe: None when absent, the paper's keys when given alone, else the keys in the file."""
    if value is None:
        return None
    from anabranch.eval.judge_probe import DEFAULT_MASTER_KEYS, load_keys

    return list(DEFAULT_MASTER_KEYS) if value == "" else load_keys(value)


def run(args) -> int:
    from anabranch.config import ConfigError

    try:
        if args.command == "eval":
            from anabranch.eval.runner import run_eval

            models = [a for a in args.args if "=" not in a]
            overrides = [a for a in args.args if "=" in a]
            if not models:
                raise ConfigError("name at least one model: anabranch eval MODEL [MODEL...] [key=value ...]")
            out = args.out or f"eval-{time.strftime('%Y%m%d-%H%M%S')}"
            # run_eval checks the settings and every model before it loads any of them.
            run_eval(models, args.config, overrides, settings_from(args), out)
            print(f"wrote {out}/passk.json and {out}/passk.png")
        elif args.command == "compare":
            from anabranch.eval.compare import parse_algorithms, run_compare
            from anabranch.eval.runner import EvalSettings

            algos = parse_algorithms(args.algorithms)
            if args.eval_n < 0:
                raise ConfigError(f"--eval-n must be >= 0 (0: skip the evaluation), got {args.eval_n}")
            settings = EvalSettings(n=args.eval_n) if args.eval_n > 0 else None
            runs, report = run_compare(algos, args.config, args.overrides, settings)
            print("runs: " + ", ".join(str(r) for r in runs))
            print(f"report: {report}")
        elif args.command == "update-stats":
            import json
            from pathlib import Path

            from anabranch.eval.update_stats import format_table, update_stats

            result = update_stats(args.base, args.trained, args.other, tol=args.tol, bf16=args.bf16,
                                  rank=not args.no_rank)
            print(format_table(result))
            Path(args.out).write_text(json.dumps(result, indent=2))
            print(f"wrote {args.out}")
        elif args.command == "report":
            from anabranch.eval.report import write_report

            print(f"report: {write_report(args.runs, args.out, args.title)}")
    except (ConfigError, OSError, ValueError) as exc:  # OSError: e.g. an output path that cannot be written
        print(f"anabranch {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        from anabranch.eval.compare import CompareFailed

        if not isinstance(exc, CompareFailed):
            raise
        print(f"anabranch compare: error: {exc}", file=sys.stderr)
        return 1
    return 0
