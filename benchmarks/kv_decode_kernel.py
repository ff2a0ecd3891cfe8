"""The paged decode kernel alone over a bf16, int8 and fp8 cache: one layer's decode attention
of `c` sequences at a `context`, the default model's head layout (9 query heads, 3 KV heads,
head_dim 64; `--heads 32 8 128` for a Llama-3.2-1B layer), blocks scattered over the pool.
Interleaved `--rounds` times, on `--threads` threads; prints the best time of each and the
ratio to bf16.

    python benchmarks/kv_decode_kernel.py --context 512 8192 --concurrency 1 16
"""

from __future__ import annotations

import argparse
import time

import torch

from minivllm.layers.attention import kv_quant
from minivllm.layers.attention.paged_decode import paged_decode_attention
from minivllm.layers.cpu_kernels import cpu_kernels_available

BLOCK = 16


def make_step(kind: str, context: int, seqs: int, heads: tuple[int, int, int]):
    """A cache holding `seqs` sequences of `context` tokens in shuffled blocks, and a query."""
    num_heads, kv_heads, dim = heads
    per_seq = -(-context // BLOCK)
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm(seqs * per_seq, generator=gen).view(seqs, per_seq)
    shape = (seqs * per_seq, BLOCK, kv_heads, dim)
    cache = kv_quant.allocate_kv_cache(shape, kind, torch.bfloat16, torch.device("cpu"))
    rows = torch.randn(seqs * per_seq * BLOCK, kv_heads, dim, generator=gen)
    kv_quant.store_kv(rows, rows, cache, torch.arange(rows.shape[0]))
    q = torch.randn(seqs, num_heads, dim, generator=gen)
    lens = torch.full((seqs,), context)
    return q, cache, tables, lens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, nargs="+", default=[512, 8192])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64])
    parser.add_argument("--kinds", nargs="+", default=["auto", "int8", "fp8"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="1: steadiest on a shared machine")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_kernels_available():
        raise SystemExit("the CPU kernels are not built here (an x86 CPU with AVX2 and a compiler)")
    for context in args.context:
        for seqs in args.concurrency:
            steps = {k: make_step(k, context, seqs, tuple(args.heads)) for k in args.kinds}
            best = {k: float("inf") for k in args.kinds}
            no_window = torch.tensor(0)
            for _ in range(args.rounds):
                for kind, (q, cache, tables, lens) in steps.items():
                    scales = kv_quant.kv_scales(cache)
                    start = time.perf_counter()
                    for _ in range(args.repeat):
                        paged_decode_attention(
                            q, cache[0], cache[1], tables, lens, 0.125, no_window, None, *scales
                        )
                    best[kind] = min(best[kind], (time.perf_counter() - start) / args.repeat)
            line = ", ".join(
                f"{k} {1e6 * best[k]:.0f} us ({best[args.kinds[0]] / best[k]:.2f}x)"
                for k in args.kinds
            )
            print(f"context {context} c={seqs}: {line}")


if __name__ == "__main__":
    main()
