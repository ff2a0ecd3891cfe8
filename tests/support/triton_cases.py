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
import random
import sys

import torch

from minivllm.layers.attention import kv_quant, triton_attention
from minivllm.layers.attention.sdpa import paged_attention_sdpa
from support.model_fixtures import (
    allocate_kv_caches,
    make_attention_metadata,
    shuffled_nan_cache,
)


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
    kv_cache_dtype: str = "auto",
) -> None:
    """One step over a cache holding each sequence's context, in shuffled blocks (the rest of
    the pool NaN, or for a quantized cache huge values, so a stray read shows), Triton in
    `dtype` on `device` against SDPA in fp32 on the CPU over the same cache."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    tables, k_cache, v_cache = shuffled_nan_cache(seq_lens, block_size, num_kv_heads, head_dim, rng)
    cache = (k_cache, v_cache)
    if kv_cache_dtype != "auto":
        cpu = torch.device("cpu")
        cache = kv_quant.allocate_kv_cache(k_cache.shape, kv_cache_dtype, torch.float32, cpu)
        for part in cache[:2]:  # codes 100, or fp8 bytes 0x64 (48.0)
            part.view(torch.uint8 if part.dtype == kv_quant.FP8 else torch.int8).fill_(100)
        for part in cache[2:]:
            part.fill_(1000.0)
    all_meta, _ = make_attention_metadata(tables, [0] * len(tables), seq_lens, block_size)
    total = sum(seq_lens)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen) * 2
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    kv_quant.store_kv(k, v, cache, all_meta.slot_mapping)
    meta, _ = make_attention_metadata(tables, context_lens, query_lens, block_size)
    q = torch.randn(meta.num_tokens, num_heads, head_dim, generator=gen) * 2
    scale = head_dim**-0.5
    scales = cache[2:] or None
    want = paged_attention_sdpa(q, *cache[:2], meta, scale, window, softcap, kv_scales=scales)
    on_device, _ = make_attention_metadata(tables, context_lens, query_lens, block_size, device)
    if kv_cache_dtype == "auto":
        cache = tuple(t.to(dtype) for t in cache)
    k_cache, v_cache, *scales = (t.to(device) for t in cache)
    got = triton_attention.paged_attention_triton(
        q.to(device, dtype),
        k_cache,
        v_cache,
        on_device,
        scale,
        window,
        softcap,
        num_splits=num_splits,
        k_scale=scales[0] if scales else None,
        v_scale=scales[1] if scales else None,
    )
    tolerance = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.cpu().float(), want, atol=tolerance, rtol=tolerance)


def model_steps(model_dir: str, kv_cache_dtype: str = "auto") -> None:
    """A tiny model's prefill (two prompts, one in two chunks) and decode steps with every
    attention layer on the Triton backend, against the same steps on SDPA: the backend as the
    layers call it (the step's K/V stored first, the output's shape and dtype), over a cache
    as computed or quantized (an int8 one with its turn of queries and keys, as bound)."""
    from minivllm.layers.attention import Attention
    from minivllm.layers.attention.backends import SDPA, TritonBackend
    from minivllm.models.loader import load_model

    model, config = load_model(model_dir, torch.float32, "cpu")
    head_dim = config.hidden_size // config.num_attention_heads
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    # each sequence's tokens over the steps: its prompt, then the tokens its decodes feed
    tokens = [[(7 * i + 3) % config.vocab_size for i in range(22)], [5, 9, 11, 2, 8, 4, 6]]
    tables = [[3, 0, 5], [1, 4]]
    steps = [([0, 0], [12, 5]), ([12, 5], [9, 1]), ([21, 6], [1, 1])]  # (context, new)
    shape = (6, 8, config.num_key_value_heads, head_dim)
    cpu = torch.device("cpu")
    hidden = {}
    for backend in (SDPA, TritonBackend()):
        for layer in layers:
            layer.backend = backend
            if kv_cache_dtype == "int8":
                layer.key_turn = kv_quant.key_rotation(head_dim, cpu)
        caches = allocate_kv_caches(config.num_hidden_layers, *shape)
        if kv_cache_dtype != "auto":
            caches = [
                kv_quant.allocate_kv_cache(shape, kv_cache_dtype, torch.float32, cpu)
                for _ in caches
            ]
        outs = []
        with torch.inference_mode():
            for context, new in steps:
                meta, positions = make_attention_metadata(tables, context, new, 8)
                ids = [t for s, c, n in zip(tokens, context, new) for t in s[c : c + n]]
                outs.append(model(torch.tensor(ids), positions, caches, meta))
        hidden[backend.name] = outs
    for want, got in zip(hidden["sdpa"], hidden["triton"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def main(cases: dict[str, dict]) -> dict[str, str | None]:
    """Each named case's `compare(**kwargs)` (or `model_steps`, for a case with a
    `model_dir`): None, or what failed."""
    results: dict[str, str | None] = {}
    for name, kwargs in cases.items():
        if "heads" in kwargs:
            kwargs = {**kwargs, "heads": tuple(kwargs["heads"])}
        try:
            model_steps(**kwargs) if "model_dir" in kwargs else compare(**kwargs)
            results[name] = None
        except Exception as error:  # reported to the test, which fails with it
            results[name] = f"{type(error).__name__}: {error}"
    return results


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
