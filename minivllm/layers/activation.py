"""Gated activation for the fused gate/up projection of a SwiGLU MLP."""

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` where `x` is `[..., 2 * d]` holding `[gate | up]`; returns `[..., d]`."""
    gate, up = x.chunk(2, dim=-1)  # each [..., d]
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """Module wrapper of `silu_and_mul`, applied to the output of a merged gate_up_proj."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
