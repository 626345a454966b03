"""A/B/... of the update's micro-batch plans on CPU: the same model and batch, the plans taken in turn
update by update (A B C, C B A, ...), so the host's drift hits all of them alike.

    .venv/bin/python benchmarks/ab_micro_batches.py --model smollm2 --tokens 256 --plans rows16 tokens1536

A plan is ``rowsN`` (trainer.micro_batch_size=N, micro_batch_tokens=0: the configs' default) or
``tokensN`` (trainer.micro_batch_tokens=N). Random response tokens of exactly ``--tokens`` each (an
update's cost does not depend on them); one untimed update per plan, then ``--rounds`` rounds. Prints
each update's wall time, its minor page faults and the micro-batch count, then the medians.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import batch_parser, in_turns, update_batch, update_flops  # noqa: E402


def parse_plan(name: str) -> dict:
    for prefix, key in (("rows", "micro_batch_size"), ("tokens", "micro_batch_tokens")):
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            return {key: int(name[len(prefix):])}
    raise SystemExit(f"plan {name!r}: expected rowsN or tokensN")


def main() -> None:
    ap = batch_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--plans", nargs="+", default=["rows16", "tokens1536"])
    args = ap.parse_args()
    plans = {name: parse_plan(name) for name in args.plans}

    from anabranch.models.shared_prefix import supports_shared_prefix
    from anabranch.trainer.host_memory import keep_freed_host_memory
    from anabranch.trainer.microbatch import plan_micro_batches
    from anabranch.trainer.step import policy_update

    torch.set_num_threads(2)
    keep_freed_host_memory()  # as the trainer does on CPU
    b = update_batch(args.model, args.prompts, args.n, args.tokens)
    model, ro, R = b.model, b.rollout, args.tokens
    B = ro.response_ids.shape[0]
    share = supports_shared_prefix(model)
    prompt_lens = ro.prompt_mask.sum(-1).tolist()
    gflop = update_flops(b.path, prompt_lens, R, group_size=args.n if share else 1) / 1e9
    print(f"{B} sequences, prompts {sorted(set(prompt_lens))} + {R} tokens; {gflop:.0f} model GFLOP an update")

    def update(plan: dict) -> tuple[float, int, int]:
        kw = dict(micro_batch_size=plan.get("micro_batch_size", 16), micro_batch_tokens=plan.get("micro_batch_tokens", 0))
        count = len(plan_micro_batches(ro.prompt_mask, ro.response_mask, kw["micro_batch_size"],
                                       kw["micro_batch_tokens"], ro.group_index, share))
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        policy_update(model, b.optimizer, ro, b.advantages, b.rewards, b.algo, grad_clip=1.0, temperature=1.0, max_response_len=R,
                      share_prompt_prefix=True, **kw)
        return time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults, count

    for name, plan in plans.items():
        print(f"untimed {name}: {update(plan)[0]:.2f} s", flush=True)
    order = list(plans)

    def timed(name: str, _round: int) -> tuple[float, str]:
        seconds, faults, count = update(plans[name])
        return seconds, (f", {faults / 1e3:7.0f} k page faults, {count} micro-batches, "
                         f"{seconds / gflop * 1e3:5.1f} s/TFLOP")

    times = in_turns(order, timed, args.rounds)
    base = statistics.median(times[order[0]])
    for name in order:
        med = statistics.median(times[name])
        print(f"median {name:12s} {med:7.2f} s ({med / base:.2f} of {order[0]}), {med / gflop * 1e3:5.1f} s/TFLOP")


if __name__ == "__main__":
    main()
