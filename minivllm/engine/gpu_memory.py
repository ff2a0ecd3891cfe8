"""The KV pool on a GPU, sized after a profiled peak, as vLLM does.

`gpu_memory_utilization` is the share of the GPU's memory the engine may take. Of it, the KV
pool gets what is left once the weights, the activations' peak and the memory torch does not
allocate (the CUDA context, libraries' workspaces) are counted. The peak is measured, not
guessed: `profile_activation_peak` runs one forward of the largest step the scheduler can plan
(`max_num_batched_tokens` new tokens, the LM head over `max_num_seqs` rows) over a one-block
cache (every position's block table entry points at it: the kernels read real memory) and
reads `torch.cuda.max_memory_allocated`. The arithmetic (`kv_budget_after_peak`) and the log
line are plain code, tested on the CPU with made-up numbers (tests/engine/test_gpu_memory.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from minivllm.config import EngineConfig
from minivllm.layers.attention import AttentionMetadata
from minivllm.paging import blocks_for

logger = logging.getLogger(__name__)

GB = 1e9


@dataclass(frozen=True)
class GpuMemoryProfile:
    """Bytes measured at start-up, before the KV pool is allocated."""

    total: int  # the GPU's memory
    utilization: float  # gpu_memory_utilization
    weights: int  # torch's allocations before the profiled forward: the weights
    activation_peak: int  # the profiled forward's peak above the weights
    other: int  # in use but not torch's: the CUDA context, libraries' workspaces
    profiled_tokens: int

    @property
    def kv_budget(self) -> float:
        return kv_budget_after_peak(
            self.total, self.utilization, self.weights, self.activation_peak, self.other
        )

    def log_line(self, num_blocks: int, bytes_per_block: int, block_size: int) -> str:
        return (
            f"GPU memory: {self.utilization:.2f} of {self.total / GB:.1f} GB; weights "
            f"{self.weights / GB:.2f} GB, activation peak {self.activation_peak / GB:.2f} GB "
            f"(a {self.profiled_tokens}-token step), other {self.other / GB:.2f} GB; KV cache "
            f"{num_blocks * bytes_per_block / GB:.2f} GB = {num_blocks} blocks x {block_size} "
            "tokens"
        )


def kv_budget_after_peak(
    total: int, utilization: float, weights: int, activation_peak: int, other: int
) -> float:
    """Bytes the KV pool may take: the engine's share of the GPU less what it already holds
    and what its largest step needs on top (negative: nothing fits)."""
    return total * utilization - weights - activation_peak - other


CacheShape = tuple[int, int, int, int]  # [num_layers, block_size, KVH, D]


def profile_batch(
    config: EngineConfig, block_size: int, device: Any
) -> tuple[AttentionMetadata, torch.Tensor]:
    """The largest step the scheduler plans: `max_num_batched_tokens` new tokens as prompts
    of `max_model_len` (at most `max_num_seqs` of them), every block-table entry block 0.
    Returns its metadata and the tokens' positions."""
    longest = config.max_model_len or config.max_num_batched_tokens
    lens: list[int] = []
    left = config.max_num_batched_tokens
    while left > 0 and len(lens) < config.max_num_seqs:
        lens.append(min(left, longest))
        left -= lens[-1]
    options = {"dtype": torch.int64, "device": device}
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], **options),
        query_start_loc=torch.tensor(starts, **options),
        seq_lens=torch.tensor(lens, **options),
        block_tables=torch.zeros(len(lens), blocks_for(max(lens), block_size), **options),
        query_lens_cpu=lens,
        seq_lens_cpu=list(lens),
        block_size=block_size,
    )
    positions = torch.cat([torch.arange(n, **options) for n in lens])  # [tokens]
    return meta, positions


def profile_activation_peak(
    model: Any, config: EngineConfig, cache_shape: CacheShape, dtype: torch.dtype, device: Any
) -> tuple[int, int]:
    """`(peak bytes above what was allocated before, tokens)` of one forward of the largest
    step, over a one-block cache `cache_shape` `[num_layers, block_size, KVH, D]` per layer."""
    num_layers, block_size, num_kv_heads, head_dim = cache_shape
    meta, positions = profile_batch(config, block_size, device)
    tokens = meta.num_tokens
    rows = min(config.max_num_seqs, tokens)
    options = {"dtype": torch.int64, "device": device}
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        block = (1, block_size, num_kv_heads, head_dim)
        caches = [(torch.zeros(block, dtype=dtype, device=device),) * 2 for _ in range(num_layers)]
        ids = torch.zeros(tokens, **options)
        hidden = model(ids, positions, caches, meta)
        model.compute_logits(hidden[-rows:]).float().softmax(-1)  # the sampler's fp32 probs
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del caches, hidden
    torch.cuda.empty_cache()
    return peak, tokens


def profile_gpu_memory(
    model: Any, config: EngineConfig, cache_shape: CacheShape, dtype: torch.dtype, device: Any
) -> GpuMemoryProfile:
    """Weights, the largest step's activation peak and the rest, measured now."""
    weights = torch.cuda.memory_allocated(device)
    peak, tokens = profile_activation_peak(model, config, cache_shape, dtype, device)
    free, total = torch.cuda.mem_get_info(device)
    other = max(0, total - free - torch.cuda.memory_reserved(device))
    return GpuMemoryProfile(total, config.gpu_memory_utilization, weights, peak, other, tokens)


def kv_blocks_after_profiled_peak(
    model: Any,
    config: EngineConfig,
    cache_shape: CacheShape,
    dtype: torch.dtype,
    device: Any,
    bytes_per_block: int,
) -> int:
    """The KV pool's blocks on a GPU, from a profile taken now; the sizes go to the log."""
    from minivllm.engine.memory import kv_blocks_for_budget

    profile = profile_gpu_memory(model, config, cache_shape, dtype, device)
    blocks = kv_blocks_for_budget(config, profile.kv_budget, bytes_per_block)
    logger.info(profile.log_line(blocks, bytes_per_block, cache_shape[1]))
    return blocks
