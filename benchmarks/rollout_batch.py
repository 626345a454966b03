"""Rollout throughput of the vLLM backend at a given batch (issue 7: SmolLM2 >= 400 tok/s at >= 64).

    .venv-vllm/bin/python benchmarks/rollout_batch.py --model smollm2 --prompts 8 --n 8 --tokens 64

Builds ``VLLMBackend`` as ``anabranch train`` does (KV cache sized for the batch), generates
``prompts x n`` sequences of exactly ``tokens`` new tokens (min = max) from basic_arithmetic prompts,
``--warmup`` untimed calls then ``--repeats`` timed ones, and prints the engine's start time and
generated tokens per second (``--compiled``: vLLM's torch.compile of the model, ``rollout.vllm_cpu_compile``).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import arithmetic_prompts, batch_parser, engine_kv_tokens, model_folder, set_thread_env  # noqa: E402


def main() -> None:
    ap = batch_parser(__doc__, prompts=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compiled", action="store_true",
                    help="rollout.vllm_cpu_compile=true: vLLM's torch.compile of the model (default: eager)")
    args = ap.parse_args()
    set_thread_env(args.threads)  # read when the engine binds its threads
    import torch

    torch.set_num_threads(args.threads)

    from anabranch.config import ModelConfig, RolloutConfig
    from anabranch.models.loading import load_model, load_tokenizer
    from anabranch.rollout.vllm_backend import VLLMBackend

    path = model_folder(args.model)
    tok = load_tokenizer(ModelConfig(path=path))
    model = load_model(ModelConfig(path=path), torch.device("cpu"))
    prompts, _ = arithmetic_prompts(tok, args.prompts)
    cfg = RolloutConfig(backend="vllm", max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                        vllm_cpu_compile=args.compiled)
    start = time.perf_counter()
    engine = VLLMBackend(model, tok, cfg, kv_tokens=engine_kv_tokens(tok, prompts, args.prompts * args.n, args.tokens))
    print(f"engine start: {time.perf_counter() - start:.1f} s", flush=True)
    rates = []
    for i in range(args.warmup + args.repeats):
        start = time.perf_counter()
        ro = engine.generate(prompts, args.n, seed=i)
        seconds = time.perf_counter() - start
        generated = int(ro.response_mask.sum())
        if i >= args.warmup:
            rates.append(generated / seconds)
        print(f"{'timed' if i >= args.warmup else 'warm-up'} {ro.response_ids.shape[0]} sequences, "
              f"{generated} tokens in {seconds:.2f} s: {generated / seconds:.0f} tok/s", flush=True)
    print(f"batch {args.prompts * args.n}, {args.tokens} tokens: median {statistics.median(rates):.0f} tok/s "
          f"(min {min(rates):.0f}, max {max(rates):.0f})")


if __name__ == "__main__":
    main()
