"""The one CPU probe (`minivllm.layers.cpu_kernels.cpu_caps`) and the one table of row
thresholds (`minivllm.layers.quantization.rows`): probed once, frozen, read by every module that
picks a CPU path (none probes the CPU itself), `ATEN_CPU_CAPABILITY=avx2` read as an AVX2-only
CPU, and each kernel taking its threshold from the table."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

import minivllm
from minivllm.layers.cpu_kernels import cpu_caps
from minivllm.layers.quantization.chooser import int4_table, int8_head_table
from minivllm.layers.quantization.kernels.block_weight import Kernel
from minivllm.layers.quantization.kernels.int4 import quantize_int4, split_int8
from minivllm.layers.quantization.rows import (
    KERNEL_ROWS,
    RowTable,
    block_rows,
    compiled_steps_max_seqs,
    kernel_rows,
)

PROBES = re.compile(
    r"get_cpu_capability|_is_vnni_supported|_is_avx512_bf16_supported|"
    r"_is_amx_tile_supported|_is_mkldnn_bf16_supported"
)


def test_the_probe_runs_once_and_is_frozen() -> None:
    caps = cpu_caps()
    assert cpu_caps() is caps
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.kernels = not caps.kernels  # type: ignore[misc]
    assert caps.kind in KERNEL_ROWS


def test_no_other_module_probes_the_cpu() -> None:
    """A second probe could disagree with the first (an env override read in one place only)."""
    package = Path(minivllm.__file__).parent
    probing = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if PROBES.search(path.read_text())
    )
    assert probing == ["layers/cpu_kernels.py"]


def test_forcing_torchs_avx2_kernels_reads_as_an_avx2_only_cpu() -> None:
    """What `ATEN_CPU_CAPABILITY=avx2` runs (tests of the AVX2 paths on an AVX-512 machine):
    kind AVX2, no native bf16 (dtype "auto" is fp32), the AVX2 row thresholds."""
    script = (
        "from minivllm.layers.cpu_kernels import cpu_caps\n"
        "from minivllm.layers.quantization.rows import KERNEL_ROWS, kernel_rows\n"
        "c = cpu_caps()\n"
        "print(c.capability, c.kind, c.native_bf16, kernel_rows() == KERNEL_ROWS['AVX2'])"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    if out[0] not in ("AVX2", "AVX512"):
        pytest.skip(f"torch runs {out[0]} kernels here")
    assert out == ["AVX2", "AVX2", "False", "True"]


def test_each_kernel_reads_its_threshold_from_the_table() -> None:
    """The chooser's row tables take their counts from the one table, per CPU kind."""
    rows = kernel_rows()
    weight = quantize_int4(torch.randn(16, 64))
    caps = cpu_caps()
    with_vnni, without = (dataclasses.replace(caps, qgemv_vnni=v, kernels=v) for v in (True, False))
    assert _counts(int4_table(weight, torch.float32, caps)) == [rows.qgemv]
    assert block_rows(GGMLQuantizationType.Q8_0) == rows.ggml_int_dot
    assert block_rows(GGMLQuantizationType.Q4_K) == rows.ggml_int_dot_k
    assert block_rows(GGMLQuantizationType.Q4_K, x8=True) == rows.ggml_q4x8
    assert block_rows(GGMLQuantizationType.Q5_0, x8=True) == rows.ggml_q8x8
    assert compiled_steps_max_seqs(stored_blocks=False) == rows.int4
    avx512, avx2, amx = KERNEL_ROWS["AVX512"], KERNEL_ROWS["AVX2"], KERNEL_ROWS["AVX512_AMX"]
    assert (avx512.ggml_int_dot, avx512.ggml_int_dot_k) == (avx2.ggml_int_dot, avx2.ggml_int_dot_k)
    # the GGUF block kernels cross over at the same rows on both CPU kinds; with AMX, bf16
    # tiles for oneDNN take every kind's prefill-sized steps
    assert max(amx.ggml_int_dot, amx.ggml_int_dot_k, amx.ggml_q4x8, amx.ggml_q8x8) < 128
    assert rows == KERNEL_ROWS[cpu_caps().rows_kind]
    halves = split_int8(torch.randint(-128, 128, (16, 64), dtype=torch.int8), torch.rand(16, 2))
    assert _counts(int8_head_table(*halves, torch.float32, caps)) == [rows.qgemv]
    assert _counts(int8_head_table(*halves, torch.bfloat16, with_vnni)) == [rows.qgemv_bf16_head]
    if hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        bf16 = torch.bfloat16
        assert _counts(int4_table(weight, bf16, with_vnni)) == [rows.qgemv_vnni_bf16, rows.int4]
        assert _counts(int4_table(weight, bf16, without)) == [rows.int4]
        assert _counts(int8_head_table(*halves, bf16, without)) == [rows.int8_as_int4_pair]


def _counts(table: RowTable[Kernel] | None) -> list[float]:
    assert table is not None
    return [count for count, _ in table]
