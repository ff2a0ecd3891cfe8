"""The one table of row thresholds: up to how many rows (tokens in the step) each weight kernel
runs a layer, per kind of CPU kernels torch dispatches to; above it the layer's next path
takes over (its dense weight, or for stored GGUF blocks tile-by-tile dequantization).

A method chosen at load (`minivllm.layers.quantization.chooser`) turns these values into its
`RowTable`: its kernels in order, each with the most rows it runs. A step then looks up its
row count in the table and calls that kernel (`pick`): no check per kernel, no probe.

Each value is where two kernels cross over the same weights, measured by
`benchmarks/linear_kernels.py`, `benchmarks/one_row_kernels.py` and
`benchmarks/ggml_kernels.py`; the figures are in docs/benchmarks.md ("The thresholds the code
uses") and docs/ggml-kernels.md. The kernels read their value once, when a weight is packed:
a compiled step cannot call back into the probe.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TypeVar

import torch
from gguf import GGMLQuantizationType

from minivllm.layers.cpu_kernels import cpu_caps

# (most rows, kernel) in ascending order; the last entry takes every count (`float("inf")`).
# A kernel is whatever its owner calls: `x -> x @ W.T` in a BlockWeight, a method's `apply`.
K = TypeVar("K")
RowTable = tuple[tuple[float, K], ...]


def pick(table: RowTable[K], x: torch.Tensor) -> K:
    """The first kernel of `table` that takes x's row count (`[..., in]`: all but the last dim)."""
    rows = x.numel() // x.shape[-1]
    for max_rows, kernel in table[:-1]:
        if rows <= max_rows:
            return kernel
    return table[-1][1]


@dataclass(frozen=True)
class KernelRows:
    """Row thresholds of one kind of CPU (each: at or below it the kernel runs)."""

    # torch's packed int4 kernel (bf16 activations) over the oneDNN-prepacked dense bf16 one
    int4: int
    # an 8-bit LM head as two int4 halves (no qgemv built) over the dense bf16 head
    int8_as_int4_pair: int
    # our qgemv kernel (fp32 activations) over the dense fp32 matmul (MKL)
    qgemv: int
    # qgemv on a bf16 model's Q8_0 LM head (activations widened) over the dense bf16 head
    qgemv_bf16_head: int
    # qgemv's AVX-512 VNNI path on a bf16 layer's 4-bit weight over torch's int4 kernel: as
    # fast at 2-4 rows, but there it fails the quality bar (tests/models/test_quality.py)
    qgemv_vnni_bf16: int
    # the integer-dot kernel on stored GGUF blocks of the 32-input kinds not in tiles (Q5_1,
    # and tensors whose rows are no multiple of 8) over tile-by-tile dequantization; the K
    # kinds' (Q4_K, Q5_K, Q6_K) wins at every count
    ggml_int_dot: int
    ggml_int_dot_k: float
    # the integer kernel on weights repacked 8 rows at a time (X8_KINDS; the 32-input kinds
    # with two int8 codes an activation) over tile-by-tile dequantization: it wins at every
    # count
    ggml_q4x8: float
    # the integer kernel on Q8_0/Q5_0 repacked 8 rows at a time (a byte a code, two int8
    # codes an activation) over tile-by-tile dequantization to bf16 (oneDNN). With VNNI's
    # tiles two at a time (2048 -> 8192, one thread, Zen 4): 32 rows 7.3 vs 9.1 ms, 48 rows
    # 10.6 vs 11.5, 64 rows 14.1 vs 13.7; one tile at a time 32 rows 8.6 vs 8.9, 48 rows 12.7
    # vs 11.2 (AVX2's threshold)
    ggml_q8x8: int = 48
    # a stored-block step whose activations take a second code as a second row (int8x2: the
    # K kinds, the 32-input kinds not in tiles) over the weight dequantized to bf16 a tile at
    # a time, for a bf16 model: where oneDNN runs bf16 natively, 2048 -> 8192 Q4_K at 64 rows
    # (128 integer rows) 17 vs 14 ms, at 512 (1024) 133 vs 81 (one thread, Zen 4)
    ggml_two_codes: float = float("inf")
    # LoRA updates: our grouped kernel (each row through its own adapter, float32) over the
    # masked matmul of every resident adapter (docs/lora.md)
    lora_rows: int = 64


_AVX512 = KernelRows(
    int4=4,
    int8_as_int4_pair=1,
    qgemv=16,
    qgemv_bf16_head=1,
    qgemv_vnni_bf16=1,
    ggml_int_dot=32,
    ggml_int_dot_k=float("inf"),
    ggml_q4x8=float("inf"),
)

KERNEL_ROWS = {
    "AVX512": _AVX512,
    # AMX: from 128 rows a K-quant or x8 weight dequantized to bf16 a tile at a time and
    # multiplied on AMX tiles beats the integer kernels; below, they win (docs/ggml-kernels.md;
    # Q8_0/Q5_0 tiles on AMX's int8 tiles: 2048 -> 8192 at 128 rows 13.8 vs 14.1 ms)
    "AVX512_AMX": replace(_AVX512, ggml_int_dot_k=127, ggml_q4x8=127, ggml_q8x8=127),
    # AVX-512 with BF16 but no AMX (Zen 4): bf16 matmuls fast enough to take the prefills of
    # two-code weights from 48 rows
    "AVX512_BF16": replace(_AVX512, ggml_two_codes=48),
    # AVX2: the same crossovers, without the Q8_0 head as an int4 pair, and Q8_0/Q5_0 tiles
    # one at a time
    "AVX2": replace(_AVX512, int8_as_int4_pair=0, ggml_q8x8=32),
}


def kernel_rows() -> KernelRows:
    """The thresholds for the kernels torch runs on this CPU."""
    return KERNEL_ROWS[cpu_caps().rows_kind]


# The kinds whose tiles hold a byte a code (`csrc/ggml_q8x8_simd.h`)
Q8X8_KINDS = frozenset({GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q5_0})

# The K kinds: activations rounded per block of 256 (`block_rows`, the integer kernel)
K_KINDS = frozenset(
    {GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K}
)


def block_rows(qtype: int, x8: bool = False) -> float:
    """Up to how many rows a step of `qtype` blocks takes the integer kernel on this CPU: the K
    kinds' (activations rounded per block of 256) and the x8 layout's (a group's float work
    shared by 8 columns) beat the dequantizing path at every row count; the other 32-input
    kinds' (a float multiply each group and column) only up to a threshold."""
    rows = kernel_rows()
    if x8 and qtype in Q8X8_KINDS:
        return rows.ggml_q8x8
    if x8:
        return rows.ggml_q4x8
    return rows.ggml_int_dot_k if qtype in K_KINDS else rows.ggml_int_dot


def compiled_steps_max_seqs(stored_blocks: bool) -> float:
    """Up to how many sequences a decode step runs compiled: every count where the linear
    layers run our operator on stored blocks (the same kernel at every size), else as many
    as torch's int4 kernel takes rows (above, the eager step's oneDNN-prepacked matmuls,
    opaque to Inductor, beat the graph's aten::mm)."""
    return float("inf") if stored_blocks else kernel_rows().int4
