"""Packed int4 weights: quantization error bounded, the CPU kernel equal to the dense matmul
of the same (dequantized) weights, and the linear layer's dispatch by row count."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from minivllm.layers.cpu_kernels import cpu_caps
from minivllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from minivllm.layers.quantization.chooser import int8_head_table
from minivllm.layers.quantization.kernels.int4 import (
    GROUP_SIZE,
    PackedInt4,
    PackedInt4Pair,
    int4_supported,
    quantize_int4,
    split_int8,
)
from minivllm.layers.quantization.rows import kernel_rows
from tests.support.weight_methods import give_int4

needs_int4 = pytest.mark.skipif(
    not int4_supported(torch.device("cpu"), torch.bfloat16), reason="no int4 CPU kernel"
)


def test_quantize_int4_error_is_within_half_a_step_per_group():
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(0))
    q = quantize_int4(w)
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) <= 15
    assert q.scales.shape == (48, 128 // GROUP_SIZE)
    step = q.scales.repeat_interleave(GROUP_SIZE, dim=1)  # [48, 128]
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()


def test_quantize_int4_refuses_a_ragged_input_size():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(torch.randn(4, 40))


@needs_int4
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_packed_int4_matmul_equals_dense_matmul_of_the_same_weights(rows: int):
    gen = torch.Generator().manual_seed(rows)
    q = quantize_int4(torch.randn(96, 256, generator=gen) * 0.05)
    x = torch.randn(rows, 256, generator=gen).bfloat16()
    got = PackedInt4(q).matmul(x)
    want = x.float() @ q.dequantize().t()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@needs_int4
def test_linear_layer_uses_int4_for_decode_rows_and_dense_for_prefill_rows():
    """Shards stacked as the fused layer stacks them; few rows go through the int4 kernel,
    many through the dense weight (which here differs on purpose, to tell them apart)."""
    torch.manual_seed(0)
    layer = MergedColumnParallelLinear(64, [32, 32]).to(torch.bfloat16)
    gate, up = torch.randn(32, 64) * 0.1, torch.randn(32, 64) * 0.1
    layer.weight.data.copy_(torch.cat([gate, up]))
    q = quantize_int4(torch.cat([gate, up]))
    give_int4(layer, q)
    layer.weight.data.zero_()  # only the int4 path can give a non-zero output now
    few = torch.randn(kernel_rows().int4, 64).bfloat16()
    many = torch.randn(kernel_rows().int4 + 1, 64).bfloat16()
    torch.testing.assert_close(
        layer(few).float(), few.float() @ q.dequantize().t(), rtol=2e-2, atol=2e-2
    )
    assert layer(many).abs().max() == 0


def test_int4_weights_of_the_wrong_shape_or_with_tensor_parallelism_are_refused():
    layer = RowParallelLinear(64, 32)
    with pytest.raises(ValueError, match="shape"):
        give_int4(layer, quantize_int4(torch.randn(32, 96)))
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        give_int4(
            RowParallelLinear(64, 32, tp_size=2, tp_rank=0), quantize_int4(torch.randn(32, 32))
        )


def test_forced_avx2_kernels_pick_fp32_and_int4_still_matches_dense():
    """On an AVX2-only CPU (torch's AVX2 kernels forced on this one) dtype "auto" is fp32,
    and the int4 kernel's AVX2 variant equals the dense matmul of the same weights."""
    import os
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from minivllm.config import EngineConfig\n"
        "from minivllm.engine.device import resolve_dtype\n"
        "from minivllm.layers.quantization.kernels.int4 import PackedInt4, quantize_int4\n"
        "assert torch.backends.cpu.get_cpu_capability() == 'AVX2'\n"
        "assert resolve_dtype(EngineConfig(), torch.device('cpu')) == torch.float32\n"
        "w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 0.05\n"
        "q = quantize_int4(w)\n"
        "x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1)).bfloat16()\n"
        "torch.testing.assert_close(PackedInt4(q).matmul(x).float(),\n"
        "                           x.float() @ q.dequantize().t(), rtol=2e-2, atol=2e-2)\n"
    )
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_split_int8_halves_sum_to_the_8bit_weight_exactly():
    """Every code -128..127: (16h + 8) s + (l - 8) s == q s up to float32 rounding, the low
    half centred on zero."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.arange(-128, 128, dtype=torch.int8).repeat(4, 2)  # [4, 512]
    scales = torch.rand(4, 512 // GROUP_SIZE, generator=gen) * 0.01
    high, low = split_int8(codes, scales)
    assert int(high.codes.max()) <= 15 and int(low.codes.max()) <= 15
    want = (codes.float().view(4, -1, GROUP_SIZE) * scales[..., None]).view(4, 512)
    torch.testing.assert_close(high.dequantize() + low.dequantize(), want, rtol=1e-6, atol=1e-7)
    assert low.dequantize().abs().max() <= 8 * scales.max()


@needs_int4
def test_the_int4_pair_matmul_equals_the_dense_8bit_matmul_for_few_rows():
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(-128, 128, (64, 256), generator=gen, dtype=torch.int8)
    scales = torch.rand(64, 256 // GROUP_SIZE, generator=gen) * 0.01
    pair = PackedInt4Pair(*split_int8(codes, scales))
    x = torch.randn(2, 256, generator=gen).bfloat16()
    weight = (codes.float().view(64, -1, GROUP_SIZE) * scales[..., None]).view(64, 256)
    want = x.float() @ weight.t()
    got = pair.matmul(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    # where no qgemv is built, the chooser's row table runs the pair for bf16 steps of up to
    # `int8_as_int4_pair` rows; an fp32 head never (the kernel is fast with bf16 only)
    no_qgemv = dataclasses.replace(cpu_caps(), kernels=False)
    table = int8_head_table(*split_int8(codes, scales), torch.bfloat16, no_qgemv)
    assert table is not None and [rows for rows, _ in table] == [kernel_rows().int8_as_int4_pair]
    fp32 = int8_head_table(*split_int8(codes, scales), torch.float32, no_qgemv)
    assert fp32 is None or not isinstance(fp32[0][1].__self__, PackedInt4Pair)
