"""The KV pool on a GPU sized after a profiled peak (minivllm/engine/gpu_memory.py), on the CPU:
the arithmetic and the log line with made-up numbers, and the profiled forward itself run on a
tiny model with torch.cuda's memory counters faked.

Guards: the activation peak or the memory torch does not hold left out of the budget (the
first long prefill then runs out of memory), the profiled step smaller than the largest the
scheduler plans, and a profile forward that cannot run (its one-block cache, its metadata).
"""

from __future__ import annotations

import pytest
import torch

from minivllm.config import EngineConfig
from minivllm.engine import gpu_memory
from minivllm.engine.gpu_memory import GpuMemoryProfile, kv_budget_after_peak
from minivllm.engine.memory import kv_blocks_for_budget
from minivllm.models.loader import load_model

GIB = 1 << 30


def test_the_budget_is_the_share_less_weights_peak_and_the_rest() -> None:
    """80 GiB at 0.9 is 72 GiB: less 2 GiB of weights, a 5 GiB peak and 1 GiB of context."""
    assert kv_budget_after_peak(80 * GIB, 0.9, 2 * GIB, 5 * GIB, 1 * GIB) == pytest.approx(64 * GIB)
    assert kv_budget_after_peak(10 * GIB, 0.5, 4 * GIB, 2 * GIB, 0) < 0  # nothing fits


def test_the_log_line_says_weights_peak_kv_bytes_and_blocks() -> None:
    profile = GpuMemoryProfile(
        total=140 * 10**9,
        utilization=0.9,
        weights=1_200_000_000,
        activation_peak=2_300_000_000,
        other=500_000_000,
        profiled_tokens=16384,
    )
    per_block = 2 * 28 * 256 * 8 * 128 * 2  # Qwen3-0.6B's K and V, bf16, blocks of 256
    config = EngineConfig(model="x", max_num_seqs=256, max_model_len=4096, block_size=256)
    blocks = kv_blocks_for_budget(config, profile.kv_budget, per_block)
    assert blocks == 256 * 16  # capped by 256 full-length sequences
    line = profile.log_line(blocks, per_block, 256)
    assert "weights 1.20 GB" in line and "activation peak 2.30 GB (a 16384-token step)" in line
    assert "other 0.50 GB" in line and "= 4096 blocks x 256 tokens" in line
    assert f"KV cache {blocks * per_block / 1e9:.2f} GB" in line


def test_the_profiled_forward_runs_the_largest_step(tiny_llama_dir, monkeypatch) -> None:
    """One forward of max_num_batched_tokens (prompts of at most max_model_len) over a
    one-block cache, the LM head over max_num_seqs rows; the peak is read from torch.cuda's counters
    (faked here: 3 GB allocated before, 5 GB at the peak)."""
    model, config = load_model(tiny_llama_dir, torch.float32, "cpu")
    allocated = iter([3 * 10**9, 3 * 10**9])  # before the profile (weights), before the step
    fakes = {
        "synchronize": lambda device=None: None,
        "reset_peak_memory_stats": lambda device=None: None,
        "empty_cache": lambda: None,
        "memory_allocated": lambda device=None: next(allocated),
        "max_memory_allocated": lambda device=None: 5 * 10**9,
        "mem_get_info": lambda device=None: (70 * 10**9, 80 * 10**9),
        "memory_reserved": lambda device=None: 9 * 10**9,
    }
    for name, fake in fakes.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    calls = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a: calls.append(a[0].numel()) or forward(*a))
    engine = EngineConfig(model="x", max_num_batched_tokens=48, max_model_len=40, max_num_seqs=4)
    head_dim = config.hidden_size // config.num_attention_heads
    shape = (config.num_hidden_layers, 16, config.num_key_value_heads, head_dim)
    profile = gpu_memory.profile_gpu_memory(model, engine, shape, torch.float32, "cpu")
    assert calls == [48] and profile.profiled_tokens == 48
    assert profile.weights == 3 * 10**9 and profile.activation_peak == 2 * 10**9
    assert profile.other == 80 * 10**9 - 70 * 10**9 - 9 * 10**9


def test_the_profiled_batch_is_the_largest_step_the_scheduler_plans() -> None:
    """max_num_batched_tokens as prompts no longer than max_model_len, no more of them than
    max_num_seqs, each from position 0, every block-table entry the one block."""
    config = EngineConfig(model="x", max_num_batched_tokens=100, max_model_len=40, max_num_seqs=8)
    meta, positions = gpu_memory.profile_batch(config, 16, "cpu")
    assert meta.query_lens_cpu == [40, 40, 20] and meta.seq_lens_cpu == [40, 40, 20]
    assert positions.tolist() == [*range(40), *range(40), *range(20)]
    assert meta.block_tables.shape == (3, 3) and not meta.block_tables.any()
    capped = EngineConfig(model="x", max_num_batched_tokens=100, max_model_len=40, max_num_seqs=2)
    assert gpu_memory.profile_batch(capped, 16, "cpu")[0].query_lens_cpu == [40, 40]
