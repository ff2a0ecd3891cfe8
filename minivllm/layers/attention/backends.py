"""The attention backends, and the one place a layer's backend is chosen: at load.

Each backend attends a step's queries over the paged cache, which already holds the step's
K/V: `attend(layer, q, k, v, kv_cache, meta) -> out`, `q` and `out` `[T, H, D]` in the
attention maths' dtype. `choose_backend` picks the first backend of `BACKENDS` that supports
the layer's fixed facts (`AttentionSpec`: device, dtypes, head size, block size); the
runner binds it to every `Attention` layer once, after loading (`bind_attention_backends` in
`layer.py`), and a layer built on its own (the layer tests) keeps the portable `SDPA`. Within
a backend only the step's shape still decides (a decode-only step, a lone prefill without
context).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from minivllm.layers.attention.flash import flash_attn_supported, paged_attention_flash
from minivllm.layers.attention.kv_quant import KVCache, kv_scales
from minivllm.layers.attention.metadata import AttentionMetadata
from minivllm.layers.attention.paged_decode import paged_decode_attention, paged_decode_supported
from minivllm.layers.attention.sdpa import causal_attention_sdpa, paged_attention_sdpa
from minivllm.layers.attention.triton_attention import (
    paged_attention_triton,
    triton_attention_supported,
)


@dataclass(frozen=True)
class AttentionSpec:
    """What a layer's backend is chosen from: fixed for the engine's life."""

    device: torch.device
    model_dtype: torch.dtype  # the layer's inputs and outputs
    kv_dtype: torch.dtype  # the cache's
    head_dim: int
    block_size: int


class AttentionLayer(Protocol):
    """A layer's options a backend reads (`Attention`'s)."""

    scale: float
    sliding_window: int | None
    window: torch.Tensor  # the sliding window as one int64 (0: none), for the paged kernel
    logit_softcap: float | None


class AttentionBackend(Protocol):
    name: str

    def supports(self, spec: AttentionSpec) -> bool:
        """Whether this backend runs a layer of `spec`."""
        ...

    def attend(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """`q` `[T, H, D]` (and the step's `k`, `v` `[T, KVH, D]`, already in the cache)
        -> `[T, H, D]`, all in the attention maths' dtype."""
        ...


class SdpaBackend:
    """The portable path (any device): SDPA over K/V gathered through the block tables, one
    call per group of like sequences; a lone prefill without context attends over its own
    new K/V, without the cache."""

    name = "sdpa"

    def supports(self, spec: AttentionSpec) -> bool:
        return True

    def attend(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        groups = meta.groups
        if len(groups) == 1:
            return self._attend_group(layer, q, k, v, kv_cache, meta)
        out = torch.empty_like(q)  # [T, H, D]
        for tokens, sub in groups:
            part = self._attend_group(
                layer,
                q.index_select(0, tokens),
                k.index_select(0, tokens),
                v.index_select(0, tokens),
                kv_cache,
                sub,
            )
            out.index_copy_(0, tokens, part)
        return out

    @staticmethod
    def _attend_group(
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """One group's attention, `[T, H, D]`: without the cache for a lone prefill that has no
        context (and needs no window or cap), else through the paged cache."""
        window = layer.sliding_window
        if (
            meta.is_single_prefill_without_context
            and layer.logit_softcap is None
            and (window is None or meta.max_seq_len <= window)
        ):
            return causal_attention_sdpa(q, k, v, layer.scale)
        k_scale, v_scale = kv_scales(kv_cache)
        return paged_attention_sdpa(
            q,
            kv_cache[0],
            kv_cache[1],
            meta,
            layer.scale,
            window,
            layer.logit_softcap,
            None if k_scale is None or v_scale is None else (k_scale, v_scale),
        )


class FlashBackend:
    """flash-attn's varlen kernel on CUDA, reading the paged cache through the block tables."""

    name = "flash"

    def supports(self, spec: AttentionSpec) -> bool:
        # on CUDA the maths run in the cache's dtype
        return flash_attn_supported(spec.device, spec.kv_dtype, spec.block_size)

    def attend(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return paged_attention_flash(
            q,
            kv_cache[0],
            kv_cache[1],
            meta,
            layer.scale,
            layer.sliding_window,
            layer.logit_softcap,
        )


class TritonBackend:
    """Our Triton kernel on CUDA where flash-attn is not installed, or the cache is int8 or
    fp8: every step (prefill over cached context, decode with its keys split across programs,
    verify) straight from the paged cache through the block tables, as stored."""

    name = "triton"

    def supports(self, spec: AttentionSpec) -> bool:
        return triton_attention_supported(spec.device, spec.kv_dtype, spec.head_dim)

    def attend(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        k_scale, v_scale = kv_scales(kv_cache)
        return paged_attention_triton(
            q,
            kv_cache[0],
            kv_cache[1],
            meta,
            layer.scale,
            layer.sliding_window,
            layer.logit_softcap,
            k_scale=k_scale,
            v_scale=v_scale,
        )


class PagedDecodeBackend:
    """bf16 models (and any model over an int8 or fp8 cache) on the CPU: decode-only steps
    through our kernel straight from the paged cache (no gathered copy); other steps through
    SDPA."""

    name = "paged_decode"

    def supports(self, spec: AttentionSpec) -> bool:
        return paged_decode_supported(spec.device, spec.model_dtype, spec.kv_dtype, spec.head_dim)

    def attend(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if not meta.is_decode_only:
            return SDPA.attend(layer, q, k, v, kv_cache, meta)
        return paged_decode_attention(
            q,
            kv_cache[0],
            kv_cache[1],
            meta.block_tables,
            meta.seq_lens,
            layer.scale,
            layer.window,
            layer.logit_softcap,
            *kv_scales(kv_cache),
        )


SDPA = SdpaBackend()
# In order of preference: the first that supports a layer's spec is its backend.
BACKENDS: tuple[AttentionBackend, ...] = (
    FlashBackend(),
    TritonBackend(),
    PagedDecodeBackend(),
    SDPA,
)


def choose_backend(spec: AttentionSpec) -> AttentionBackend:
    """The first backend of BACKENDS that supports `spec` (SDPA supports every spec)."""
    return next(backend for backend in BACKENDS if backend.supports(spec))
