"""Paged attention over a block-structured KV cache, for batches mixing prefills and decodes.

- `metadata.py`: `AttentionMetadata`, the per-step inputs, and the index tensors derived from
  them (gather index, causal mask, query padding).
- `partition.py`: the batch split into groups of like sequences before the padded SDPA.
- `sdpa.py`: the portable path (torch's `scaled_dot_product_attention`, any device).
- `flash.py`: flash-attn's varlen kernel on CUDA.
- `triton_attention.py`, `triton_kernels.py`: our Triton paged-attention kernel (CUDA without
  flash-attn): prefill, decode with split keys, verify; tested under Triton's interpreter.
- `decode.py`: a decode-only step's attention as plain tensor maths, for the compiled step.
- `backends.py`: those paths as backends, one chosen per layer at load (`choose_backend`).
- `kv_quant.py`: what the cache stores (`kv_cache_dtype`: as computed, int8 with a scale per
  token and KV head, fp8) and how it is written and read back.
- `layer.py`: the `Attention` module: stores the step's K/V, then calls its backend.
"""

from minivllm.layers.attention.layer import Attention
from minivllm.layers.attention.metadata import AttentionMetadata

__all__ = ["Attention", "AttentionMetadata"]
