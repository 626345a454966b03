"""Time the fused LM head's forward + backward on W1's response tokens for several chunk sizes.

    python benchmarks/fused_head_chunks.py --hidden 256 --rows 256,64,42,16     # the tiny model's head
    python benchmarks/fused_head_chunks.py --hidden 576 --rows 256,42           # SmolLM2's head

Random hidden states and head weights ([tokens, hidden] and [vocab, hidden]); the softmax
statistics run ``rows`` rows of the [tokens, vocab] fp32 logits at a time (CPU_CHUNK_BYTES lifted
so that larger chunks are really used). Each size is timed ``--repeats`` times, the sizes in turn,
twice over.
"""

from __future__ import annotations

import argparse
import time

import torch

from anabranch.models import fused_head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rows", default="256,64,42,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(args.tokens, args.hidden, generator=g).requires_grad_()
    w = (torch.randn(args.vocab, args.hidden, generator=g) * 0.05).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    sizes = [int(r) for r in args.rows.split(",")]
    times: dict[int, list[float]] = {r: [] for r in sizes}
    for _ in range(2):
        for rows in sizes:
            fused_head.CPU_CHUNK_BYTES = rows * args.vocab * 4
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                lp, _ent = fused_head.fused_head_log_prob(h, w, None, targets, 1.0, True, False, chunk_tokens=rows)
                lp.sum().backward()
                times[rows].append(time.perf_counter() - t0)
                h.grad = w.grad = None
    for rows, ts in times.items():
        ts = sorted(ts)
        print(f"{rows:5d} rows ({rows * args.vocab * 4 / 2**20:6.1f} MiB): median {ts[len(ts) // 2]:.3f} s, "
              f"range {ts[0]:.3f}-{ts[-1]:.3f} s over {len(ts)} calls")


if __name__ == "__main__":
    main()
