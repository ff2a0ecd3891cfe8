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
from minivllm.layers.embedding import ParallelLMHead
from minivllm.layers.quantization.chooser import StoredFormat, choose_method
from minivllm.layers.quantization.head import BlockHead
from minivllm.layers.quantization.kernels.block_weight import BlockSegment, BlockWeight
from minivllm.layers.quantization.kernels.ggml_blocks import ggml_dequantize
from minivllm.layers.quantization.policy import TOKEN_EXACT, block_activations

pytestmark = pytest.mark.skipif(
    not cpu_kernels_available(), reason="the block kernels need an x86 CPU with AVX2"
)

ROWS, COLS = 64, 512


def _segment(qtype: QT, seed: int, rows: int = ROWS) -> BlockSegment:
    """Random valid `[rows, COLS]` blocks of `qtype`, their fp16 scales (and mins) small and
    finite."""
    rng = np.random.default_rng(seed)
    sizes = {QT.Q8_0: (32, 34), QT.Q5_0: (32, 22), QT.Q5_1: (32, 24), QT.Q4_K: (256, 144)}
    elems, size = {**sizes, QT.Q6_K: (256, 210)}[qtype]
    blocks = rng.integers(0, 256, (rows * COLS // elems, size), dtype=np.uint8)
    # where the block's fp16 scale d sits, and its min's (dmin or m) for kinds that have one
    at = {QT.Q6_K: [208], QT.Q5_1: [0, 2], QT.Q4_K: [0, 2]}.get(qtype, [0])
    for offset in at:
        blocks[:, offset : offset + 2] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    return BlockSegment(torch.from_numpy(blocks.reshape(rows, -1)), qtype)


def _outlier_rows(rows: int) -> torch.Tensor:
    """`[rows, COLS]` activations near 1 with three channels near 500, as Gemma's are."""
    x = torch.randn(rows, COLS, generator=torch.Generator().manual_seed(rows))
    x[:, [3, 200, 301]] *= 500.0
    return x


# Q8_0 and Q5_0 of 60 rows stay in the stored layout (tiles need a multiple of 8 rows)
KINDS = [(QT.Q8_0, 60), (QT.Q5_0, 60), (QT.Q5_1, ROWS), (QT.Q4_K, ROWS), (QT.Q6_K, ROWS)]


@pytest.mark.parametrize(("qtype", "weight_rows"), KINDS, ids=lambda q: getattr(q, "name", q))
@pytest.mark.parametrize("rows", [1, 5])
def test_a_second_code_or_float_activations_keep_outlier_rows_exact(
    qtype: QT, weight_rows: int, rows: int
) -> None:
    """Against fp32 on the dequantized weight: one code errs by over 1e-3 of the output's
    scale where outliers sit in a block; a second code cuts that over 50-fold, to within
    5e-4, and float activations stay within fp32 rounding. Kinds with a min term (Q5_1,
    Q4_K; Q4_K in tiles of 8 rows) weigh it by the row's exact sum: counted once, not once
    per code."""
    segment = _segment(qtype, seed=rows, rows=weight_rows)
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


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q5_0], ids=lambda q: q.name)
def test_q8_0_and_q5_0_in_tiles_always_carry_two_codes(qtype: QT) -> None:
    """In tiles of 8 rows (their kernel's only layout) Q8_0 and Q5_0 round each activation to
    two codes whatever the precision asked: within 5e-4 of fp32 on outlier rows, as Q4_0's
    tiles are; the same weight in the stored layout with one code is over 1e-3 off."""
    segment = _segment(qtype, seed=7)
    x = _outlier_rows(5)
    want = x @ ggml_dequantize(segment.blocks, qtype, COLS).T
    scale = want.abs().max()
    tiled = BlockWeight([segment], COLS, "int8")
    assert tiled.segments[0].x8
    assert float((tiled.matmul(x) - want).abs().max() / scale) < 5e-4
    stored = BlockWeight([_segment(qtype, seed=7, rows=ROWS - 4)], COLS, "int8")
    assert not stored.segments[0].x8
    want = x @ ggml_dequantize(stored.segments[0].blocks, qtype, COLS).T
    assert float((stored.matmul(x) - want).abs().max() / want.abs().max()) > 1e-3


def int8_residual(x: torch.Tensor, block: int) -> torch.Tensor:
    """What rounding `x` `[M, K]` to 8 bits per `block` inputs (step max|x| / 127, round to
    nearest even) leaves: `x - step * code`, as tensor maths."""
    flat = x.float().view(x.shape[0], -1, block)  # [M, K / block, block]
    amax = flat.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, 0.0)
    codes = (flat * inverse).round()
    return (flat - codes * (amax / 127.0)).view(x.shape)


def test_the_residual_is_what_one_code_per_block_leaves() -> None:
    """The residual is below half a step per input, a step being the block's max / 127."""
    x = _outlier_rows(3)
    left = int8_residual(x, 256).view(3, 2, 256)
    step = x.view(3, 2, 256).abs().amax(-1, keepdim=True) / 127
    assert bool((left.abs() <= step / 2 + 1e-6).all())
    assert float(left.abs().max()) > 0


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_1], ids=lambda q: q.name)
def test_the_kernel_takes_the_second_code_as_a_second_row(qtype: QT) -> None:
    """Asked for a second code, the operator computes what x's first code stands for and what
    it leaves as two rows of one call, and adds their outputs: bit for bit the tensor-maths
    formulation (x - left, then left) through the one-code operator. A block that does not
    divide the rows is refused with a message."""
    block = 256 if qtype == QT.Q4_K else 32
    weight = BlockWeight([_segment(qtype, seed=3)], COLS, "int8")
    call = torch.ops.minivllm.ggml_matmul_kinds
    for rows in (1, 5):
        x = _outlier_rows(rows)
        left = int8_residual(x, block)
        parts = call(torch.cat([x - left, left]), weight._blocks, weight._kinds, ROWS, 0)
        got = call(x, weight._blocks, weight._kinds, ROWS, 0, block)
        assert torch.equal(got, parts[:rows] + parts[rows:])
        assert not torch.equal(got, call(x, weight._blocks, weight._kinds, ROWS, 0))
    with pytest.raises(RuntimeError, match="does not divide"):
        call(_outlier_rows(1), weight._blocks, weight._kinds, ROWS, 0, 96)


def test_mixed_kinds_keep_one_code_and_an_unknown_precision_is_refused() -> None:
    """A fused layer of a K kind beside a 32-input kind rounds per 256 and per 32: no one
    residual serves both, so it stays "int8"; a misspelt precision is a clear error."""
    mixed = BlockWeight([_segment(QT.Q6_K, 0), _segment(QT.Q8_0, 1)], COLS, "int8x2")
    assert mixed.activations == "int8"
    with pytest.raises(ValueError, match="activations must be one of"):
        BlockWeight([_segment(QT.Q8_0, 0)], COLS, "int4")


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda q: q.name)
def test_a_block_head_takes_one_code_and_its_top_logits_stay_fp32(qtype: QT) -> None:
    """The LM head on K-kind blocks gets one code even where its blocks ask for two: its
    highest logits are computed again in fp32 from the same rows, so the greedy token and
    the top logits are the dequantized head's whatever the first pass rounded."""
    segment = _segment(qtype, 3, rows=256)  # a 256-token vocabulary
    head = ParallelLMHead(256, COLS)
    stored = StoredFormat(blocks=(segment,), activations="int8x2")
    method = choose_method(head, stored, TOKEN_EXACT)
    assert isinstance(method, BlockHead) and method.weight.activations == "int8"
    hidden = torch.randn(6, COLS, generator=torch.Generator().manual_seed(0))
    exact = hidden @ ggml_dequantize(segment.blocks, qtype, COLS).float().T  # [6, 256]
    logits = head(hidden)
    top = exact.topk(4)
    assert torch.equal(logits.topk(4).indices, top.indices)
    torch.testing.assert_close(logits.gather(-1, top.indices), top.values, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(logits, exact, rtol=1e-5, atol=1e-4)  # the rest: one code's


def test_layers_fed_by_a_norm_take_one_code_on_k_kinds() -> None:
    """q/k/v and gate/up on K-kind blocks round their activations once (their inputs leave a
    norm); o_proj and down_proj, whose inputs carry the huge channels, keep two codes, as do
    the 32-input kinds everywhere; mixed kinds keep the one code they can have."""
    k_kind, small = [_segment(QT.Q4_K, 0)], [_segment(QT.Q5_0, 0)]
    layers = "model.layers.3."
    assert block_activations(k_kind, layers + "self_attn.qkv_proj") == "int8"
    assert block_activations(k_kind, layers + "mlp.gate_up_proj") == "int8"
    assert block_activations(k_kind, layers + "self_attn.o_proj") == "int8x2"
    assert block_activations(k_kind, layers + "mlp.down_proj") == "int8x2"
    assert block_activations(small, layers + "mlp.gate_up_proj") == "int8x2"
    assert block_activations([_segment(QT.Q6_K, 0), _segment(QT.Q8_0, 1)], "qkv_proj") == "int8"
