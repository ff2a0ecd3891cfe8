"""Paged attention with our Triton kernel (CUDA without flash-attn): the host side.

`paged_attention_triton` launches `triton_kernels.paged_attention_kernel` over a step's
queries: prefills over cached context (prefix cache, earlier chunks), decodes and the
multi-query verify step of speculative decoding alike, K/V read through the block tables.
Decode and verify steps over long contexts split each sequence's keys across programs
(flash-decoding) so that a small batch still fills the GPU; `reduce_splits` combines them.

The tile sizes and the split count are small pure functions (`tile_sizes`, `num_kv_splits`),
tested on the CPU; the kernel itself runs there under Triton's interpreter
(`TRITON_INTERPRET=1`, tests/layers/test_triton_attention.py). Triton is imported only when a
kernel is launched, so a CPU install needs none.
"""

from __future__ import annotations

import importlib.util

import torch

from minivllm.layers.attention.metadata import AttentionMetadata

# Rows (query tokens x the query heads of one KV head) of a prefill program's tile.
PREFILL_BLOCK_M = 64
# Keys per inner-loop tile.
BLOCK_N = 64
# Programs a decode step should launch before its keys are split: a few waves of an H200's
# 132 SMs.
TARGET_PROGRAMS = 512
# No split covers fewer keys than this: each split's partial output costs a write and a read.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 32
MAX_HEAD_DIM = 256
FP8 = torch.float8_e4m3fn
# The kernel's `KV_QUANT` for a cache's dtype (a floating-point cache as computed: 0).
KV_QUANT = {torch.int8: 1, FP8: 2}


def triton_available() -> bool:
    """Whether `triton` can be imported (it ships inside torch's CUDA wheels), found without
    importing it: importing it decides, once, whether its kernels compile or are interpreted."""
    return importlib.util.find_spec("triton") is not None


def triton_attention_supported(
    device: torch.device, kv_dtype: torch.dtype, head_dim: int, available: bool | None = None
) -> bool:
    """Whether `paged_attention_triton` runs a layer: CUDA with triton, a cache as computed
    (fp16, bf16, fp32) or quantized (int8 with its scales, fp8 e4m3), head sizes to 256."""
    available = triton_available() if available is None else available
    return (
        available
        and device.type == "cuda"
        and kv_dtype in (torch.float16, torch.bfloat16, torch.float32, torch.int8, FP8)
        and head_dim <= MAX_HEAD_DIM
    )


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def tile_sizes(max_query_len: int, group: int) -> tuple[int, int]:
    """`(BLOCK_Q, BLOCK_M)`: new tokens per program and its rows (`BLOCK_Q * group` padded to
    a power of two, at least 16 for `tl.dot`). A decode step takes one token a program; a
    prefill or verify step as many as fill `PREFILL_BLOCK_M` rows."""
    if max_query_len == 1:
        block_q = 1
    else:
        block_q = max(1, min(next_power_of_2(max_query_len), PREFILL_BLOCK_M // group))
    return block_q, max(16, next_power_of_2(block_q * group))


def num_kv_splits(num_programs: int, max_seq_len: int) -> int:
    """Splits of each sequence's keys for a step launching `num_programs` without splitting:
    enough to reach `TARGET_PROGRAMS`, no split under `MIN_KEYS_PER_SPLIT` keys, a power of two
    (1: no split, the kernel normalises its own output)."""
    want = max(1, TARGET_PROGRAMS // max(1, num_programs))
    fit = max(1, max_seq_len // MIN_KEYS_PER_SPLIT)
    splits = min(want, fit, MAX_SPLITS)
    return 1 << (splits.bit_length() - 1)


def reduce_splits(
    partial: torch.Tensor, maxes: torch.Tensor, sums: torch.Tensor, head_dim: int
) -> torch.Tensor:
    """Combine the splits' unnormalised outputs `[T, H, S, D_PAD]` with their running maxima
    and sums `[T, H, S]` (a split that saw no key: -inf and 0) -> fp32 `[T, H, D]`."""
    top = maxes.amax(-1, keepdim=True)  # [T, H, 1]; finite: every query sees itself
    weights = torch.exp(maxes - top)  # [T, H, S]; 0 for an empty split
    total = (sums * weights).sum(-1)  # [T, H]
    out = (partial[..., :head_dim] * weights[..., None]).sum(-2)  # [T, H, D]
    return out / total[..., None]


def _cache_args(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The kernel's cache arguments: K, V (fp8 as its bytes), the int8 scales (else K again,
    never read) and `KV_QUANT`; a cache the kernel cannot read is a ValueError."""
    kind = KV_QUANT.get(k_cache.dtype, 0)
    if not (kind or k_cache.dtype.is_floating_point):
        raise ValueError(f"the Triton attention backend cannot read a {k_cache.dtype} KV cache")
    if (k_scale is None) != (kind != 1) or (v_scale is None) != (kind != 1):
        raise ValueError("the Triton attention backend needs scales with an int8 cache only")
    tensors = [k_cache, v_cache] + ([k_scale, v_scale] if kind == 1 else [])
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("the Triton attention backend reads a contiguous KV cache")
    if kind == 2:  # the kernel widens the bytes itself (`_load_rows`)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    if kind != 1:
        k_scale = v_scale = k_cache
    return k_cache, v_cache, k_scale, v_scale, kind


def _output_buffers(
    q: torch.Tensor, num_splits: int, head_dim_pad: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the kernel writes: the output `[T, H, D]` (no split: it normalises, no stats), or
    each split's fp32 partial output `[T, H, S, D_PAD]`, running max and sum `[T, H, S]`."""
    if num_splits == 1:
        out = torch.empty_like(q)
        return out, out, out
    num_tokens, num_heads, _ = q.shape
    out = q.new_empty(num_tokens, num_heads, num_splits, head_dim_pad, dtype=torch.float32)
    maxes = q.new_empty(num_tokens, num_heads, num_splits, dtype=torch.float32)
    return out, maxes, torch.empty_like(maxes)


def _launch_shape(
    q: torch.Tensor, meta: AttentionMetadata, num_kv_heads: int, num_splits: int | None
) -> tuple[tuple[int, int, int], dict[str, int]]:
    """The kernel's grid (sequence, query tile, KV head x split) and tile constants for a
    step's queries `q` `[T, H, D]`; `num_splits` None: only decode steps split, by
    `num_kv_splits` (prefills have tiles to spare)."""
    num_heads, head_dim = q.shape[1:]
    group = num_heads // num_kv_heads
    block_q, block_m = tile_sizes(meta.max_query_len, group)
    if num_splits is None:
        programs = meta.num_seqs * num_kv_heads
        num_splits = num_kv_splits(programs, meta.max_seq_len) if meta.is_decode_only else 1
    grid = (meta.num_seqs, -(-meta.max_query_len // block_q), num_kv_heads * num_splits)
    return grid, {
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": max(16, next_power_of_2(head_dim)),
        "NUM_KV_HEADS": num_kv_heads,
        "GROUP": group,
        "BLOCK_Q": block_q,
        "BLOCK_M": block_m,
        "BLOCK_N": BLOCK_N,
        "BLOCK_SIZE": meta.block_size,
        "NUM_SPLITS": num_splits,
    }


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of `q` `[T, H, D]` over the paged cache (which already holds the step's K/V):
    each new token of a sequence sees its cached context and the new tokens up to itself
    (its last `sliding_window` keys when given; scores soft-capped at `softcap` when given).
    `num_splits`: how many programs share a sequence's keys (None: `num_kv_splits` decides,
    for decode steps only). An int8 cache comes with its scales `[blocks, block_size, KVH]`
    (`kv_quant`). Returns `[T, H, D]` in `q`'s dtype."""
    from minivllm.layers.attention.triton_kernels import paged_attention_kernel

    k_cache, v_cache, k_scale, v_scale, kv_quant = _cache_args(k_cache, v_cache, k_scale, v_scale)
    grid, tiles = _launch_shape(q, meta, k_cache.shape[-2], num_splits)
    num_splits = tiles["NUM_SPLITS"]
    q = q.contiguous()  # [T, H, D]
    out, maxes, sums = _output_buffers(q, num_splits, tiles["HEAD_DIM_PAD"])
    tables = meta.block_tables.contiguous()  # [S, max_blocks]
    paged_attention_kernel[grid](
        out,
        maxes,
        sums,
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale,
        1.0 if softcap is None else softcap,
        0 if sliding_window is None else sliding_window,
        tables.shape[1],
        **tiles,
        USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=softcap is not None,
        IEEE_DOT=q.dtype == torch.float32,
        KV_QUANT=kv_quant,
    )
    if num_splits == 1:
        return out
    return reduce_splits(out, maxes, sums, tiles["HEAD_DIM"]).to(q.dtype)
