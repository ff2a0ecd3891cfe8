"""The engine's memory accounting and KV budget (minivllm/engine/memory.py): weights counted
once however many tensors view them, the default CPU budget a capped share of what is
available, and a max_model_len the pool cannot hold lowered or refused."""

from __future__ import annotations

import logging
import mmap
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from minivllm import heap
from minivllm.config import EngineConfig
from minivllm.engine import memory
from minivllm.heap import release_free_heap


class _Stored:
    """Stands for a layer's packed weight object kept in a plain attribute."""

    def __init__(self, blocks: torch.Tensor) -> None:
        self.segments = [blocks]


def test_weight_bytes_counts_each_block_of_memory_once(tmp_path) -> None:
    """Tied weights and views count once; tensors in plain attributes count; tensors over a
    mapped file count as mapped."""
    path = tmp_path / "w.bin"
    path.write_bytes(bytes(4096))
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    file_view = np.frombuffer(mapped, dtype=np.uint8, count=1024, offset=1024)
    start = np.frombuffer(mapped, dtype=np.uint8, count=1).ctypes.data
    with warnings.catch_warnings():  # read-only memory, as the GGUF loader's (torch warns
        warnings.simplefilter("ignore")  # once a process, so whether it does here varies)
        blocks = torch.from_numpy(file_view)

    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10, bias=False))
    model[1].weight = model[0].weight  # tied: [10, 8] float32, 320 bytes
    model[1].register_buffer("rows", model[0].weight.data[:5])  # a view of the same memory
    model[1].stored = _Stored(blocks)
    total, in_file = memory.weight_bytes(model, range(start, start + 4096))
    assert (total, in_file) == (320 + 1024, 1024)
    assert memory.weight_bytes(model) == (320 + 1024, 0)


def test_default_cpu_budget_is_a_capped_share_of_available(monkeypatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(memory, "available_memory", lambda: 4 * 10**9)
    config = EngineConfig()
    assert memory.kv_cache_budget(config, cpu, 0) == pytest.approx(1e9)
    # the mapped weights the first steps read back are not room for the KV pool
    assert memory.kv_cache_budget(config, cpu, 2 * 10**9) == pytest.approx(0.5e9)
    monkeypatch.setattr(memory, "available_memory", lambda: 64 * 10**9)
    assert memory.kv_cache_budget(config, cpu, 0) == pytest.approx(memory.DEFAULT_CPU_KV_GB * 1e9)
    given = EngineConfig(kv_cache_memory_gb=0.25)
    assert memory.kv_cache_budget(given, cpu, 0) == pytest.approx(0.25e9)


def test_available_memory_and_peak_rss_are_plausible() -> None:
    assert memory.available_memory() > 0
    big = torch.ones(32 * 2**20, dtype=torch.uint8)  # 32 MiB touched
    assert memory.peak_rss() > big.numel()


def test_blocks_for_budget() -> None:
    config = EngineConfig(max_model_len=64, max_num_seqs=2, block_size=16)
    assert memory.kv_blocks_for_budget(config, 10_000, 1000) == 8  # 2 sequences x 4 blocks
    assert memory.kv_blocks_for_budget(config, 5_500, 1000) == 5
    with pytest.raises(ValueError, match="no room for a single KV block"):
        memory.kv_blocks_for_budget(config, 999, 1000)


def _report(blocks: int) -> memory.MemoryReport:
    return memory.MemoryReport(
        weight_bytes=1,
        mapped_weight_bytes=0,
        kv_cache_bytes=blocks * 10**6,
        num_kv_blocks=blocks,
        peak_rss_bytes=1,
    )


def test_fit_max_model_len(caplog: pytest.LogCaptureFixture) -> None:
    """A pool shorter than one sequence: the user's max_model_len is an error naming both
    fixes; the model's own is lowered to the pool with a warning; num_kv_blocks set by hand
    is left alone."""
    config = EngineConfig(max_model_len=1024, block_size=16)
    assert memory.fit_max_model_len(config, 64, _report(64), True) is config  # 1024 tokens
    with pytest.raises(ValueError) as info:
        memory.fit_max_model_len(config, 10, _report(10), max_model_len_given=True)
    message = str(info.value)
    assert "holds 160 tokens" in message and "max_model_len 1024" in message
    assert "--kv-cache-memory-gb to at least 0.06" in message
    assert "--max-model-len to at most 160" in message
    with caplog.at_level(logging.WARNING, logger="minivllm.engine.memory"):
        fitted = memory.fit_max_model_len(config, 10, _report(10), max_model_len_given=False)
    assert fitted.max_model_len == 160
    assert "max_model_len lowered from the model's 1024 to 160" in caplog.text
    by_hand = EngineConfig(max_model_len=1024, num_kv_blocks=10)
    assert memory.fit_max_model_len(by_hand, 10, _report(10), True) is by_hand


def test_report_line_and_gauges() -> None:
    report = memory.MemoryReport(
        weight_bytes=2_500_000_000,
        mapped_weight_bytes=2 * 10**9,
        kv_cache_bytes=10**9,
        num_kv_blocks=100,
        peak_rss_bytes=3 * 10**9,
    )
    line = report.log_line(16, torch.bfloat16, torch.device("cpu"))
    assert line == (
        "memory: weights 2.50 GB (2.00 GB of it the GGUF's mapped pages); KV cache "
        "1.00 GB = 100 blocks x 16 tokens = 1600 tokens (bfloat16, cpu); peak resident 3.00 GB "
        "at start-up"
    )
    assert report.gauges() == {
        "model_weights_bytes": 2.5e9,
        "kv_cache_bytes": 1e9,
        "kv_cache_num_blocks": 100.0,
        "kv_cache_capacity_tokens": 1600.0,
        "startup_peak_rss_bytes": 3e9,
    }


def test_a_gguf_model_counts_its_stored_blocks_once(
    tmp_path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model whose Q5_1 MLP down projections run as the file's blocks (a kind not moved into
    tiles of 8 rows): those bytes are the GGUF's mapped pages (2 layers x 64 rows x 8 blocks of
    24 bytes), counted once, and the start-up line says so."""
    from gguf import GGMLQuantizationType as QT
    from support.gguf_files import write_tiny_llama_gguf

    from minivllm import LLM
    from minivllm.layers.cpu_kernels import cpu_kernels_available

    if not cpu_kernels_available():
        pytest.skip("stored GGUF blocks need minivllm's CPU kernels")
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))  # the kernels are loaded
    path = write_tiny_llama_gguf(tmp_path / "q5_1.gguf", ffn_type=QT.Q5_1)
    with caplog.at_level(logging.INFO, logger="minivllm.engine.model_runner"):
        llm = LLM(model=str(path), enforce_eager=True, device="cpu", num_kv_blocks=8)
    report = llm.llm_engine.model_runner.memory
    assert report.mapped_weight_bytes == 2 * 64 * 8 * 24
    dense = sum(
        p.numel() * p.element_size() for p in llm.llm_engine.model_runner.model.parameters()
    )
    assert report.weight_bytes >= dense + report.mapped_weight_bytes
    assert report.num_kv_blocks == 8 and report.kv_cache_bytes > 0
    assert "memory: weights" in caplog.text and "of it the GGUF's mapped pages" in caplog.text


def _huge_kb(address: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds `address`."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                begin, end = (int(part, 16) for part in head.split("-"))
                inside = begin <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def _collapse_runs_here() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            setting = f.read()
        release = tuple(int(p) for p in __import__("platform").release().split(".")[:2])
    except (OSError, ValueError):
        return False
    return "[never]" not in setting and release >= (6, 1)  # MADV_COLLAPSE: Linux 6.1


@pytest.mark.skipif(not _collapse_runs_here(), reason="no THP or MADV_COLLAPSE (Linux < 6.1)")
def test_the_weights_the_load_wrote_are_collapsed_to_huge_pages_not_the_mapped_ones(
    tmp_path, monkeypatch
) -> None:
    """A written weight (a repacked tile, in a plain attribute) ends on 2 MB pages; one over
    the file's mapped pages is left alone; MINIVLLM_NO_HUGE_PAGES=1 turns it off."""
    monkeypatch.delenv("MINIVLLM_NO_HUGE_PAGES", raising=False)
    path = tmp_path / "w.bin"
    path.write_bytes(b"\0" * (8 << 20))
    with open(path, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), 0)
    in_file = torch.frombuffer(mapped, dtype=torch.uint8)
    # each on a mapping of its own, as a load's large weights are: an engine created earlier in
    # this process holds large blocks in malloc's heap (heap.hold_large_blocks), where two
    # tensors would share one mapping and its huge-page count
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # not shared memory: THP's own rules
    written, other = (
        torch.frombuffer(mmap.mmap(-1, 16 << 20, flags=private), dtype=torch.uint8).fill_(1)
        for _ in range(2)
    )
    model = nn.Module()
    model.tiles = _Stored(written)
    model.lookup = in_file
    address = in_file.data_ptr()
    memory.collapse_to_huge_pages(model, range(address, address + (8 << 20))).join()
    middle = 8 << 20  # advice splits a mapping: its 2 MB-aligned middle is a mapping of its own
    assert _huge_kb(written.data_ptr() + middle) >= 2048
    assert _huge_kb(in_file.data_ptr() + (4 << 20)) == 0
    monkeypatch.setenv("MINIVLLM_NO_HUGE_PAGES", "1")
    model.tiles = _Stored(other)
    memory.collapse_to_huge_pages(model).join()
    assert _huge_kb(other.data_ptr() + middle) == 0
    del in_file
    mapped.close()


def test_release_free_heap_gives_freed_pages_back() -> None:
    """What a load frees stays in glibc's heap, resident, until trimmed: 150 MB of 1 kB
    blocks (malloc's, past Python's small-object arenas) freed but every 100th, so the heap's
    top cannot shrink by itself, then a trim."""
    blocks = [bytes(1000) + bytes([i % 256]) for i in range(150_000)]
    keep = blocks[::100]
    before = _rss_mb()
    del blocks
    freed_in_place = _rss_mb()
    if not release_free_heap():
        pytest.skip("no malloc_trim in this C library")
    assert freed_in_place > before - 50  # glibc kept the freed pages
    assert _rss_mb() < freed_in_place - 75
    assert len(keep) == 1500


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    pytest.skip("no /proc/self/status")


HELD_BLOCKS = """
import ctypes, resource, sys
from minivllm import heap
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
if sys.argv[1] == "held" and not heap.hold_large_blocks():
    print("unsupported")
    raise SystemExit
size = 64 << 20
faults = []
for _ in range(3):  # a step's temporary: allocated, written, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    libc.memset(block, 1, size)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(min(faults[1:]), heap.block_budget())
"""


@pytest.mark.parametrize("mode", ["default", "held"])
def test_held_heap_serves_a_steps_large_block_without_page_faults(mode: str) -> None:
    """A 64 MB temporary freed and allocated again: with malloc's defaults each round faults
    its 16k pages in anew (fresh mmap); held, the heap's own pages serve it again."""
    out = subprocess.run(
        [sys.executable, "-c", HELD_BLOCKS, mode], capture_output=True, text=True, check=True
    ).stdout.split()
    if out == ["unsupported"]:
        pytest.skip("no mallopt in this C library")
    faults, budget = int(out[0]), int(out[1])
    if mode == "default":
        assert faults > 10_000 and budget == 16 << 20
    else:
        assert faults < 100 and budget == heap.HELD_BLOCK_BYTES // 4
