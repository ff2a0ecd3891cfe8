"""Paged attention with and without splitting the batch into groups (`partition_batch`).

Runs `Attention` over 30 layers of SmolLM2-135M's shapes (9 heads, 3 KV heads, head_dim 64,
block size 16) for a few batch shapes, each three ways: the whole batch as one group, decodes
apart from prefills only, and minivllm's partition. Prints the best of 7 alternating runs.

    .venv/bin/python benchmarks/attention_groups.py [--overhead 512]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

import minivllm.layers.attention.metadata as attention_metadata
from minivllm.layers.attention import Attention, AttentionMetadata
from minivllm.layers.attention.partition import GROUP_OVERHEAD, partition_batch

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
LAYERS, REPEATS = 30, 7


def one_group(query_lens: list[int], seq_lens: list[int], overhead: int = 0) -> list[list[int]]:
    return [list(range(len(query_lens)))]


def kind_only(query_lens: list[int], seq_lens: list[int], overhead: int = 0) -> list[list[int]]:
    decodes = [i for i, q in enumerate(query_lens) if q == 1]
    prefills = [i for i, q in enumerate(query_lens) if q != 1]
    return [g for g in (decodes, prefills) if g]


def make_batch(seq_lens: list[int], query_lens: list[int]):
    """Random cache and step tensors; a function making fresh metadata (its caches are per
    step)."""
    torch.manual_seed(1)
    tables, next_block = [], 1
    for n in seq_lens:
        blocks = -(-n // BLOCK)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    k_cache = torch.randn(next_block, BLOCK, KV_HEADS, HEAD_DIM)
    v_cache = torch.randn_like(k_cache)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    slots = [
        table[p // BLOCK] * BLOCK + p % BLOCK
        for table, n, q in zip(tables, seq_lens, query_lens, strict=True)
        for p in range(n - q, n)
    ]

    def meta() -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor(starts),
            seq_lens=torch.tensor(seq_lens),
            block_tables=block_tables,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            block_size=BLOCK,
        )

    tokens = sum(query_lens)
    q = torch.randn(tokens, HEADS * HEAD_DIM)
    k = torch.randn(tokens, KV_HEADS * HEAD_DIM)
    v = torch.randn(tokens, KV_HEADS * HEAD_DIM)
    return q, k, v, (k_cache, v_cache), meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--overhead", type=int, default=GROUP_OVERHEAD)
    args = parser.parse_args()
    real = partition_batch

    def partition(query_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
        return real(query_lens, seq_lens, args.overhead)

    rng = random.Random(0)
    prefill_lens = [rng.randint(32, 256) for _ in range(16)]
    cases = [
        ("16 decodes, ctx 64-512", [rng.randint(64, 512) for _ in range(16)], [1] * 16),
        ("64 decodes, ctx 64-512", [rng.randint(64, 512) for _ in range(64)], [1] * 64),
        ("16 decodes, ctx 280-300", [rng.randint(280, 300) for _ in range(16)], [1] * 16),
        (
            "15 decodes + 256-token chunk",
            [rng.randint(64, 512) for _ in range(15)] + [256],
            [1] * 15 + [256],
        ),
        ("16 prefills, 32-256", prefill_lens, prefill_lens),
    ]
    layer = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    variants = [("one group", one_group), ("kind only", kind_only), ("minivllm", partition)]
    print(f"ms per step ({LAYERS} layers), best of {REPEATS}; overhead {args.overhead}")
    with torch.inference_mode():
        for name, seq_lens, query_lens in cases:
            q, k, v, cache, meta = make_batch(seq_lens, query_lens)
            best: dict[str, float] = {}
            for _ in range(REPEATS):
                for variant, fn in variants:
                    attention_metadata.partition_batch = fn
                    m = meta()
                    start = time.perf_counter()
                    for _ in range(LAYERS):
                        layer(q, k, v, cache, m)
                    ms = (time.perf_counter() - start) * 1e3
                    best[variant] = min(best.get(variant, float("inf")), ms)
            attention_metadata.partition_batch = real
            groups = len(partition(query_lens, seq_lens))
            ratio = best["one group"] / best["minivllm"]
            cells = "  ".join(f"{v}: {t:7.1f}" for v, t in best.items())
            print(f"{name:30s} {cells}  groups: {groups}  speed-up: {ratio:.2f}x", flush=True)


if __name__ == "__main__":
    main()
