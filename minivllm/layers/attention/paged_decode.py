"""A decode-only step's attention straight from the paged KV cache: our CPU kernel.

With one query per sequence, gathering every sequence's keys and values into a padded copy
and calling SDPA cost a step of many sequences more than its attention maths: the copy is
written and read again on every layer. `minivllm::paged_decode`
(`csrc/paged_decode.cpp`, built by `minivllm.layers.cpu_kernels`) reads each slot's key and
value rows once, through the block table, for the query heads of their KV head: windows and
soft-caps included, no copy, no mask.

It runs for models that compute in bf16 (`dtype="auto"` on a CPU with native bf16), over
their bf16 cache (an fp32 one too), the maths in fp32 as elsewhere on the CPU: each bf16 row is
widened as it is read. Models that compute in fp32 keep SDPA: its rounding is what the
token-exact HF parity tests pin, and with the kernel's sum order the int8 option's top-5 test
failed on an AVX2-only CPU (docs/benchmarks.md). Over an int8 or fp8 cache (`kv_quant.py`),
which no model is token-exact over anyway, it runs for every model: it reads the codes and
their scales in its dot products, where SDPA would dequantize every row it gathers."""

from __future__ import annotations

import torch

from minivllm.layers.attention.kv_quant import FP8
from minivllm.layers.cpu_kernels import cpu_kernels_available

QUANTIZED_KV = (torch.int8, FP8)


def paged_decode_supported(
    device: torch.device,
    model_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    head_dim: int,
    quantized: bool = False,
) -> bool:
    """Whether decode-only steps attend through the kernel: on the CPU, a bf16 model (or a
    `quantized` fp32 one, its weights run as stored blocks: not the dense fp32 path held
    token-exact to HF, whose attention is SDPA's) over a bf16 or fp32 cache, head sizes a
    multiple of 8, the kernels built; any model over an int8 or fp8 cache."""
    return (
        device.type == "cpu"
        and (
            model_dtype == torch.bfloat16
            or kv_dtype in QUANTIZED_KV
            or (quantized and model_dtype == torch.float32)
        )
        and kv_dtype in (torch.bfloat16, torch.float32, *QUANTIZED_KV)
        and head_dim % 8 == 0
        and cpu_kernels_available()
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: torch.Tensor,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`q` `[num_seqs, num_heads, head_dim]` (one token each) over the cache, which already
    holds this step's K/V, through `block_tables` `[num_seqs, max_blocks]` up to `seq_lens`
    `[num_seqs]` (an eager step's AttentionMetadata or the compiled step's DecodeMetadata
    carry both); `window`: the layer's sliding window as one int64 (0: none; `Attention.window`,
    data rather than a constant, so one compiled graph serves layers of either);
    `k_scale`/`v_scale` `[blocks, block_size, KVH]`: an int8 cache's. Returns
    `[num_seqs, num_heads, head_dim]`."""
    return torch.ops.minivllm.paged_decode(
        q.contiguous(),
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale,
        window,
        softcap or 0.0,
        k_scale,
        v_scale,
    )
