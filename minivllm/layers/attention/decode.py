"""Attention of a decode-only step written as plain tensor maths, for the compiled step.

Every sequence brings one query. Its keys and values are gathered through a precomputed slot
index, scored in fp32 on the CPU (`attention_dtype`), masked and softmaxed, and the values
summed: a few small ops that Inductor fuses into a handful of loops, where the eager
path (`sdpa.py`) pays a dispatch for each of a dozen ops per layer. `DecodeMetadata` carries
tensors only, so `torch.compile` traces through it without a graph break; the eager engine
never uses this path (see minivllm/engine/compiled_decode.py).
"""

from typing import NamedTuple

import torch

from minivllm.layers.activation import soft_cap
from minivllm.layers.attention.kv_quant import KVCache, gather_rows, kv_scales, store_kv
from minivllm.layers.attention.metadata import AttentionMetadata
from minivllm.layers.attention.paged_decode import paged_decode_attention
from minivllm.layers.attention.sdpa import attention_dtype


class DecodeMetadata(NamedTuple):
    """The inputs of a decode-only step's attention, shared by every layer: the gathered
    path's index tensors, or (`block_tables` given) our paged kernel's block tables."""

    slot_mapping: torch.Tensor  # [S] int64: the KV slot of each sequence's new token
    kv_index: torch.Tensor | None  # [S, L] int64: slot of key j of sequence s (clamped)
    kv_valid: torch.Tensor | None  # [S, L] bool: key j exists (j < seq_len)
    key_positions: torch.Tensor | None  # [L] int64: 0 .. L-1
    query_positions: torch.Tensor  # [S] int64: the new token's position (seq_len - 1)
    block_tables: torch.Tensor | None = None  # [S, B] int64: the paged kernel's path
    seq_lens: torch.Tensor | None = None  # [S] int64


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    meta: DecodeMetadata,
    scale: float,
    window: torch.Tensor,
    sliding_window: int | None = None,
    softcap: float | None = None,
    key_turn: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store the step's K/V, then attend: `q` `[S, H*D]`, `k`/`v` `[S, KVH*D]` -> `[S, H*D]`
    in q's dtype. Grouped-query heads share their KV head's keys without copies. `key_turn`:
    an int8 cache's rotation of queries and keys (kv_quant.key_rotation). `window`: the
    paged kernel's (`Attention.window`); the gathered path masks by `sliding_window`."""
    k_cache, v_cache = kv_cache[:2]
    num_kv_heads, head_dim = k_cache.shape[-2:]
    num_seqs = q.shape[0]
    group = q.shape[1] // (num_kv_heads * head_dim)
    maths = attention_dtype(k_cache, q.dtype)
    out_dtype = q.dtype
    q = q.view(num_seqs, -1, head_dim).to(maths)  # [S, H, D]
    new_k = k.view(num_seqs, num_kv_heads, head_dim)  # [S, KVH, D]
    new_v = v.view(num_seqs, num_kv_heads, head_dim)
    if key_turn is not None:
        q, new_k = q @ key_turn, new_k.to(maths) @ key_turn
    store_kv(new_k, new_v, kv_cache, meta.slot_mapping)
    if meta.block_tables is not None:  # our kernel reads the keys through the block tables
        out = paged_decode_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            scale,
            window,
            softcap,
            *kv_scales(kv_cache),
        )  # [S, H, D]
        return out.reshape(num_seqs, -1).to(out_dtype)  # [S, H*D]
    # the gathered path: the runner built all three index tensors (no block tables)
    assert meta.kv_index is not None and meta.kv_valid is not None
    assert meta.key_positions is not None
    keys = gather_rows(kv_cache, 0, meta.kv_index, maths)  # [S, L, KVH, D]
    values = gather_rows(kv_cache, 1, meta.kv_index, maths)  # [S, L, KVH, D]
    queries = q.view(num_seqs, num_kv_heads, group, head_dim)  # [S, KVH, G, D]
    # Products summed, not einsum: Inductor fuses them with the gathers into two loops, where a
    # batched matmul of [KVH] one-row matrices costs more in its call than in its maths.
    scores = (queries[:, None] * keys[:, :, :, None, :]).sum(-1) * scale  # [S, L, KVH, G]
    if softcap is not None:
        scores = soft_cap(scores, softcap)
    visible = meta.kv_valid  # [S, L]
    if sliding_window is not None:
        earliest = meta.query_positions - (sliding_window - 1)  # [S]
        visible = visible & (meta.key_positions[None, :] >= earliest[:, None])
    scores = scores.masked_fill(~visible[:, :, None, None], float("-inf"))
    weights = scores.softmax(1)  # [S, L, KVH, G]: over each query's keys
    out = (weights[..., None] * values[:, :, :, None, :]).sum(1)  # [S, KVH, G, D]
    return out.reshape(num_seqs, -1).to(out_dtype)  # [S, H*D]


def decode_metadata(meta: AttentionMetadata, paged: bool = False) -> DecodeMetadata:
    """The tensors the compiled step's attention reads, from a decode-only step's metadata:
    the block tables for our paged kernel (`paged`), else the gathered path's indices.

    With the paged kernel a sequence may bring several tokens over its cached context (a
    verifying step's last token and drafts): each token becomes a row of its own, reading its
    sequence's block table up to its own position. A layer stores every new token's K/V before
    it attends, so row i sees its sequence's keys up to and including token i: causal."""
    if paged:
        tables, lens = meta.block_tables, meta.seq_lens  # one token a sequence: as they are
        if not meta.is_decode_only:  # a row a token
            new = meta.query_lens  # [S]
            seq = torch.repeat_interleave(torch.arange(meta.num_seqs, device=new.device), new)
            offset = torch.arange(meta.num_tokens, device=new.device) - meta.query_start_loc[seq]
            tables, lens = tables[seq], (lens - new)[seq] + offset + 1  # [T, B], [T]
        return DecodeMetadata(
            slot_mapping=meta.slot_mapping,
            kv_index=None,
            kv_valid=None,
            key_positions=None,
            query_positions=lens - 1,
            block_tables=tables,
            seq_lens=lens,
        )
    index = meta.kv_gather_index  # [S, L]
    key_positions = torch.arange(index.shape[1], device=index.device)  # [L]
    return DecodeMetadata(
        slot_mapping=meta.slot_mapping,
        kv_index=index,
        kv_valid=key_positions[None, :] < meta.seq_lens[:, None],  # [S, L]
        key_positions=key_positions,
        query_positions=meta.seq_lens - 1,
    )
