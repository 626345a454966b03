"""A/B of the generate backend's shared prefill (trainer.share_prompt_prefix): the same model and
prompts, rollouts with and without it taken in turns (A B, B A, ...), so the host's drift hits both.

    .venv/bin/python benchmarks/ab_generate_prefill.py --model smollm2 --prompts 4 --n 8 --tokens 64

Checks first that greedy rollouts are the same token for token both ways, then times ``--rounds``
pairs of sampled rollouts of exactly ``--tokens`` new tokens (min = max) from basic_arithmetic prompts.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import arithmetic_prompts, batch_parser, in_turns, model_folder  # noqa: E402


def main() -> None:
    ap = batch_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()

    from anabranch.config import ModelConfig, RolloutConfig
    from anabranch.models.loading import load_model, load_tokenizer
    from anabranch.rollout.hf_generate import HFGenerateBackend

    torch.set_num_threads(2)
    path = model_folder(args.model)
    tok = load_tokenizer(ModelConfig(path=path))
    model = load_model(ModelConfig(path=path), torch.device("cpu"))
    prompts, _ = arithmetic_prompts(tok, args.prompts)
    backend = HFGenerateBackend(model, tok, RolloutConfig(max_new_tokens=args.tokens, min_new_tokens=args.tokens))

    greedy = {}
    for share in (True, False):
        backend.share_prompt_prefix = share
        greedy[share] = backend.generate(prompts, 2, greedy=True).response_ids
    print(f"greedy rollouts equal with and without the shared prefill: {torch.equal(greedy[True], greedy[False])}")
    def timed(share: bool, r: int) -> float:
        backend.share_prompt_prefix = share
        torch.manual_seed(r)
        start = time.perf_counter()
        backend.generate(prompts, args.n)
        return time.perf_counter() - start

    times = in_turns([True, False], timed, args.rounds, label=lambda share: "shared" if share else "plain")
    shared, plain = statistics.median(times[True]), statistics.median(times[False])
    wins = sum(s < p for s, p in zip(times[True], times[False]))
    print(f"median shared {shared:.2f} s, plain {plain:.2f} s: {plain / shared:.2f}x; shared faster in "
          f"{wins} of {args.rounds} pairs")


if __name__ == "__main__":
    main()
