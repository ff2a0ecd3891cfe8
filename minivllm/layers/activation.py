"""Gated activations for the fused gate/up projection of a gated MLP, and soft-capping.

`[gate | up] -> act(gate) * up`: SiLU for Llama-style SwiGLU, GELU with the tanh approximation
for Gemma (GeGLU). `soft_cap` bounds logits smoothly (Gemma 2's attention and final logits).
"""

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` where `x` is `[..., 2 * d]` holding `[gate | up]`; returns `[..., d]`."""
    gate, up = x.chunk(2, dim=-1)  # each [..., d]
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`gelu_tanh(gate) * up` where `x` is `[..., 2 * d]` holding `[gate | up]`; `[..., d]`."""
    gate, up = x.chunk(2, dim=-1)  # each [..., d]
    return F.gelu(gate, approximate="tanh") * up


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """`cap * tanh(x / cap)`: about `x` for small values, never beyond `cap`."""
    return torch.tanh(x / cap) * cap


class SiluAndMul(nn.Module):
    """Module wrapper of `silu_and_mul`, applied to the output of a merged gate_up_proj."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """Module wrapper of `gelu_tanh_and_mul`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_and_mul(x)


# HF's `hidden_act` / `hidden_activation` names -> the gated activation module.
GATED_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "silu": SiluAndMul,
    "gelu_pytorch_tanh": GeluTanhAndMul,
    "gelu_tanh": GeluTanhAndMul,
}


def get_gated_activation(name: str) -> nn.Module:
    """The gated activation for an HF activation name; ValueError for one we do not have."""
    if name not in GATED_ACTIVATIONS:
        raise ValueError(
            f"activation {name!r} is not supported; supported: {', '.join(GATED_ACTIVATIONS)}"
        )
    return GATED_ACTIVATIONS[name]()
