"""Our decode attention straight from the paged cache (`minivllm::paged_decode`): the same
output as the gather + SDPA path for bf16 models' decode-only steps, over fp32 and bf16 caches,
with grouped-query heads, sliding windows, soft-caps, scattered block tables, any thread
count; it reads only the slots a sequence owns (the rest of the cache is NaN); bad tables are
refused with a message."""

from __future__ import annotations

import platform

import pytest
import torch
from support.model_fixtures import allocate_kv_caches, make_attention_metadata

from minivllm.layers.attention import Attention
from minivllm.layers.attention.backends import SDPA, AttentionSpec, choose_backend
from minivllm.layers.attention.paged_decode import paged_decode_attention
from minivllm.layers.attention.sdpa import paged_attention_sdpa

pytestmark = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"), reason="an x86 (AVX2) kernel"
)


def _step(tables, context, kv_heads, dim, block, seed, dtype=torch.float32):
    """A decode-only step: caches NaN but for each sequence's context and new token."""
    gen = torch.Generator().manual_seed(seed)
    meta, _ = make_attention_metadata(tables, context, [1] * len(tables), block)
    k_cache, v_cache = allocate_kv_caches(1, 1 + max(max(t) for t in tables), block, kv_heads, dim)[
        0
    ]
    for cache in (k_cache, v_cache):
        for table, n in zip(tables, context, strict=True):
            for pos in range(n + 1):
                cache[table[pos // block], pos % block] = torch.randn(kv_heads, dim, generator=gen)
    return meta, k_cache.to(dtype), v_cache.to(dtype), gen


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 3.0), (7, 2.0)])
@pytest.mark.parametrize(
    "heads, kv_heads, dim, block",
    [(6, 2, 8, 4), (9, 3, 64, 16), (4, 4, 16, 1), (4, 2, 136, 4), (4, 1, 256, 16), (12, 2, 24, 4)],
)
def test_matches_the_gather_and_sdpa_path(
    kv_dtype, threads, window, softcap, heads, kv_heads, dim, block
):
    tables = [[3, 1, 4, 7, 9], [0, 2], [5], [8, 6, 10, 11, 12, 13, 14, 15, 16, 17]]
    tables = [t[: max(1, (len(t) * 4) // block)] for t in tables]
    context = [min(len(t) * block - 1, c) for t, c in zip(tables, [17, 6, 0, 35], strict=True)]
    meta, k_cache, v_cache, gen = _step(
        tables, context, kv_heads, dim, block, seed=heads, dtype=kv_dtype
    )
    q = torch.randn(len(tables), heads, dim, generator=gen)
    spec = AttentionSpec(torch.device("cpu"), torch.bfloat16, kv_dtype, dim, block)
    assert choose_backend(spec).name == "paged_decode"
    # SDPA over the same rows in fp32 (a bf16 cache's values widened exactly)
    want = paged_attention_sdpa(
        q, k_cache.float(), v_cache.float(), meta, dim**-0.5, window, softcap
    )
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = paged_decode_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            dim**-0.5,
            torch.tensor(window or 0),
            softcap,
        )
    finally:
        torch.set_num_threads(before)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _spec(model_dtype=torch.bfloat16, kv_dtype=torch.float32, head_dim=8):
    return AttentionSpec(torch.device("cpu"), model_dtype, kv_dtype, head_dim, 4)


def test_other_dtypes_and_head_sizes_keep_the_sdpa_backend():
    """fp32 models (the token-exact path), fp16 caches and odd head sizes get SDPA at load."""
    assert choose_backend(_spec()).name == "paged_decode"
    assert choose_backend(_spec(kv_dtype=torch.bfloat16)).name == "paged_decode"
    assert choose_backend(_spec(model_dtype=torch.float32)) is SDPA
    assert choose_backend(_spec(kv_dtype=torch.float16)) is SDPA
    assert choose_backend(_spec(head_dim=12)) is SDPA


def test_the_paged_decode_backend_sends_other_steps_to_sdpa():
    """A layer bound to the kernel attends a prefill (not decode-only) exactly as SDPA does."""
    prefill, _ = make_attention_metadata([[0, 1]], [2], [5], 4)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(5, n * 8, generator=gen) for n in (4, 2, 2))
    outs = []
    for backend in (choose_backend(_spec()), SDPA):
        layer = Attention(4, 2, 8, 8**-0.5)
        layer.backend = backend
        caches = allocate_kv_caches(1, 2, 4, 2, 8)[0]
        for cache in caches:
            cache[0, :2] = 1.0  # the cached context
        outs.append(layer(q, k, v, caches, prefill))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


NO_WINDOW = torch.tensor(0)


def test_bad_tables_are_refused_with_a_message():
    meta, k_cache, v_cache, _ = _step([[0, 1]], [5], 2, 8, 4, seed=1)
    q = torch.zeros(1, 4, 8)
    with pytest.raises(RuntimeError, match="window must be one int64"):
        torch.ops.minivllm.paged_decode(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 1.0, torch.tensor(5.0), 0.0
        )
    with pytest.raises(RuntimeError, match="not a block of the cache"):
        torch.ops.minivllm.paged_decode(
            q, k_cache, v_cache, torch.tensor([[0, 99]]), meta.seq_lens, 1.0, NO_WINDOW, 0.0
        )
    with pytest.raises(RuntimeError, match="outside its block table"):
        torch.ops.minivllm.paged_decode(
            q, k_cache, v_cache, meta.block_tables, torch.tensor([9]), 1.0, NO_WINDOW, 0.0
        )
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        torch.ops.minivllm.paged_decode(
            torch.zeros(1, 3, 8),
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            1.0,
            NO_WINDOW,
            0.0,
        )
    with pytest.raises(RuntimeError, match="int8 or float8_e4m3fn, both the same"):
        torch.ops.minivllm.paged_decode(
            q, k_cache.bfloat16(), v_cache, meta.block_tables, meta.seq_lens, 1.0, NO_WINDOW, 0.0
        )
