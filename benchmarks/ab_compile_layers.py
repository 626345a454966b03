"""A/B of trainer.compile_layers on W1's update: the same model, alternating plain and compiled
layers (models/fused_layers.py) update by update, so the host's drift hits both alike.

    .venv/bin/python benchmarks/ab_compile_layers.py --model smollm2 --rounds 5

Random response tokens (an update's cost does not depend on them); one plain and two compiled
updates untimed (the first compiled one pays the compilation, printed), then ``--rounds`` pairs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import in_turns, update_batch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--micro-batch-tokens", type=int, default=1536)
    args = ap.parse_args()

    from anabranch.models import fused_layers
    from anabranch.trainer.host_memory import keep_freed_host_memory
    from anabranch.trainer.step import policy_update

    torch.set_num_threads(2)
    keep_freed_host_memory()
    B, R = 32, 64
    b = update_batch(args.model, 4, 8, R)
    model = b.model
    kw = dict(micro_batch_size=B, grad_clip=1.0, temperature=1.0, max_response_len=R,
              micro_batch_tokens=args.micro_batch_tokens, share_prompt_prefix=True)

    def update(compiled: bool) -> float:
        if compiled:
            fused_layers.install(model)
        start = time.perf_counter()
        policy_update(model, b.optimizer, b.rollout, b.advantages, b.rewards, b.algo, **kw)
        seconds = time.perf_counter() - start
        if compiled:
            fused_layers.uninstall(model)
            fused_layers.restore_rotary()
        return seconds

    update(False)
    print(f"first compiled update (compilation included): {update(True):.1f} s", flush=True)
    update(True)
    times = in_turns([False, True], lambda compiled, _r: update(compiled), args.rounds,
                     label=lambda compiled: "compiled" if compiled else "plain")
    plain, fused = statistics.median(times[False]), statistics.median(times[True])
    wins = sum(f < p for p, f in zip(times[False], times[True]))
    print(f"median plain {plain:.2f} s, compiled {fused:.2f} s ({fused / plain - 1:+.1%}); "
          f"compiled faster in {wins} of {args.rounds} pairs")


if __name__ == "__main__":
    main()
