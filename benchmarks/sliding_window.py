"""A sliding-window layer against a full-attention one, on the CPU path.

One attention layer (SmolLM2-135M's shapes: 9 heads, 3 KV heads, head_dim 64, block size 16)
for a decode step of 16 sequences at 2048 tokens of context, and for a 256-token prefill chunk
after 2048 cached tokens: full attention gathers and scores every cached key, a window of 256
only the keys its queries can see (`AttentionMetadata.kv_view`). Prints the best of 20 runs,
the two alternating.

    .venv/bin/python benchmarks/sliding_window.py
"""

from __future__ import annotations

import itertools
import time

import torch

from minivllm.layers.attention import Attention, AttentionMetadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK, CONTEXT, WINDOW, REPEATS = 9, 3, 64, 16, 2048, 256, 20


def metadata(context_lens: list[int], query_lens: list[int]) -> AttentionMetadata:
    """Sequence i owns a contiguous run of blocks; fresh per step (its caches are per step)."""
    per_seq = (max(c + q for c, q in zip(context_lens, query_lens)) + BLOCK - 1) // BLOCK
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    slots = [
        i * per_seq * BLOCK + p
        for i, (c, q) in enumerate(zip(context_lens, query_lens))
        for p in range(c, c + q)
    ]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(list(itertools.accumulate(query_lens, initial=0))),
        seq_lens=torch.tensor(seq_lens),
        block_tables=torch.tensor(
            [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(seq_lens))]
        ),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        block_size=BLOCK,
    )


def run(name: str, context_lens: list[int], query_lens: list[int]) -> None:
    torch.manual_seed(0)
    blocks = len(context_lens) * ((CONTEXT + max(query_lens)) // BLOCK + 1)
    cache = tuple(torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM) for _ in range(2))
    tokens = sum(query_lens)
    q = torch.randn(tokens, HEADS * HEAD_DIM)
    k, v = torch.randn(2, tokens, KV_HEADS * HEAD_DIM)
    layers = {w: Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, w) for w in (None, WINDOW)}
    best = dict.fromkeys(layers, float("inf"))
    for _ in range(REPEATS):
        for window, layer in layers.items():
            meta = metadata(context_lens, query_lens)
            start = time.perf_counter()
            layer(q, k, v, cache, meta)
            best[window] = min(best[window], time.perf_counter() - start)
    full, windowed = best[None] * 1e3, best[WINDOW] * 1e3
    print(f"{name}: full {full:.2f} ms, window {WINDOW} {windowed:.2f} ms, {full / windowed:.1f}x")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    run("16 decodes at 2048", [CONTEXT] * 16, [1] * 16)
    run("a 256-token chunk after 2048", [CONTEXT], [256])
