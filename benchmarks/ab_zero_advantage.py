"""A/B/C of ``trainer.zero_advantage_rows`` on CPU: the update on one batch where ``--uniform-groups``
of the prompts' groups got the same reward for every sample (Â = 0: no share in the gradient),
taken in turns update by update (A B C, C B A, ...), so the host's drift hits all modes alike.

    .venv/bin/python benchmarks/ab_zero_advantage.py --model smollm2 --prompts 8 --n 4 --tokens 32 --uniform-groups 3

The default batch is the quick start's (8 prompts × 4 samples × 32 tokens), where 42% of the groups
were uniform over its 24 steps. Random response tokens (an update's cost does not depend on them);
the other groups get random rewards. Checks first that the three modes give the same gradient.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import batch_parser, in_turns, update_batch  # noqa: E402

MODES = ["train", "forward", "skip"]


def main() -> None:
    ap = batch_parser(__doc__, prompts=8)
    ap.set_defaults(n=4, tokens=32)
    ap.add_argument("--uniform-groups", type=int, default=3, help="groups whose samples all get reward 1")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    if not 0 <= args.uniform_groups <= args.prompts:
        raise SystemExit("--uniform-groups must be between 0 and --prompts")

    from anabranch.trainer.host_memory import keep_freed_host_memory
    from anabranch.trainer.microbatch import resolve_micro_batch_tokens
    from anabranch.trainer.step import policy_update

    torch.set_num_threads(2)
    keep_freed_host_memory()  # as the trainer does on CPU
    b = update_batch(args.model, args.prompts, args.n, args.tokens)
    ro, algo = b.rollout, b.algo
    rewards = b.rewards.clone()
    rewards[: args.uniform_groups * args.n] = 1.0
    adv = algo.advantage(rewards, ro.group_index, ro.response_mask.float(), algo.cfg)
    params = list(b.model.parameters())
    budget = resolve_micro_batch_tokens(-1, torch.device("cpu"), b.model.config.vocab_size)  # the trainer's default

    def update(mode: str, lr_scale: float = 1.0) -> float:
        for group in b.optimizer.param_groups:  # lr 0 for the gradient check: the weights stay put
            group["lr"] = 1e-6 * lr_scale
        start = time.perf_counter()
        metrics = policy_update(b.model, b.optimizer, ro, adv, rewards, algo, micro_batch_size=16,
                                micro_batch_tokens=budget, grad_clip=0.0, temperature=1.0,
                                max_response_len=args.tokens, zero_advantage_rows=mode)
        update.frac = metrics.get("update/zero_advantage_frac", 0.0)
        return time.perf_counter() - start

    grads = {}
    for mode in MODES:
        print(f"untimed {mode}: {update(mode, lr_scale=0.0):.2f} s", flush=True)
        grads[mode] = torch.cat([p.grad.flatten() for p in params])
    for mode in MODES[1:]:
        diff = float((grads[mode] - grads["train"]).abs().max() / grads["train"].abs().max())
        print(f"gradient of {mode} against train: largest difference {diff:.1e} of the largest entry")
    print(f"sequences with Â = 0: {update.frac:.0%} ({args.uniform_groups} of {args.prompts} groups)")

    times = in_turns(MODES, lambda mode, _r: update(mode), args.rounds)
    base = statistics.median(times["train"])
    for mode in MODES:
        med = statistics.median(times[mode])
        print(f"median {mode:8s} {med:7.2f} s  ({base / med:.2f}x train)")


if __name__ == "__main__":
    main()
