"""Optional int8 weights for the linear layers on CPU (`quantization="int8"`).

Weights are quantized once at load, symmetric per output channel, and prepacked for
fbgemm; activations are quantized per call (dynamic quantization), so the matmul runs on
int8 with fp32 accumulation and output. On AVX2 the int8 matmul is 2-3x faster than fp32 at
decode batch sizes. It is not token-exact with fp32 (vLLM's rule applies: at a divergence
each side's token is in the other's top-5), so it is an option, never the default.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

QUANTIZATION_METHODS = ("int8",)
# Which layers get int8 weights. Per-tensor activation quantization loses too much where the
# input has outliers: on SmolLM2-135M, quantizing qkv_proj, o_proj or the LM head as well
# broke vLLM's top-5 rule on some prompts, and down_proj moved the first divergence to the
# first token; gate_up_proj alone (the largest layer, about half of a decoder layer's FLOPs,
# its input RMS-normalized) first diverged after 4-12 tokens, within the rule.
INT8_LAYERS = ("gate_up_proj",)


def check_quantization(method: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ValueError when `method` cannot run on this device / dtype."""
    if method is None:
        return
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS} or None, "
                         f"got {method!r}")
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError("quantization='int8' runs on the CPU with dtype float32 only "
                         f"(got device {device.type}, dtype {dtype})")
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError("quantization='int8' needs torch's fbgemm engine, which this build "
                         "lacks")


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


def int8_linear(x: torch.Tensor, packed: Any) -> torch.Tensor:
    """`x @ W.T` with the prepacked int8 `W`: [..., in] float32 -> [..., out] float32."""
    # reduce_range: 7-bit activations, so AVX2's int16 pair sums cannot saturate (without it
    # the outputs are garbage on AVX2 machines).
    return torch.ops.quantized.linear_dynamic(x, packed, True)


def quantize_model_int8(model: torch.nn.Module) -> int:
    """Switch the INT8_LAYERS of `model` to int8 weights; returns how many layers."""
    layers = [
        module for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in INT8_LAYERS and hasattr(module, "quantize_int8")
    ]
    for layer in layers:
        layer.quantize_int8()
    return len(layers)
