"""The one decision of how weights run (minivllm/layers/quantization/policy.py), no model:
the default keeps a GGUF's blocks and 4-bit tensors as stored on the CPU, float32 asked for
explicitly is the token-exact dense path, and a quantization that cannot run here is refused
with a message, before any weight is loaded."""

from __future__ import annotations

import pytest
import torch

from minivllm.config import EngineConfig
from minivllm.layers.cpu_kernels import cpu_caps
from minivllm.layers.quantization.policy import TOKEN_EXACT, WeightPolicy

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
kernels = pytest.mark.skipif(not cpu_caps().kernels, reason="our CPU kernels do not run here")


def _decide(
    compute: torch.dtype,
    tp_size: int = 1,
    gguf: bool = True,
    device: torch.device = CPU,
    **options: object,
) -> WeightPolicy:
    """The policy for engine `options`, computing in `compute` on `device`."""
    return WeightPolicy.decide(EngineConfig(**options), device, compute, tp_size, gguf=gguf)


@kernels
def test_the_default_fp32_cpu_path_keeps_blocks_and_runs_4bit_weights_on_qgemv() -> None:
    policy = _decide(torch.float32)
    assert policy == WeightPolicy(
        keep_blocks=True, stored_kernel="qgemv", int8=False, quantize_int4=False, token_exact=False
    )


def test_explicit_float32_is_the_token_exact_dense_path() -> None:
    """No blocks and no qgemv: every weight dense, as HF computes it."""
    policy = _decide(torch.float32, dtype="float32")
    assert policy is TOKEN_EXACT  # the one named policy
    assert policy.token_exact and not policy.keep_blocks and policy.stored_kernel is None


@kernels
def test_int4_asked_with_explicit_float32_runs_qgemv_and_is_not_token_exact() -> None:
    policy = _decide(torch.float32, dtype="float32", quantization="int4")
    assert policy.stored_kernel == "qgemv" and policy.quantize_int4 and not policy.token_exact


def test_bf16_on_the_cpu_runs_4bit_weights_on_torchs_int4_kernel() -> None:
    assert _decide(torch.bfloat16, gguf=False).stored_kernel == "int4"
    assert not _decide(torch.bfloat16, gguf=False).keep_blocks  # an HF checkpoint has none


@pytest.mark.parametrize("options, tp_size", [({"quantization": "none"}, 1), ({}, 2)])
def test_none_and_tensor_parallelism_keep_every_weight_dense(options, tp_size) -> None:
    policy = _decide(torch.bfloat16, tp_size=tp_size, **options)
    assert not policy.keep_blocks and policy.stored_kernel is None


def test_int8_quantizes_and_keeps_no_stored_weights() -> None:
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("no fbgemm in this torch build")
    policy = _decide(torch.float32, quantization="int8")
    assert policy.int8 and policy.stored_kernel is None and not policy.keep_blocks


@pytest.mark.parametrize(
    "device, dtype, tp_size, message",
    [
        (CUDA, torch.bfloat16, 1, "quantization='int4' runs on the CPU"),
        (CPU, torch.bfloat16, 2, "tensor_parallel_size=1"),
    ],
)
def test_int4_where_it_cannot_run_is_refused(device, dtype, tp_size, message) -> None:
    with pytest.raises(ValueError, match=message):
        _decide(dtype, tp_size=tp_size, device=device, quantization="int4")


def test_int8_off_the_cpu_or_in_bf16_is_refused() -> None:
    with pytest.raises(ValueError, match="float32 only"):
        _decide(torch.bfloat16, quantization="int8")
