"""Our paged decode attention kernel (`minivllm::paged_decode`) alone: one layer's decode step
of `--seqs` sequences at `--context` tokens, over distinct caches (one per layer of the
model, so that the keys and values stream from memory as in a step), SmolLM2's heads
(`--shape`: Gemma-3-270M's, Llama-3.2-1B's, Qwen2.5-1.5B's).

    .venv/bin/python benchmarks/paged_decode.py [--threads 1] [--seqs 16] [--context 200]
        [--kv-dtype float32|bfloat16] [--shape smollm2|gemma3|llama1b|qwen1.5b]

Prints the best of 10 passes over the caches, in us per layer.
"""

from __future__ import annotations

import argparse
import time

import torch

from minivllm.layers.cpu_kernels import cpu_kernels_available

BLOCK = 16
SHAPES = {  # heads, KV heads, dim, layers
    "smollm2": (9, 3, 64, 30),
    "gemma3": (4, 1, 256, 18),
    "llama1b": (32, 8, 64, 16),
    "qwen1.5b": (12, 2, 128, 28),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--kv-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    args = parser.parse_args()
    heads, kv_heads, head_dim, layers = SHAPES[args.shape]
    if not cpu_kernels_available():
        raise SystemExit("the kernels are not built here (see the log)")
    torch.set_num_threads(args.threads)
    blocks_per_seq = -(-args.context // BLOCK)
    num_blocks = args.seqs * blocks_per_seq + 8
    kv_dtype = getattr(torch, args.kv_dtype)
    caches = [
        (
            torch.randn(num_blocks, BLOCK, kv_heads, head_dim, dtype=kv_dtype),
            torch.randn(num_blocks, BLOCK, kv_heads, head_dim, dtype=kv_dtype),
        )
        for _ in range(layers)
    ]
    tables = torch.randperm(num_blocks)[: args.seqs * blocks_per_seq].view(args.seqs, -1)
    seq_lens = torch.full((args.seqs,), args.context, dtype=torch.long)
    q = torch.randn(args.seqs, heads, head_dim)

    def one_pass() -> None:
        for k_cache, v_cache in caches:
            torch.ops.minivllm.paged_decode(
                q, k_cache, v_cache, tables, seq_lens, head_dim**-0.5, torch.tensor(0), 0.0
            )

    one_pass()
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        one_pass()
        best = min(best, (time.perf_counter() - start) / layers)
    print(
        f"paged_decode, {args.shape}, {args.seqs} sequences x {args.context} tokens, "
        f"{args.kv_dtype} cache, {args.threads} thread(s): {best * 1e6:.0f} us per layer"
    )


if __name__ == "__main__":
    main()
