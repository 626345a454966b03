"""How anabranch's GRPO step time grows with n and with the completion length.

    python benchmarks/scaling.py --model tiny --backend hf
    python benchmarks/scaling.py --model smollm2 --backend vllm --ns 2,4,8,16 --lengths 32,64,128

One process, one model and one engine; for each setting one warm-up step and ``--steps`` timed
ones. The table gives seconds per step, its rollout and update parts, seconds per thousand
trained tokens (prompt + completion), and the update's seconds per TFLOP of its model FLOPs
(harness.update_flops, the tokens it computes): the last stays flat when the update's cost grows
no faster than its work, whatever the mix of prompt, response and attention FLOPs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    AnabranchRunner, Workload, arithmetic_prompts, model_folder, set_thread_env, update_flops,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--backend", default="hf", choices=["hf", "vllm"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--ns", default="2,4,8,16")
    ap.add_argument("--n-tokens", type=int, default=64, help="completion length while n varies")
    ap.add_argument("--lengths", default="32,64,128,256,512")
    ap.add_argument("--length-n", type=int, default=8, help="n while the completion length varies")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    # 1536, as in vs_trl.py: on CPU the update's cost per FLOP is flat across n and length at this
    # budget and doubles at 8192 (page faults of blocks over glibc's mmap threshold, and the working
    # set leaving the caches; docs/benchmarks.md "Cost against n and completion length, again").
    ap.add_argument("--micro-batch-tokens", type=int, default=1536)
    args = ap.parse_args()
    set_thread_env(args.threads)
    ns = [int(n) for n in args.ns.split(",") if n]
    lengths = [int(t) for t in args.lengths.split(",") if t]
    # The largest n and length of the sweep size the vLLM engine's KV cache.
    w = Workload(model=model_folder(args.model), prompts_per_step=args.prompts, threads=args.threads,
                 n=max(ns + [args.length_n]), tokens=max(lengths + [args.n_tokens]),
                 micro_batch_tokens=args.micro_batch_tokens)
    runner = AnabranchRunner(w, args.backend)
    prompts, answers = arithmetic_prompts(runner.tok, args.prompts * (args.steps + 1))
    settings = [(n, args.n_tokens) for n in ns] + [(args.length_n, t) for t in lengths]
    print(f"model {args.model}, backend {args.backend}, {args.prompts} prompts, {args.threads} threads, fp32")
    print(f"{'n':>4} {'tokens':>7} {'s/step':>8} {'gen s':>8} {'update s':>9} {'gen tok/s':>10} "
          f"{'s/1k trained tok':>17} {'update GFLOP':>13} {'update s/TFLOP':>15}")
    for n, tokens in settings:
        times = []
        for i in range(args.steps + 1):
            sl = slice(i * args.prompts, (i + 1) * args.prompts)
            ro, t_gen, t_upd = runner.step(prompts[sl], answers[sl], n=n, tokens=tokens)
            if i > 0:
                times.append((t_gen, t_upd))
        gen = sum(t for t, _ in times) / len(times)
        upd = sum(u for _, u in times) / len(times)
        trained = int(ro.attention_mask.sum())
        rate = int(ro.response_mask.sum()) / gen
        flops = update_flops(w.model, ro.prompt_mask.sum(-1).tolist(), tokens, n if w.share_prompt_prefix else 1)
        print(f"{n:>4} {tokens:>7} {gen + upd:>8.2f} {gen:>8.2f} {upd:>9.2f} {rate:>10.1f} "
              f"{1000 * (gen + upd) / trained:>17.3f} {flops / 1e9:>13.1f} {upd / (flops / 1e12):>15.2f}", flush=True)


if __name__ == "__main__":
    main()
