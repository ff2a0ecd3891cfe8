"""Paged attention with torch's `scaled_dot_product_attention` (any device).

Gather each sequence's K/V through its block table into `[num_seqs, max_seq_len, ...]`, pad the
queries to `[num_seqs, max_query_len, ...]`, and make one SDPA call with a boolean causal mask.
All-decode batches skip the query padding; a lone prefill with no cached context attends over
its own new K/V directly.
"""

import torch
import torch.nn.functional as F

from minivllm.layers.activation import soft_cap
from minivllm.layers.attention import kv_quant
from minivllm.layers.attention.metadata import AttentionMetadata


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new keys/values `[num_tokens, num_kv_heads, head_dim]` into their cache slots (in
    the cache's dtype; a cache with scales goes through `kv_quant.store_kv`)."""
    kv_quant.store_kv(k, v, (k_cache, v_cache), slot_mapping)


def attention_dtype(cache: torch.Tensor, compute: torch.dtype) -> torch.dtype:
    """The dtype of the attention maths over `cache` for a model computing in `compute`: fp32
    on the CPU, where torch's SDPA with bf16 inputs is several times slower than with fp32 at
    decode (docs/benchmarks.md), whatever the cache holds; elsewhere the cache's dtype
    (flash-attn reads bf16/fp16), or for an int8 or fp8 cache the model's."""
    if cache.device.type == "cpu":
        return torch.float32
    return cache.dtype if cache.dtype in (torch.float16, torch.bfloat16, torch.float32) else compute


def paged_attention_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of `q` `[num_tokens, num_heads, head_dim]` over the paged cache (which already
    holds this step's K/V), each query seeing its last `sliding_window` keys when given, with
    scores soft-capped at `softcap` when given; `kv_scales`: an int8 cache's. Returns
    `[num_tokens, num_heads, head_dim]`."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[-2]
    num_seqs, max_q = meta.num_seqs, meta.max_query_len
    index, mask = meta.kv_view(sliding_window)  # a window gathers only the keys it can see
    max_kv = index.shape[1]
    gather = index.view(-1)  # [S * max_kv]
    k, v = _gather_kv(k_cache, v_cache, kv_scales, meta, gather, max_kv, q.dtype)
    # [S, max_kv, KVH, D], in q's dtype (a bf16 cache's rows widened for fp32 maths)
    k = k.view(num_seqs, max_kv, num_kv_heads, head_dim).to(q.dtype)
    v = v.view(num_seqs, max_kv, num_kv_heads, head_dim).to(q.dtype)

    if meta.is_decode_only:
        # One query per sequence: fold each KV head's group of query heads into the query
        # dim, so SDPA reads every K/V once instead of expanding them for GQA (same mask row).
        group = num_heads // num_kv_heads
        q_folded = q.view(num_seqs, num_kv_heads, group, head_dim)  # [S, KVH, G, D]
        out = attend(
            q_folded,
            k.transpose(1, 2),  # [S, KVH, max_kv, D]
            v.transpose(1, 2),  # [S, KVH, max_kv, D]
            mask,  # [S, 1, 1, max_kv]
            scale,
            softcap,
        )  # [S, KVH, G, D]
        return out.reshape(num_tokens, num_heads, head_dim)  # [T, H, D]

    q_padded = q.new_zeros(num_seqs * max_q, num_heads, head_dim)
    q_padded.index_copy_(0, meta.query_pad_index, q)  # [S * max_q, H, D]
    q_padded = q_padded.view(num_seqs, max_q, num_heads, head_dim)  # [S, max_q, H, D]

    out = attend(
        q_padded.transpose(1, 2),  # [S, H, max_q, D]
        k.transpose(1, 2),  # [S, KVH, max_kv, D]
        v.transpose(1, 2),  # [S, KVH, max_kv, D]
        mask,  # [S, 1, max_q, max_kv]
        scale,
        softcap,
    )  # [S, H, max_q, D]
    out = out.transpose(1, 2)  # [S, max_q, H, D]
    out = out.reshape(num_seqs * max_q, num_heads, head_dim)  # [S * max_q, H, D]
    return out.index_select(0, meta.query_pad_index)  # [T, H, D]


def _gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
    meta: AttentionMetadata,
    gather: torch.Tensor,
    max_kv: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V rows at slots `gather`, `[len(gather), KVH, D]`: a quantized cache's widened to
    `dtype` (only the rows read are dequantized), others into the step's scratch buffers."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    if k_cache.dtype in (torch.int8, kv_quant.FP8):
        cache = (k_cache, v_cache) + (kv_scales or ())
        return (
            kv_quant.gather_rows(cache, 0, gather, dtype),
            kv_quant.gather_rows(cache, 1, gather, dtype),
        )
    k_buf, v_buf = meta.kv_gather_buffers(k_cache, max_kv)
    k = torch.index_select(k_cache.view(-1, num_kv_heads, head_dim), 0, gather, out=k_buf)
    v = torch.index_select(v_cache.view(-1, num_kv_heads, head_dim), 0, gather, out=v_buf)
    return k, v


def causal_attention_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Plain causal attention of one sequence's tokens among themselves (no cached context).

    `q` `[T, H, D]`, `k`/`v` `[T, KVH, D]` -> `[T, H, D]`; no gather, no mask tensor.
    """
    # Batched (4-d) inputs: torch's CPU flash kernel takes only those; 3-d ones fall back to
    # the math path, which spells out the [H, T, T] scores and runs at a third of the speed.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, H, T, D]
        k.transpose(0, 1).unsqueeze(0),  # [1, KVH, T, D]
        v.transpose(0, 1).unsqueeze(0),  # [1, KVH, T, D]
        is_causal=True,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )  # [1, H, T, D]
    return out[0].transpose(0, 1)  # [T, H, D]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Masked attention `[B, H, Q, D]` over `k`/`v` `[B, KVH, K, D]` (grouped-query when
    KVH < H): torch's SDPA, or, with `softcap`, the scores spelled out so they can be capped
    (`softcap * tanh(s / softcap)`, Gemma 2) before the float32 softmax, as HF's eager path."""
    num_heads, num_kv_heads = q.shape[-3], k.shape[-3]
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=-3)  # [B, H, K, D]
    v = v.repeat_interleave(group, dim=-3)  # [B, H, K, D]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, H, Q, K]
    scores = soft_cap(scores, softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype), v)  # [B, H, Q, D]
