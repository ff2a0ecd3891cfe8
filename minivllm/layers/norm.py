"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm block.

`RMSNorm` is Llama's (cast, then scale by the weight); `GemmaRMSNorm` is Gemma's, which scales
by `1 + weight` in float32 before the cast.
"""

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise the last dim of `x` by its root mean square, in float32, then scale by `weight`.

    Matches HF's `LlamaRMSNorm`: the statistics are taken in float32 and the result is cast
    back to the input dtype before the weight multiply.
    """
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: normalise in float32, scale by `1 + weight` in float32, then cast
    (HF's `Gemma2RMSNorm`; its checkpoints store the weight as an offset from 1)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension.

    `forward(x)` returns the normalised `x`. `forward(x, residual)` first adds the residual
    (in the input dtype, as HF does) and returns `(normed, new_residual)`, which lets a decoder
    layer carry the residual stream without a separate add.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.norm(x)
        x = x + residual
        return self.norm(x), x

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaling by `1 + weight` (Gemma 2 and 3); same fused-residual interface."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)
