"""benchmarks/gpu_bench.py, the GPU run's parts, end to end on a tiny checkpoint on the CPU:
the prepared script must not first fail on the GPU machine, where minutes are scarce (no
timing asserted)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from minivllm.bench.workloads import Workload

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_bench.py"


@pytest.fixture
def gpu_bench(monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    small = dict(device="cpu", dtype="float32", max_model_len=128, max_num_batched_tokens=512)
    monkeypatch.setattr(module, "ENGINE", {**module.ENGINE, **small})
    monkeypatch.setattr(module, "WORKLOAD", Workload(4, (10, 30), (3, 8), seed=0))
    return module


def test_the_throughput_and_step_parts_run(gpu_bench, tiny_llama_dir: Path, capsys) -> None:
    """The throughput part prints its rate; the steps part a median for each batch size."""
    gpu_bench.throughput(str(tiny_llama_dir))
    gpu_bench.steps(str(tiny_llama_dir), context=8, num_steps=2, sizes=(16, 4, 1))
    out = capsys.readouterr().out
    assert "output tok/s" in out and "CUDA graphs off" in out
    for num_seqs in (16, 4, 1):
        assert f"decode step, {num_seqs} seqs, context 8: median" in out
    assert "top ops by GPU time" in out
