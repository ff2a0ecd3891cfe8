"""The engine's memory, measured and bounded: the weights' bytes, the KV pool's budget, the
peak resident set at start-up.

`kv_cache_budget` decides how many bytes the KV pool may take: on a GPU a share of its memory
(`gpu_memory_utilization`); on the CPU `kv_cache_memory_gb` when given, else a share of the
memory still *available* once the weights are loaded, capped, so a small machine keeps room
for everything else. `fit_max_model_len` then checks that one sequence fits the pool.
`MemoryReport` is what the start-up log line and the server's `/metrics` gauges say.
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from minivllm.config import EngineConfig
from minivllm.heap import hold_large_blocks
from minivllm.paging import blocks_for

logger = logging.getLogger(__name__)

# The default CPU KV budget: this share of the memory available after loading, at most the cap.
DEFAULT_CPU_KV_SHARE = 0.25
DEFAULT_CPU_KV_GB = 2.0
GPU_ACTIVATION_RESERVE = 1 << 30  # room for activations and the sampler on a GPU


def available_memory() -> int:
    """Bytes the OS can still give this process without swapping: Linux's MemAvailable (free
    memory plus reclaimable page cache), else free pages, else 8 GB."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 * 10**9


def peak_rss() -> int:
    """This process's peak resident set so far, in bytes (ru_maxrss: KiB on Linux, bytes on
    macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _tensors_of(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors a module attribute holds, directly or in containers and small objects (a
    layer's packed or stored weights live in plain attributes, not as parameters)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth > 3 or isinstance(value, (str, bytes, int, float, torch.nn.Module)):
        return
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_of(item, depth + 1)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_of(item, depth + 1)
    elif hasattr(value, "__dict__"):
        for item in vars(value).values():
            yield from _tensors_of(item, depth + 1)


def _weight_tensors(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor the model's modules hold (parameters, buffers, plain attributes)."""
    for module in model.modules():
        for value in vars(module).values():
            yield from _tensors_of(value)


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the memory behind `tensor`: views and tied weights share one."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # opaque layouts (oneDNN, mkldnn)
        return id(tensor), tensor.numel() * tensor.element_size()


# Linux's madvise advice: back with 2 MB pages (on the usual THP setting, "madvise", only
# what asks), and make them so now, in the calling thread (Linux 6.1+; older: EINVAL, ignored)
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25
HUGE_PAGE = 2 << 20


def collapse_to_huge_pages(model: torch.nn.Module, mapped: range = range(0)) -> threading.Thread:
    """Back the weights the load wrote (repacked tiles, dequantized or packed tensors; not the
    file's mapped pages) with 2 MB pages, on a background thread. A decode step streams every
    weight once: on 4 KB pages each page costs a TLB miss and stops the hardware prefetcher (a
    one-sequence step of a 1.5B Q4_K_M: 76 ms against 67, docs/ggml-kernels.md). Collapsing
    copies each 2 MB once (on a VM about 3 ms each, the host backing them fresh memory): done
    at load it lengthened a 1.5B model's start by 2 s, so it runs once the engine is built,
    beside its first steps. A no-op thread off Linux or with MINIVLLM_NO_HUGE_PAGES=1."""
    regions = set()
    for tensor in _weight_tensors(model):
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # opaque layouts: no address
            continue
        if tensor.device.type == "cpu" and storage.data_ptr() not in mapped:
            regions.add((storage.data_ptr(), storage.nbytes()))
    wanted = sys.platform == "linux" and os.environ.get("MINIVLLM_NO_HUGE_PAGES", "0") == "0"
    thread = threading.Thread(
        target=_collapse if wanted else lambda _: None,
        args=(sorted(regions),),
        name="minivllm-huge-pages",
        daemon=True,
    )
    thread.start()
    return thread


def _collapse(regions: list[tuple[int, int]]) -> None:
    madvise = ctypes.CDLL(None, use_errno=True).madvise  # ctypes lets the GIL go meanwhile
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for address, size in regions:  # the whole 2 MB pages inside each region
        begin = -(-address // HUGE_PAGE) * HUGE_PAGE
        end = (address + size) // HUGE_PAGE * HUGE_PAGE
        if end > begin:
            for advice in (MADV_HUGEPAGE, MADV_COLLAPSE):  # advice: a refusal changes nothing
                madvise(begin, end - begin, advice)


def hold_step_blocks(device: torch.device) -> None:
    """On the CPU, each step's large temporaries from malloc's heap, not fresh pages each time
    (minivllm/heap.py); before a decode step is compiled: the MLP's slices read the budget."""
    if device.type == "cpu":
        hold_large_blocks()


def weight_bytes(model: torch.nn.Module, mapped: range = range(0)) -> tuple[int, int]:
    """(all bytes, bytes inside `mapped`) of the model's weights: parameters, buffers and the
    tensors layers keep in attributes (packed, quantized or stored weights), each block of
    memory counted once however many tensors view it."""
    seen: dict[int, int] = {}
    for tensor in _weight_tensors(model):
        address, size = _storage_key(tensor)
        seen[address] = max(size, seen.get(address, 0))
    in_file = sum(size for address, size in seen.items() if address in mapped)
    return sum(seen.values()), in_file


def kv_cache_budget(config: EngineConfig, device: torch.device, mapped_not_resident: int) -> float:
    """Bytes the KV pool may take. On the CPU without `kv_cache_memory_gb`: a share of the
    available memory, less the file-mapped weights whose pages the first steps will read back
    (the OS counts them as available page cache), capped at `DEFAULT_CPU_KV_GB`."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = total * config.gpu_memory_utilization - (total - free)
        return budget - GPU_ACTIVATION_RESERVE
    if config.kv_cache_memory_gb is not None:
        return config.kv_cache_memory_gb * 1e9
    room = max(0, available_memory() - mapped_not_resident)
    return min(DEFAULT_CPU_KV_GB * 1e9, DEFAULT_CPU_KV_SHARE * room)


def kv_blocks_for_budget(config: EngineConfig, budget: float, bytes_per_block: int) -> int:
    """Blocks of `bytes_per_block` in `budget`, no more than `max_num_seqs` full-length
    sequences could use; ValueError when not even one block fits."""
    blocks = int(budget // bytes_per_block)
    blocks = min(blocks, config.max_num_seqs * blocks_for(config.max_model_len, config.block_size))
    if blocks < 1:
        raise ValueError(
            f"no room for a single KV block ({bytes_per_block / 1e6:.2f} MB) in the memory budget "
            f"({budget / 1e9:.2f} GB); raise kv_cache_memory_gb / gpu_memory_utilization or set "
            "num_kv_blocks"
        )
    return blocks


def fit_max_model_len(
    config: EngineConfig, num_kv_blocks: int, report: MemoryReport | None, max_model_len_given: bool
) -> EngineConfig:
    """The config with a `max_model_len` one sequence of which fits a pool sized from a memory
    budget. A length the user gave that does not fit is an error naming both ways out; the
    model's own length is lowered to the pool's, with a warning. A pool of `num_kv_blocks`
    set by hand is taken as is (tiny pools that force preemption are its purpose)."""
    pool_tokens = num_kv_blocks * config.block_size
    if (
        config.num_kv_blocks is not None
        or config.max_model_len is None
        or pool_tokens >= config.max_model_len
    ):
        return config
    per_block = report.kv_cache_bytes / report.num_kv_blocks if report else 0.0
    need = blocks_for(config.max_model_len, config.block_size) * per_block / 1e9
    have = num_kv_blocks * per_block / 1e9
    if max_model_len_given:
        raise ValueError(
            f"the KV cache budget holds {pool_tokens} tokens ({num_kv_blocks} blocks, "
            f"{have:.2f} GB), fewer than one sequence of max_model_len {config.max_model_len} "
            f"needs ({need:.2f} GB): raise --kv-cache-memory-gb to at least {need:.2f} or lower "
            f"--max-model-len to at most {pool_tokens}"
        )
    logger.warning(
        "max_model_len lowered from the model's %d to %d tokens, what the KV cache budget "
        "holds (%.2f GB); --kv-cache-memory-gb %.2f would hold the model's full length",
        config.max_model_len,
        pool_tokens,
        have,
        need,
    )
    return replace(config, max_model_len=pool_tokens)


@dataclass(frozen=True)
class MemoryReport:
    """What the engine holds after start-up, in bytes (filled once by the model runner)."""

    weight_bytes: int  # resident weights; a memory-mapped block tensor counted once
    mapped_weight_bytes: int  # of those, the ones that are the GGUF file's own pages
    kv_cache_bytes: int
    num_kv_blocks: int
    peak_rss_bytes: int  # the process's peak resident set at the end of start-up
    block_size: int = 16

    @property
    def kv_cache_capacity_tokens(self) -> int:
        """Tokens the pool holds, over all sequences."""
        return self.num_kv_blocks * self.block_size

    def log_line(self, block_size: int, kv_dtype: torch.dtype, device: torch.device) -> str:
        mapped = (
            f" ({self.mapped_weight_bytes / 1e9:.2f} GB of it the GGUF's mapped pages)"
            if self.mapped_weight_bytes
            else ""
        )
        return (
            f"memory: weights {self.weight_bytes / 1e9:.2f} GB{mapped}; KV cache "
            f"{self.kv_cache_bytes / 1e9:.2f} GB = {self.num_kv_blocks} blocks x "
            f"{block_size} tokens = {self.num_kv_blocks * block_size} tokens "
            f"({str(kv_dtype).removeprefix('torch.')}, {device}); "
            f"peak resident {self.peak_rss_bytes / 1e9:.2f} GB at start-up"
        )

    def gauges(self) -> dict[str, float]:
        """The `/metrics` gauges, by their names after `minivllm:`."""
        return {
            "model_weights_bytes": float(self.weight_bytes),
            "kv_cache_bytes": float(self.kv_cache_bytes),
            "kv_cache_num_blocks": float(self.num_kv_blocks),
            "kv_cache_capacity_tokens": float(self.kv_cache_capacity_tokens),
            "startup_peak_rss_bytes": float(self.peak_rss_bytes),
        }


def measure(
    model: torch.nn.Module,
    kv_caches: list[tuple[torch.Tensor, ...]],
    num_kv_blocks: int,
    mapped: range = range(0),
    block_size: int = 16,
) -> MemoryReport:
    """The report of a loaded model and its allocated KV pool (an int8 pool's scales
    included)."""
    weights, in_file = weight_bytes(model, mapped)
    kv = sum(t.numel() * t.element_size() for pair in kv_caches for t in pair)
    return MemoryReport(weights, in_file, kv, num_kv_blocks, peak_rss(), block_size)
