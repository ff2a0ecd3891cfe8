"""Our kernel for stored 4- and 8-bit weights with fp32 activations (`minivllm::qgemv`; AVX2,
and AVX-512 VNNI for one row of 4-bit weights where it runs): equal to the fp32 matmul of the
dequantized weights over the activations rounded to 16 bits per group of 32
(`quantize_activations`), in any row count, thread count and shape it accepts, and within that
rounding of the exact fp32 matmul; bad shapes refused with a message; traced by
torch.compile; and the linear layer's and LM head's dispatch by dtype and row count."""

from __future__ import annotations

import platform

import pytest
import torch

from minivllm.layers.cpu_kernels import KernelBuildError, _build, cpu_caps, cpu_kernels_available
from minivllm.layers.embedding import ParallelLMHead
from minivllm.layers.linear import MergedColumnParallelLinear
from minivllm.layers.quantization.kernels.int4 import GROUP_SIZE, quantize_int4, split_int8
from minivllm.layers.quantization.kernels.qgemv import QGemvWeight, quantize_activations
from minivllm.layers.quantization.policy import stored_weight_kernel
from minivllm.layers.quantization.rows import kernel_rows
from tests.support.weight_methods import give_int4, give_q8_0_head

x86 = platform.machine().lower() in ("x86_64", "amd64")
pytestmark = pytest.mark.skipif(not x86, reason="the qgemv kernel is for x86 CPUs (AVX2)")


def test_the_kernel_builds_and_loads_on_every_x86_cpu_this_project_runs_on():
    """AVX2 and AVX-512 CPUs both run it (a build failure would silently fall back to dense
    fp32 weights, 3-4x slower at decode on AVX2-only CPUs)."""
    assert cpu_kernels_available()
    assert stored_weight_kernel(torch.device("cpu"), torch.float32) == "qgemv"


@pytest.mark.parametrize(
    "compiler, message", [("/nonexistent/g++", "no C\\+\\+ compiler"), ("false", "failed")]
)
def test_a_build_that_cannot_run_says_why(compiler, message, tmp_path, monkeypatch):
    """`cpu_kernels_available` logs this and keeps torch's ops (no crash, no half-written
    file)."""
    monkeypatch.setenv("CXX", compiler)
    with pytest.raises(KernelBuildError, match=message):
        _build(tmp_path / "qgemv.so")
    assert list(tmp_path.iterdir()) == []


def _int4_weight(out: int, size: int, seed: int):
    """Random 4-bit weights whose scales and mins are fp16 values, as a GGUF's are."""
    gen = torch.Generator().manual_seed(seed)
    q = quantize_int4(torch.randn(out, size, generator=gen) * 0.05)
    scales = q.scales.half().float()
    return type(q)(q.codes, scales, (q.zeros - 8 * scales).half().float() + 8 * scales)


def _reference(x: torch.Tensor, dense: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes, in float64: `w = q * s + min`; the `q * s` part over the
    activations rounded to 8 bits per group, the min part over the exact ones."""
    xq = quantize_activations(x).double()
    if mins is None:
        return (xq @ dense.double().t()).float()
    full_mins = mins.double().repeat_interleave(GROUP_SIZE, dim=1)  # [out, in]
    return (xq @ (dense.double() - full_mins).t() + x.double() @ full_mins.t()).float()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 13, 16])
@pytest.mark.parametrize("shape", [(96, 64), (36, 288), (1000, 576)])
def test_4bit_matmul_equals_the_matmul_over_16_bit_activations(threads, rows, shape):
    """Codes two to a byte (Q4_0/Q4_1's order), `w = (q - 8) s + z`; outputs in blocks of 4
    split over threads, row tiles of 8/4/2/1, the one-row path's four columns at once."""
    q = _int4_weight(*shape, seed=rows)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(1))
    x[0, :32] = 0.0  # a group of zeros: no scale to divide by
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = QGemvWeight.from_int4(q).matmul(x)
    finally:
        torch.set_num_threads(before)
    want = _reference(x, q.dequantize(), q.zeros - 8 * q.scales)
    assert got.dtype == torch.float32 and got.shape == (rows, shape[0])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    exact = x @ q.dequantize().t()
    assert (got - exact).norm() / exact.norm() < 1e-4  # 16-bit activations


def test_activations_round_to_16_bits_per_group():
    """Errors within half a step (max|x| / 32767) of each group; zeros stay zeros."""
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    xq = quantize_activations(x)
    step = x.view(3, 2, 32).abs().amax(-1, keepdim=True) / 32767  # [3, 2, 1]
    assert ((xq - x).view(3, 2, 32).abs() <= step / 2 + 1e-9).all()
    assert torch.equal(quantize_activations(torch.zeros(1, 32)), torch.zeros(1, 32))


@pytest.mark.parametrize("rows", [1, 3, 6])
def test_8bit_matmul_equals_the_fp32_matmul_of_the_q8_0_weight(rows):
    """The Q8_0 head: `int4.split_int8`'s halves made whole again, `w = q * s`, q in -128..127
    (both extremes included)."""
    gen = torch.Generator().manual_seed(rows)
    codes = torch.randint(-128, 128, (300, 128), generator=gen, dtype=torch.int8)
    codes[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)
    scales = torch.rand(300, 128 // GROUP_SIZE, generator=gen) * 0.01
    scales = scales.half().float()  # fp16, as Q8_0 stores them
    head = QGemvWeight.from_int8_halves(*split_int8(codes, scales))
    dense = codes.float() * scales.repeat_interleave(GROUP_SIZE, dim=1)  # [300, 128]
    x = torch.randn(rows, 128, generator=gen)
    torch.testing.assert_close(head.matmul(x), _reference(x, dense, None), rtol=1e-4, atol=1e-4)


def test_bad_shapes_are_refused_with_a_message():
    q = QGemvWeight.from_int4(_int4_weight(8, 64, seed=0))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.minivllm.qgemv(torch.randn(1, 48), q.codes, q.scales, q.mins, 4)
    with pytest.raises(RuntimeError, match="codes must be"):
        torch.ops.minivllm.qgemv(torch.randn(1, 96), q.codes, q.scales, q.mins, 4)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.minivllm.qgemv(torch.randn(1, 64).double(), q.codes, q.scales, q.mins, 4)
    with pytest.raises(RuntimeError, match="multiple of 4"):
        torch.ops.minivllm.qgemv(torch.randn(1, 64), q.codes[:6], q.scales[:6], q.mins[:6], 4)
    with pytest.raises(ValueError, match="do not match"):
        QGemvWeight(q.codes, q.scales[:, :1], None, 4)
    with pytest.raises(ValueError, match="multiple of 4"):
        QGemvWeight.from_int4(_int4_weight(6, 64, seed=0))


def test_torch_compile_traces_the_operator():
    """The compiled decode step calls it inside its graph: the fake kernel gives the shape."""
    q = QGemvWeight.from_int4(_int4_weight(64, 96, seed=2))
    x = torch.randn(1, 96)
    compiled = torch.compile(
        lambda t: q.matmul(torch.relu(t)) * 2, backend="inductor", fullgraph=True
    )
    torch.testing.assert_close(compiled(x), q.matmul(torch.relu(x)) * 2)


def test_linear_layer_uses_the_kernel_for_few_fp32_rows_and_dense_for_many():
    """The dense weight differs on purpose from the 4-bit one, to tell the paths apart."""
    torch.manual_seed(0)
    layer = MergedColumnParallelLinear(64, [32, 32])
    layer.weight.data.normal_()
    q = _int4_weight(64, 64, seed=3)
    assert "QGemvWeight <= " in give_int4(layer, q).name
    few, many = torch.randn(kernel_rows().qgemv, 64), torch.randn(kernel_rows().qgemv + 1, 64)
    torch.testing.assert_close(
        layer(few), _reference(few, q.dequantize(), q.zeros - 8 * q.scales), rtol=1e-4, atol=1e-4
    )
    torch.testing.assert_close(layer(many), many @ layer.weight.t())


def test_lm_head_runs_its_q8_0_weight_for_small_fp32_steps():
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(-128, 128, (52, 64), generator=gen, dtype=torch.int8)
    scales = torch.rand(52, 2, generator=gen) * 0.01
    head = ParallelLMHead(52, 64)
    head.weight.data.zero_()  # the dense weight: logits of zero tell which path ran
    assert "QGemvWeight" in give_q8_0_head(head, codes, scales).name
    hidden = torch.randn(1, 64, generator=gen)
    assert head(hidden).abs().sum() > 0
    assert head(torch.randn(kernel_rows().qgemv + 1, 64)).abs().sum() == 0


def test_a_bf16_models_q8_0_head_runs_the_kernel_for_one_row_only():
    """bf16 activations are widened to fp32; two rows go to the dense head."""
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(-128, 128, (52, 64), generator=gen, dtype=torch.int8)
    scales = (torch.rand(52, 2, generator=gen) * 0.01).half().float()
    head = ParallelLMHead(52, 64).to(torch.bfloat16)
    head.weight.data.zero_()  # the dense weight: logits of zero tell which path ran
    assert "QGemvWeight" in give_q8_0_head(head, codes, scales).name
    hidden = torch.randn(1, 64, generator=gen).bfloat16()
    dense = codes.float() * scales.repeat_interleave(GROUP_SIZE, dim=1)  # [52, 64]
    logits = head(hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(
        logits, _reference(hidden.float(), dense, None), rtol=1e-4, atol=1e-4
    )
    assert head(torch.randn(2, 64).bfloat16()).abs().sum() == 0


@pytest.mark.skipif(
    not (x86 and cpu_kernels_available() and cpu_caps().qgemv_vnni),
    reason="the AVX-512 VNNI path (the AVX2 path is tested above)",
)
def test_a_bf16_layer_runs_one_row_on_the_vnni_path_and_more_on_torchs_int4_kernel():
    """The linear layer of a bf16 model with 4-bit weights, where the VNNI path runs: one row
    through qgemv (its integers: the reference), 2-4 rows through torch's int4 kernel, more
    through the dense weight (made different on purpose, to tell the paths apart)."""
    torch.manual_seed(0)
    layer = MergedColumnParallelLinear(576, [480, 480]).to(torch.bfloat16)
    layer.weight.data.normal_()
    q = _int4_weight(960, 576, seed=6)
    assert "qgemv_vnni <= " in give_int4(layer, q).name
    one = torch.randn(1, 576).bfloat16()
    out = layer(one)
    assert out.dtype == torch.bfloat16
    want = _reference(one.float(), q.dequantize(), q.zeros - 8 * q.scales)
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)  # bf16 output
    few = torch.randn(3, 576).bfloat16()
    torch.testing.assert_close(
        layer(few).float(), few.float() @ q.dequantize().t(), rtol=2e-2, atol=2e-2
    )
    many = torch.randn(kernel_rows().int4 + 1, 576).bfloat16()
    torch.testing.assert_close(layer(many), many @ layer.weight.t())
