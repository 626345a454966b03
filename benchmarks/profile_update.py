"""Profile one anabranch policy update on W1 shapes (4 prompts x 8 samples x 64 tokens).

    python benchmarks/profile_update.py --model tiny
    python benchmarks/profile_update.py --model smollm2 --micro-batch-tokens 8192
    python benchmarks/profile_update.py --model PATH --device cuda --autocast bf16 --prompts 32 --tokens 128

``--model`` takes tiny, smollm2 or a model folder / packaged name.

Random response tokens (the update's cost does not depend on what was sampled); one untimed update,
then one under ``torch.profiler`` whose top operators by CPU time are printed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import batch_parser, update_batch  # noqa: E402


def main() -> None:
    ap = batch_parser(__doc__, model="tiny")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--no-share-prefix", action="store_true", help="trainer.share_prompt_prefix=false")
    ap.add_argument("--repeats", type=int, default=2, help="unprofiled updates timed before the profiled one")
    ap.add_argument("--shapes", action="store_true", help="group the profile by input shapes")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--autocast", choices=["no", "bf16"], default="no", help="bf16 autocast, as accelerate's mixed precision")
    ap.add_argument("--micro-batch-size", type=int, default=0, help="sequences per micro-batch (0: the whole batch)")
    ap.add_argument("--logits-budget-mib", type=int, default=0,
                    help="LM-head logits kept below this per micro-batch, else recomputed (0: the default)")
    ap.add_argument("--label", default="", help="printed with the timings")
    ap.add_argument("--no-keep-freed-memory", action="store_true",
                    help="glibc's default malloc behaviour (the trainer keeps freed memory on CPU)")
    args = ap.parse_args()

    from torch.profiler import ProfilerActivity, profile

    from anabranch.models import logprobs
    from anabranch.trainer.step import policy_update

    torch.set_num_threads(args.threads)
    if args.device == "cpu" and not args.no_keep_freed_memory:  # as the trainer does on CPU
        from anabranch.trainer.host_memory import keep_freed_host_memory

        keep_freed_host_memory()
    if args.logits_budget_mib:
        logprobs.LOGITS_BUDGET_BYTES = args.logits_budget_mib * 2**20
    device = torch.device(args.device)
    b = update_batch(args.model, args.prompts, args.n, args.tokens, args.device)
    model, ro = b.model, b.rollout
    B, R = args.prompts * args.n, args.tokens
    kw = dict(micro_batch_size=args.micro_batch_size or B, grad_clip=1.0, temperature=1.0, max_response_len=R,
              micro_batch_tokens=args.micro_batch_tokens, share_prompt_prefix=not args.no_share_prefix)
    print(f"prompt tokens per sequence: {ro.prompt_mask[::args.n].sum(-1).tolist()}; {B} x {R} response tokens")
    cuda = device.type == "cuda"

    def update():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.autocast == "bf16"):
            policy_update(model, b.optimizer, ro, b.advantages, b.rewards, b.algo, **kw)
        if cuda:
            torch.cuda.synchronize()

    update()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.repeats):
        cpu, wall = time.process_time(), time.perf_counter()
        update()
        print(f"update{' ' + args.label if args.label else ''}: wall {time.perf_counter() - wall:.3f} s, "
              f"CPU {time.process_time() - cpu:.2f} s"
              + (f", peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if cuda else ""))
    cpu, wall = time.process_time(), time.perf_counter()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=args.shapes) as prof:
        update()
    print(f"update: wall {time.perf_counter() - wall:.2f} s, CPU {time.process_time() - cpu:.2f} s (profiled)")
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages(group_by_input_shape=args.shapes).table(sort_by=sort, row_limit=20 if not args.shapes else 30))


if __name__ == "__main__":
    main()
