"""Dense bf16 weights prepacked for oneDNN on the CPU.

`F.linear` on a bf16 weight hands oneDNN the plain `[out, in]` layout, which it reorders into
its blocked one inside every call. Reordered once at load (`torch.ops.mkldnn.
_reorder_linear_weight`), the same matmul runs faster at the row counts of decode steps of
several sequences and short prefills, and as fast at a few hundred rows, with bit-identical results
(the same kernel, fed a ready layout: the "bf16 oneDNN" column of
`benchmarks/linear_kernels.py`, figures in docs/benchmarks.md). The packed copy costs the
weight's size once more in memory.

Only bf16 is prepacked: for fp32 oneDNN's kernel rounds differently from MKL's, and the fp32
path is the one held token-exact to HF transformers. Inside a `torch.compile`d graph the
layers keep `F.linear` (the opaque packed tensor cannot be traced).
"""

from __future__ import annotations

import torch

from minivllm.layers.cpu_kernels import cpu_caps

# The row count oneDNN picks its packed layout for; any row count runs on it.
PACK_ROWS_HINT = 16


def onednn_prepack_supported(weight: torch.Tensor) -> bool:
    """Whether `weight` can be prepacked here: bf16 on a CPU whose oneDNN has bf16 kernels
    (`CpuCaps.onednn_bf16`: an AVX2-only CPU such as AMD Zen 3 has none, and the reorder
    raises there, so its bf16 layers keep `F.linear`)."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and cpu_caps().onednn_bf16


class OneDnnWeight:
    """A `[out, in]` bf16 weight in oneDNN's blocked layout, ready for `matmul`."""

    def __init__(self, weight: torch.Tensor) -> None:
        if not onednn_prepack_supported(weight):
            raise ValueError(
                f"oneDNN prepacking takes a bf16 CPU weight, got {weight.dtype} on {weight.device}"
            )
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ W.T (+ bias)`: `[..., in]` -> `[..., out]` bf16."""
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # [N, in]
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)  # [..., out]
