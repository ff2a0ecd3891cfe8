"""How a linear layer's weight runs: one method object per layer, chosen once at load.

The shape is vLLM's `QuantizeMethodBase`: `create_weights(layer)` when the method is set
(before the checkpoint is loaded, for stored GGUF blocks), `process_weights_after_loading(layer)`
once it is loaded, and `apply(layer, x, bias)` at every step, which is all
`LinearBase.forward` does. The methods:

- `UnquantizedMethod`: the dense weight (fp32, or bf16 prepacked for oneDNN where this CPU's
  oneDNN has bf16 kernels: `minivllm.layers.quantization.kernels.onednn`).
- `Int8Method`: int8 weights for fbgemm (`quantization="int8"`, `.int8`).
- `Int4Method`: 4-bit weights for steps of few rows (torch's int4 kernel in bf16, with our
  qgemv at one row where its VNNI path runs; qgemv in fp32), the dense weight above.
- `GgmlBlockMethod`: a GGUF's quantized blocks as stored, every step size
  (`BlockWeight.matmul`); the dense weight is dropped.

The row counts at which one kernel hands over to the next are in `minivllm.layers.quantization.
rows`; which layer gets which method is decided in `minivllm.layers.quantization.chooser`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.layers.quantization.int8 import int8_linear, pack_int8
from minivllm.layers.quantization.kernels.block_weight import BlockWeight, Kernel
from minivllm.layers.quantization.kernels.onednn import OneDnnWeight, onednn_prepack_supported
from minivllm.layers.quantization.rows import RowTable, pick


class LinearLayer(Protocol):
    """What a method reads of its layer (a `minivllm.layers.linear.LinearBase`)."""

    weight: nn.Parameter  # [out, in] dense; [0, in] where stored blocks replace it
    tp_size: int


class LinearMethod:
    """How one linear layer computes `x @ weight.T (+ bias)`."""

    name = "dense"

    def create_weights(self, layer: LinearLayer) -> None:
        """Set the layer's weights up for this method, before the checkpoint is loaded."""

    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        """Put the loaded weights in the layout the kernel reads."""

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedMethod(LinearMethod):
    """The dense weight; in bf16 on a CPU with oneDNN bf16 kernels, prepacked once for them."""

    def __init__(self) -> None:
        self.onednn: OneDnnWeight | None = None

    @property
    def name(self) -> str:  # type: ignore[override]
        return "dense, oneDNN-prepacked" if self.onednn is not None else "dense"

    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        if onednn_prepack_supported(layer.weight):
            self.onednn = OneDnnWeight(layer.weight)

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # inside a compiled graph F.linear: the opaque packed tensor cannot be traced
        if self.onednn is not None and not torch.compiler.is_compiling():
            return self.onednn.matmul(x, bias)
        return F.linear(x, layer.weight, bias)


class Int8Method(LinearMethod):
    """int8 weights, symmetric per output channel, with int8 activations per token."""

    name = "int8"

    def __init__(self) -> None:
        self.packed: Any = None

    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        self.packed = pack_int8(layer.weight)

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = int8_linear(x, self.packed)
        return out if bias is None else out + bias


def check_whole(layer: LinearLayer, shape: tuple[int, int], what: str) -> None:
    """Weights kept as stored are the whole `[out, in]` weight: one process only."""
    if layer.tp_size != 1:
        raise ValueError(f"{what} weights are supported with tensor_parallel_size=1 only")
    if shape != tuple(layer.weight.shape):
        raise ValueError(
            f"{what} weight of shape {shape} for a {type(layer).__name__} of "
            f"shape {tuple(layer.weight.shape)}"
        )


# A method's `apply`: (layer, x, bias) -> x @ W.T + bias
Apply = Callable[[LinearLayer, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def small_step(kernel: Kernel) -> Apply:
    """A kernel of x alone as an `apply` entry of a row table (the bias added after it)."""

    def apply(layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = kernel(x)
        return out if bias is None else out + bias

    return apply


class Int4Method(LinearMethod):
    """4-bit weights for steps of few rows, the dense weight above: its row table, built by
    `minivllm.layers.quantization.chooser`, ends with the dense method's `apply`."""

    def __init__(self, small: RowTable[Kernel], dense: UnquantizedMethod, kernel: str) -> None:
        self.dense = dense
        self.table: RowTable[Apply] = (
            *((rows, small_step(k)) for rows, k in small),
            (float("inf"), dense.apply),
        )
        self.kernel = kernel  # what the small steps run, for the log

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"4-bit {self.kernel} + {self.dense.name}"

    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        self.dense.process_weights_after_loading(layer)

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return pick(self.table, x)(layer, x, bias)


class GgmlBlockMethod(LinearMethod):
    """The GGUF's quantized blocks as stored, for every step size; no dense weight."""

    name = "GGUF blocks"

    def __init__(self, weight: BlockWeight) -> None:
        self.weight = weight

    def create_weights(self, layer: LinearLayer) -> None:
        check_whole(layer, self.weight.shape, "GGUF block")
        # [0, in]: keeps the dtype and device for whoever asks, holds nothing
        layer.weight = nn.Parameter(
            layer.weight.new_empty(0, layer.weight.shape[1]), requires_grad=False
        )

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = self.weight.matmul(x)
        return out if bias is None else out + bias
