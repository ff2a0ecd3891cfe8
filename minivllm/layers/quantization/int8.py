"""Optional int8 weights for the linear layers on CPU (`quantization="int8"`).

Weights are quantized once at load, symmetric per output channel, and prepacked for fbgemm;
activations are quantized per call and per token (dynamic quantization), so the matmul runs
on int8 with int32 accumulation and fp32 output, faster than fp32 at decode batch sizes
(docs/benchmarks.md). It is not token-exact with fp32 (vLLM's rule applies: at a
divergence each side's token is in the other's top-5), so it is an option, never the
default.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any

import torch

from minivllm.layers.cpu_kernels import cpu_caps

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("int8",)
# Which layers get int8 weights, chosen by measurement on SmolLM2-135M (12 prompts, 24 greedy
# tokens, vLLM's top-5 rule at the first divergence against fp32): gate_up_proj alone (the
# largest layer, about half of a decoder layer's FLOPs, its input RMS-normalized) kept the
# rule on 12/12 prompts; adding qkv_proj kept it on 11/12, down_proj on 9/12, all four
# projections on 11/12: their inputs carry outlier channels that 8 bits do not hold. An int8
# LM head kept the rule on the 12 prompts too, but its chat answer to "What is the capital of
# France?" lost "Paris", so the LM head stays fp32.
INT8_LAYERS = ("gate_up_proj",)


def check_quantization(method: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ValueError when `method` cannot run on this device / dtype."""
    if method is None:
        return
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization must be one of {QUANTIZATION_METHODS} or None, got {method!r}"
        )
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(
            "quantization='int8' runs on the CPU with dtype float32 only "
            f"(got device {device.type}, dtype {dtype})"
        )
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError("quantization='int8' needs torch's fbgemm engine, which this build lacks")


def pack_int8(weight: torch.Tensor) -> Any:
    """Quantize `weight` [out, in] symmetric per output channel and prepack it for fbgemm."""
    torch.backends.quantized.engine = "fbgemm"
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [out]
    zero_points = torch.zeros_like(scales, dtype=torch.int64)
    with warnings.catch_warnings():  # torch marks quantized tensors deprecated; fbgemm stays
        warnings.simplefilter("ignore", UserWarning)
        qweight = torch.quantize_per_channel(w, scales.double(), zero_points, 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(qweight, None)


@functools.cache
def int8_reduce_range() -> bool:
    """Whether activations must be quantized to 7 bits on this CPU.

    Without VNNI (AVX2, or AVX-512 before VNNI) fbgemm multiplies u8 x s8 pairs with an int16
    sum that saturates on full-range activations, so they get 7 bits. With VNNI the products
    accumulate straight into int32 and the 8th bit is worth keeping: with 7 bits on an
    AVX-512 VNNI CPU the default model's chat answer loses "Paris".
    """
    has_vnni = cpu_caps().vnni
    logger.info(
        "int8 linear layers: %s-bit activations (VNNI %s)",
        8 if has_vnni else 7,
        "present" if has_vnni else "absent",
    )
    return not has_vnni


def int8_linear(x: torch.Tensor, packed: Any) -> torch.Tensor:
    """`x @ W.T` with the prepacked int8 `W`: [..., in] float32 -> [..., out] float32."""
    # fbgemm quantizes the activations with one scale per tensor; dividing each row (token)
    # by its own max first makes that one scale per token, and the linear map lets the
    # row scale come back out of the product exactly.
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-6)  # [..., 1]
    return torch.ops.quantized.linear_dynamic(x / scale, packed, int8_reduce_range()) * scale
