"""A decode-only step's attention straight from the paged KV cache: our CPU kernel.

With one query per sequence, gathering every sequence's keys and values into a padded copy
and calling SDPA cost a step of 16 sequences at 200 tokens of context more than its attention
maths (on an AVX2 CPU: the gathers ~25 ms and SDPA ~30 ms of a ~260 ms step;
docs/benchmarks.md). `minivllm::paged_decode` (`csrc/paged_decode.cpp`, built by
`minivllm.layers.cpu_kernels`) reads each key and value row once per KV head, through the
block table, for that head's group of query heads, in fp32: windows and soft-caps included,
no copy, no mask. It applies on the CPU to fp32 caches (every CPU model's) and head sizes
that are a multiple of 8; elsewhere the SDPA path runs.
"""

from __future__ import annotations

import torch

from minivllm.layers.attention.metadata import AttentionMetadata
from minivllm.layers.cpu_kernels import cpu_kernels_available


def paged_decode_applies(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether this step's attention runs on the kernel: decode-only, on the CPU, fp32."""
    return (
        meta.is_decode_only
        and q.device.type == "cpu"
        and k_cache.dtype == torch.float32
        and q.dtype == torch.float32
        and q.shape[-1] % 8 == 0
        and cpu_kernels_available()
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """`q` `[num_seqs, num_heads, head_dim]` (one token each) over the cache, which already
    holds this step's K/V; returns `[num_seqs, num_heads, head_dim]`."""
    return torch.ops.minivllm.paged_decode(
        q.contiguous(), k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
        sliding_window or 0, softcap or 0.0,
    )
