"""Paged attention with flash-attn's varlen kernel (CUDA, fp16/bf16, block_size a multiple of
256), reading the paged cache through the block table directly."""

import torch

from minivllm.layers.attention.metadata import AttentionMetadata

try:
    from flash_attn import flash_attn_varlen_func
except ImportError:  # CPU-only installs, or no flash-attn wheel for this GPU
    flash_attn_varlen_func = None

# flash-attn's paged-KV path requires the page (block) size to be a multiple of this.
FLASH_ATTN_BLOCK_MULTIPLE = 256


def paged_attention_flash(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """flash-attn varlen attention reading the paged cache through the block tables.

    `q` `[num_tokens, num_heads, head_dim]` -> `[num_tokens, num_heads, head_dim]`. flash-attn's
    `causal=True` aligns the mask bottom-right, i.e. the last query sees the last key; its
    `window_size=(w - 1, 0)` lets each query see itself and the `w - 1` keys before it.
    """
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
    return flash_attn_varlen_func(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q=meta.cu_seqlens_q_i32,
        cu_seqlens_k=meta.cu_seqlens_k_i32,
        max_seqlen_q=meta.max_query_len,
        max_seqlen_k=meta.max_seq_len,
        softmax_scale=scale,
        causal=True,
        window_size=window,
        softcap=0.0 if softcap is None else softcap,
        block_table=meta.block_tables_i32,
    )


def flash_attn_supported(device: torch.device, dtype: torch.dtype, block_size: int) -> bool:
    """Whether `paged_attention_flash` supports this device, maths dtype and block size."""
    return (
        flash_attn_varlen_func is not None
        and device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and block_size % FLASH_ATTN_BLOCK_MULTIPLE == 0
    )
