"""The activation precision of stored GGUF blocks (`BlockWeight(..., activations=)`): with a
few huge activation channels (as Gemma's hidden states have), one 8-bit code per block of
inputs loses the small ones; a second code for the residual ("int8x2") and the dequantized
tiles ("float") keep the product within fp32 rounding of the dequantized weight's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from minivllm.layers.cpu_kernels import cpu_kernels_available
from minivllm.layers.quantization.kernels.block_weight import (
    BlockSegment,
    BlockWeight,
    int8_residual,
)
from minivllm.layers.quantization.kernels.ggml_blocks import ggml_dequantize

pytestmark = pytest.mark.skipif(
    not cpu_kernels_available(), reason="the block kernels need an x86 CPU with AVX2"
)

ROWS, COLS = 64, 512


def _segment(qtype: QT, seed: int) -> BlockSegment:
    """Random valid `[ROWS, COLS]` blocks of `qtype`, their fp16 scales (and mins) small and
    finite."""
    rng = np.random.default_rng(seed)
    sizes = {QT.Q8_0: (32, 34), QT.Q5_0: (32, 22), QT.Q5_1: (32, 24), QT.Q4_K: (256, 144)}
    elems, size = {**sizes, QT.Q6_K: (256, 210)}[qtype]
    blocks = rng.integers(0, 256, (ROWS * COLS // elems, size), dtype=np.uint8)
    # where the block's fp16 scale d sits, and its min's (dmin or m) for kinds that have one
    at = {QT.Q6_K: [208], QT.Q5_1: [0, 2], QT.Q4_K: [0, 2]}.get(qtype, [0])
    for offset in at:
        blocks[:, offset : offset + 2] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    return BlockSegment(torch.from_numpy(blocks.reshape(ROWS, -1)), qtype)


def _outlier_rows(rows: int) -> torch.Tensor:
    """`[rows, COLS]` activations near 1 with three channels near 500, as Gemma's are."""
    x = torch.randn(rows, COLS, generator=torch.Generator().manual_seed(rows))
    x[:, [3, 200, 301]] *= 500.0
    return x


KINDS = [QT.Q8_0, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q6_K]


@pytest.mark.parametrize("qtype", KINDS, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 5])
def test_a_second_code_or_float_activations_keep_outlier_rows_exact(qtype: QT, rows: int) -> None:
    """Against fp32 on the dequantized weight: one code errs by over 1e-3 of the output's
    scale where outliers sit in a block; a second code cuts that over 50-fold, to within
    5e-4, and float activations stay within fp32 rounding. Kinds with a min term (Q5_1,
    Q4_K; Q4_K in tiles of 8 rows) weigh it by the row's exact sum: counted once, not once
    per code."""
    segment = _segment(qtype, seed=rows)
    x = _outlier_rows(rows)
    want = x @ ggml_dequantize(segment.blocks, qtype, COLS).T  # [rows, ROWS] fp32
    scale = want.abs().max()

    def error(activations: str) -> float:
        got = BlockWeight([segment], COLS, activations).matmul(x)
        return float((got - want).abs().max() / scale)

    one_code = error("int8")
    assert one_code > 1e-3
    assert error("int8x2") < min(5e-4, one_code / 50)
    assert error("float") < 1e-5


def test_the_residual_is_what_one_code_per_block_leaves() -> None:
    """`int8_residual` is below half a step per input, a step being the block's max / 127."""
    x = _outlier_rows(3)
    left = int8_residual(x, 256).view(3, 2, 256)
    step = x.view(3, 2, 256).abs().amax(-1, keepdim=True) / 127
    assert bool((left.abs() <= step / 2 + 1e-6).all())
    assert float(left.abs().max()) > 0


def test_mixed_kinds_keep_one_code_and_an_unknown_precision_is_refused() -> None:
    """A fused layer of a K kind beside a 32-input kind rounds per 256 and per 32: no one
    residual serves both, so it stays "int8"; a misspelt precision is a clear error."""
    mixed = BlockWeight([_segment(QT.Q6_K, 0), _segment(QT.Q8_0, 1)], COLS, "int8x2")
    assert mixed.activations == "int8"
    with pytest.raises(ValueError, match="activations must be one of"):
        BlockWeight([_segment(QT.Q8_0, 0)], COLS, "int4")
