"""Profile one anabranch policy update on W1 shapes (4 prompts x 8 samples x 64 tokens).

    python benchmarks/profile_update.py --model tiny
    python benchmarks/profile_update.py --model smollm2 --micro-batch-tokens 8192

Random response tokens (the update's cost does not depend on what was sampled); one untimed update,
then one under ``torch.profiler`` whose top operators by CPU time are printed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import arithmetic_prompts, model_folder  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--no-share-prefix", action="store_true", help="trainer.share_prompt_prefix=false")
    ap.add_argument("--repeats", type=int, default=2, help="unprofiled updates timed before the profiled one")
    args = ap.parse_args()

    from torch.profiler import ProfilerActivity, profile

    from anabranch.algorithms.resolve import resolve_algorithm
    from anabranch.config import AlgorithmConfig, ModelConfig
    from anabranch.models.loading import load_model, load_tokenizer
    from anabranch.rollout.base import Rollout
    from anabranch.trainer.components import adamw
    from anabranch.trainer.step import policy_update

    torch.set_num_threads(args.threads)
    path = model_folder(args.model)
    tok = load_tokenizer(ModelConfig(path=path))
    model = load_model(ModelConfig(path=path), torch.device("cpu"))
    prompts, _ = arithmetic_prompts(tok, args.prompts)
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    B, R = args.prompts * args.n, args.tokens
    ro = Rollout(enc["input_ids"].repeat_interleave(args.n, 0), enc["attention_mask"].repeat_interleave(args.n, 0),
                 torch.randint(100, 1000, (B, R)), torch.ones(B, R, dtype=torch.long),
                 torch.arange(args.prompts).repeat_interleave(args.n), prompts, [""] * B,
                 torch.ones(B, dtype=torch.bool))
    algo = resolve_algorithm(AlgorithmConfig())
    opt = adamw(model.parameters(), lr=1e-6)
    rewards = torch.rand(B)
    adv = algo.advantage(rewards, ro.group_index, ro.response_mask.float(), algo.cfg)
    kw = dict(micro_batch_size=B, grad_clip=1.0, temperature=1.0, max_response_len=R,
              micro_batch_tokens=args.micro_batch_tokens, share_prompt_prefix=not args.no_share_prefix)
    print(f"prompt tokens per sequence: {enc['attention_mask'].sum(-1).tolist()}; {B} x {R} response tokens")
    policy_update(model, opt, ro, adv, rewards, algo, **kw)
    for _ in range(args.repeats):
        cpu, wall = time.process_time(), time.perf_counter()
        policy_update(model, opt, ro, adv, rewards, algo, **kw)
        print(f"update: wall {time.perf_counter() - wall:.2f} s, CPU {time.process_time() - cpu:.2f} s")
    cpu, wall = time.process_time(), time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        policy_update(model, opt, ro, adv, rewards, algo, **kw)
    print(f"update: wall {time.perf_counter() - wall:.2f} s, CPU {time.process_time() - cpu:.2f} s (profiled)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
