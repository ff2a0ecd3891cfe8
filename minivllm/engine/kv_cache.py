"""How many KV blocks an engine gets when `num_kv_blocks` is not set: what its memory budget
holds (a share of the GPU, `kv_cache_memory_gb`, or on the CPU a share of free RAM)."""

from __future__ import annotations

import os

import torch

from minivllm.config import EngineConfig
from minivllm.engine.sequence import blocks_for

DEFAULT_CPU_KV_GB = 2.0  # cap of the default CPU KV budget (a share of free RAM below it)


def blocks_from_memory_budget(
    config: EngineConfig, device: torch.device, bytes_per_block: int
) -> int:
    """The blocks of `bytes_per_block` (K and V, all layers) that fit the budget, at most what
    `max_num_seqs` full-length sequences use; ValueError if not even one fits."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_by_others = total - free
        budget = total * config.gpu_memory_utilization - used_by_others
        budget -= 1 << 30  # room for activations and the sampler
    elif config.kv_cache_memory_gb is not None:
        budget = config.kv_cache_memory_gb * 1e9
    else:
        budget = min(DEFAULT_CPU_KV_GB * 1e9, 0.25 * _available_ram())
    blocks = int(budget // bytes_per_block)
    # More blocks than max_num_seqs full-length sequences could ever use are wasted.
    assert config.max_model_len is not None, "a resolved config"
    most = config.max_num_seqs * blocks_for(config.max_model_len, config.block_size)
    blocks = min(blocks, most)
    if blocks < 1:
        raise ValueError(
            f"no room for a single KV block in the memory budget ({budget / 1e9:.2f} GB); "
            "raise kv_cache_memory_gb / gpu_memory_utilization or set num_kv_blocks"
        )
    return blocks


def _available_ram() -> float:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8e9
