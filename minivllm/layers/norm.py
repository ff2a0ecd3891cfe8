"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm block."""

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
            return rms_norm(x, self.weight, self.eps)
        x = x + residual
        return rms_norm(x, self.weight, self.eps), x

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
