"""Run our Triton paged-attention kernel under Triton's interpreter against the SDPA backend,
in a process of its own: `python -m support.triton_cases '<json cases>'` prints, as JSON, each
case's error (null: it matched).

A process of its own because Triton decides between compiling and interpreting when a kernel,
or `triton.language` itself, is defined, and torch imports triton early: the interpreter has to
be on (`TRITON_INTERPRET=1`) before anything imports torch, which in a pytest session has long
happened, and it must not leak into the session's other tests.
"""

from __future__ import annotations

import json
import math
import random
import sys

import torch

from minivllm.layers.attention import triton_attention
from minivllm.layers.attention.sdpa import paged_attention_sdpa, store_kv
from support.model_fixtures import make_attention_metadata


def compare(
    context_lens: list[int],
    query_lens: list[int],
    *,
    heads: tuple[int, int] = (2, 1),
    head_dim: int = 16,
    block_size: int = 16,
    window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> None:
    """One step over a cache holding each sequence's context, in shuffled blocks (the rest of
    the pool NaN, so a stray read shows), Triton in `dtype` on `device` against SDPA in fp32
    on the CPU."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    needed = [math.ceil(n / block_size) for n in seq_lens]
    free = list(range(sum(needed) + 2))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in needed]
    shape = (sum(needed) + 2, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    all_meta, _ = make_attention_metadata(tables, [0] * len(tables), seq_lens, block_size)
    total = sum(seq_lens)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen) * 2
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    store_kv(k, v, k_cache, v_cache, all_meta.slot_mapping)
    meta, _ = make_attention_metadata(tables, context_lens, query_lens, block_size)
    q = torch.randn(meta.num_tokens, num_heads, head_dim, generator=gen) * 2
    scale = head_dim**-0.5
    want = paged_attention_sdpa(q, k_cache, v_cache, meta, scale, window, softcap)
    on_device, _ = make_attention_metadata(tables, context_lens, query_lens, block_size, device)
    got = triton_attention.paged_attention_triton(
        *(t.to(device, dtype) for t in (q, k_cache, v_cache)),
        on_device,
        scale,
        window,
        softcap,
        num_splits=num_splits,
    )
    tolerance = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.cpu().float(), want, atol=tolerance, rtol=tolerance)


def main(cases: dict[str, dict]) -> dict[str, str | None]:
    """Each named case's `compare(**kwargs)`: None, or what failed."""
    results: dict[str, str | None] = {}
    for name, kwargs in cases.items():
        if "heads" in kwargs:
            kwargs = {**kwargs, "heads": tuple(kwargs["heads"])}
        try:
            compare(**kwargs)
            results[name] = None
        except Exception as error:  # reported to the test, which fails with it
            results[name] = f"{type(error).__name__}: {error}"
    return results


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
