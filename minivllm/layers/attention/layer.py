"""The attention layer: store the step's K/V in the paged cache, then attend.

A step writes its new K/V at `slot_mapping`, then every query token attends, causally, to its
own sequence's cached-plus-new tokens, with flash-attn where it applies (`flash.py`), our CPU
kernel for bf16 models' decode-only steps (`paged_decode.py`), and otherwise with SDPA
(`sdpa.py`), one call per group of like sequences (`partition.py`). The compiled decode step
hands it a `DecodeMetadata` instead, and it attends with `decode.py`.
"""

import torch
from torch import nn

from minivllm.layers.attention.decode import DecodeMetadata, decode_attention
from minivllm.layers.attention.flash import can_use_flash_attn, paged_attention_flash
from minivllm.layers.attention.metadata import AttentionMetadata
from minivllm.layers.attention.paged_decode import paged_decode_applies, paged_decode_attention
from minivllm.layers.attention.sdpa import (
    attention_dtype,
    causal_attention_sdpa,
    paged_attention_sdpa,
    store_kv,
)


class Attention(nn.Module):
    """Multi-head (or grouped-query) attention over a paged KV cache; no parameters.

    `forward(q [T, H*D], k [T, KVH*D], v [T, KVH*D], (k_cache, v_cache), meta) -> [T, H*D]`
    stores the step's K/V in the cache, then attends (see the module docstring).
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        """`sliding_window`: each query sees only its last `sliding_window` keys (itself
        included); `logit_softcap`: scores become `cap * tanh(score / cap)` before the softmax."""
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive integer, got {sliding_window}")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata | DecodeMetadata,
    ) -> torch.Tensor:
        if isinstance(meta, DecodeMetadata):  # the compiled decode step
            return decode_attention(
                q, k, v, kv_cache, meta, self.scale, self.sliding_window, self.logit_softcap
            )
        num_tokens = q.shape[0]
        k_cache, v_cache = kv_cache
        out_dtype = q.dtype
        # The attention maths run in fp32 on the CPU even for bf16 models (and bf16 caches).
        maths = attention_dtype(k_cache)
        q = q.view(num_tokens, self.num_heads, self.head_dim).to(maths)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim).to(maths)  # [T, KVH, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim).to(maths)  # [T, KVH, D]
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if can_use_flash_attn(q, meta.block_size):
            out = paged_attention_flash(
                q, k_cache, v_cache, meta, self.scale, self.sliding_window, self.logit_softcap
            )
            return out.reshape(num_tokens, self.num_heads * self.head_dim)  # [T, H*D]
        if paged_decode_applies(out_dtype, q, k_cache, meta):
            out = paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale,
                self.sliding_window, self.logit_softcap,
            )
            return out.reshape(num_tokens, self.num_heads * self.head_dim).to(out_dtype)
        groups = meta.groups
        if len(groups) == 1:
            out = self._attend_sdpa(q, k, v, kv_cache, meta)
        else:
            out = torch.empty_like(q)  # [T, H, D]
            for tokens, sub in groups:
                part = self._attend_sdpa(
                    q.index_select(0, tokens), k.index_select(0, tokens),
                    v.index_select(0, tokens), kv_cache, sub,
                )
                out.index_copy_(0, tokens, part)
        return out.reshape(num_tokens, self.num_heads * self.head_dim).to(out_dtype)  # [T, H*D]

    def _attend_sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """One group's attention, `[T, H, D]`: without the cache for a lone prefill that has no
        context (and needs no window or cap), else through the paged cache."""
        window = self.sliding_window
        if (
            meta.is_single_prefill_without_context
            and self.logit_softcap is None
            and (window is None or meta.max_seq_len <= window)
        ):
            return causal_attention_sdpa(q, k, v, self.scale)
        return paged_attention_sdpa(
            q, kv_cache[0], kv_cache[1], meta, self.scale, window, self.logit_softcap
        )

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"sliding_window={self.sliding_window}, logit_softcap={self.logit_softcap}"
        )
