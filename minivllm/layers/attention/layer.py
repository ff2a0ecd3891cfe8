"""The attention layer: store the step's K/V in the paged cache, then attend.

A step writes its new K/V at `slot_mapping`, then every query token attends, causally, to its
own sequence's cached-plus-new tokens through the layer's backend, chosen once at load
(`backends.py`: flash-attn on CUDA, else our Triton kernel; our CPU kernel for bf16 models'
decode-only steps, else SDPA, one call per group of like sequences). The compiled decode step
hands it a `DecodeMetadata` instead, and it attends with `decode.py`, traced into the step's graph.
"""

import torch
from torch import nn

from minivllm.layers.attention.backends import (
    SDPA,
    AttentionBackend,
    AttentionSpec,
    choose_backend,
)
from minivllm.layers.attention.decode import DecodeMetadata, decode_attention
from minivllm.layers.attention.kv_quant import KVCache, as_read_back, key_rotation, store_kv
from minivllm.layers.attention.metadata import AttentionMetadata
from minivllm.layers.attention.sdpa import attention_dtype


class Attention(nn.Module):
    """Multi-head (or grouped-query) attention over a paged KV cache; no parameters.

    `forward(q [T, H*D], k [T, KVH*D], v [T, KVH*D], kv_cache, meta) -> [T, H*D]` stores the
    step's K/V in the cache (`kv_quant.KVCache`: an int8 one with its scales), then attends
    (see the module docstring).
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
        # The window again, as data for the paged decode kernel (0: none): a compiled layer
        # graph reads it as an input, so Gemma's sliding and full layers share one graph.
        self.register_buffer("window", torch.tensor(sliding_window or 0), persistent=False)
        self.logit_softcap = logit_softcap
        # The portable path until the runner binds the one for its device and dtypes.
        self.backend: AttentionBackend = SDPA
        # An int8 cache's turn of queries and keys (kv_quant.key_rotation), bound with it.
        self.key_turn: torch.Tensor | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata | DecodeMetadata,
    ) -> torch.Tensor:
        if isinstance(meta, DecodeMetadata):  # the compiled decode step
            return decode_attention(
                q,
                k,
                v,
                kv_cache,
                meta,
                self.scale,
                self.window,
                self.sliding_window,
                self.logit_softcap,
                self.key_turn,
            )
        num_tokens = q.shape[0]
        out_dtype = q.dtype
        # The attention maths run in fp32 on the CPU even for bf16 models (and bf16 caches).
        maths = attention_dtype(kv_cache[0], q.dtype)
        q = q.view(num_tokens, self.num_heads, self.head_dim).to(maths)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim).to(maths)  # [T, KVH, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim).to(maths)  # [T, KVH, D]
        if self.key_turn is not None:  # scores unchanged: both sides turn alike (in fp32)
            q, k = ((x.float() @ self.key_turn).to(maths) for x in (q, k))
        # From here on the step's K/V are what the cache gives back (a bf16 cache under fp32
        # maths rounds them), whether a backend reads them from the cache or as they are.
        k, v = (as_read_back(x, cache) for x, cache in zip((k, v), kv_cache))
        store_kv(k, v, kv_cache, meta.slot_mapping)
        out = self.backend.attend(self, q, k, v, kv_cache, meta)  # [T, H, D]
        return out.reshape(num_tokens, self.num_heads * self.head_dim).to(out_dtype)  # [T, H*D]

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"sliding_window={self.sliding_window}, logit_softcap={self.logit_softcap}, "
            f"backend={self.backend.name}"
        )


def bind_attention_backends(model: nn.Module, spec: AttentionSpec) -> set[str]:
    """Give every Attention layer of `model` its backend for `spec`, once, at load; returns
    the chosen backends' names."""
    chosen = set()
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = choose_backend(spec)
            module.key_turn = None
            if spec.kv_dtype == torch.int8:
                module.key_turn = key_rotation(module.head_dim, spec.device)
            chosen.add(module.backend.name)
    return chosen
