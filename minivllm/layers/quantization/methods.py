"""How a linear layer's weight runs: one method object per layer, chosen once at load.

The shape is vLLM's `QuantizeMethodBase`: `create_weights(layer)` when the method is set
(before the checkpoint is loaded, for stored GGUF blocks), `process_weights_after_loading(layer)`
once it is loaded, and `apply(layer, x, bias)` at every step, which is all
`LinearBase.forward` does. The methods:

- `UnquantizedMethod`: the dense weight (fp32, or bf16 prepacked for oneDNN where this CPU's
  oneDNN has bf16 kernels: `minivllm.layers.onednn`).
- `Int8Method`: int8 weights for fbgemm (`quantization="int8"`, `.int8`).
- `Int4Method`: 4-bit weights for steps of few rows (torch's int4 kernel in bf16, with our
  qgemv at one row where its VNNI path runs; qgemv in fp32), the dense weight above.
- `GgmlBlockMethod`: a GGUF's quantized blocks as stored, every step size
  (`BlockWeight.matmul`); the dense weight is dropped.

The row counts at which one kernel hands over to the next are in `minivllm.layers.
kernel_rows`; which layer gets which method is decided in `minivllm.engine.weight_policy`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.layers.block_weight import BlockWeight
from minivllm.layers.cpu_kernels import cpu_caps
from minivllm.layers.int4 import Int4Weight, PackedInt4, PackedInt4Pair
from minivllm.layers.onednn import OneDnnWeight, onednn_prepack_supported
from minivllm.layers.qgemv import QGemvWeight
from minivllm.layers.quantization.int8 import int8_linear, pack_int8
from minivllm.layers.quantization.rows import kernel_rows


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


class Int4WithQGemvRow:
    """A 4-bit weight for bf16 steps: our qgemv kernel up to `kernel_rows().qgemv_vnni_bf16`
    rows (its AVX-512 VNNI path, faster there than torch's int4 kernel), torch's int4 kernel
    above. It holds the weight in both layouts (5 more bits a weight)."""

    def __init__(self, weight: Int4Weight, dtype: torch.dtype) -> None:
        self.packed = PackedInt4(weight, dtype)
        self.one_row = QGemvWeight.from_int4(weight)
        self.one_row_max = kernel_rows().qgemv_vnni_bf16  # read once: compiled steps too
        self.max_rows = self.packed.max_rows

    def fits(self, x: torch.Tensor) -> bool:
        return self.packed.fits(x)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T`: `[..., in]` -> `[..., out]` in x's dtype."""
        if x.numel() // x.shape[-1] <= self.one_row_max:
            return self.one_row.matmul(x).to(x.dtype)
        return self.packed.matmul(x)


SmallStepWeight = PackedInt4 | PackedInt4Pair | QGemvWeight | Int4WithQGemvRow


def pack_4bit(
    weight: Int4Weight, dtype: torch.dtype
) -> PackedInt4 | QGemvWeight | Int4WithQGemvRow | None:
    """A 4-bit weight in the layout of the kernel that runs `dtype` activations: qgemv for
    fp32, torch's int4 (with qgemv's VNNI path at one row where it runs) for bf16; None where
    that kernel does not take its shape (the layer stays dense)."""
    if dtype == torch.float32:
        return QGemvWeight.from_int4(weight) if QGemvWeight.supports(weight) else None
    if QGemvWeight.supports(weight) and cpu_caps().qgemv_vnni:
        return Int4WithQGemvRow(weight, dtype)
    return PackedInt4(weight, dtype)


def pack_8bit_halves(
    high: Int4Weight, low: Int4Weight, dtype: torch.dtype
) -> PackedInt4Pair | QGemvWeight | None:
    """An 8-bit weight given as `int4.split_int8`'s two halves (a Q8_0 LM head), for `dtype`
    activations: whole again for our kernel (bf16 activations too, up to
    `kernel_rows().qgemv_bf16_head` rows), else two packed int4 halves for torch's; None
    where no kernel takes its shape."""
    if not QGemvWeight.supports(low):
        return None if dtype == torch.float32 else PackedInt4Pair(high, low)
    if dtype == torch.float32:
        return QGemvWeight.from_int8_halves(high, low)
    if cpu_caps().kernels:
        return QGemvWeight.from_int8_halves(high, low, kernel_rows().qgemv_bf16_head)
    return PackedInt4Pair(high, low)


def _check_whole(layer: LinearLayer, shape: tuple[int, int], what: str) -> None:
    """Weights kept as stored are the whole `[out, in]` weight: one process only."""
    if layer.tp_size != 1:
        raise ValueError(f"{what} weights are supported with tensor_parallel_size=1 only")
    if shape != tuple(layer.weight.shape):
        raise ValueError(
            f"{what} weight of shape {shape} for a {type(layer).__name__} of "
            f"shape {tuple(layer.weight.shape)}"
        )


class Int4Method(LinearMethod):
    """4-bit weights for steps of up to `small.max_rows` rows, the dense weight above."""

    def __init__(self, small: SmallStepWeight) -> None:
        self.small = small
        self.dense = UnquantizedMethod()

    @staticmethod
    def for_layer(layer: LinearLayer, weight: Int4Weight) -> Int4Method | None:
        """The method for `layer` with `weight`, its whole `[out, in]` 4-bit weight (shards
        stacked), packed for the kernel of the layer's dtype; None where that kernel does
        not take the layer's shape (it stays dense)."""
        _check_whole(layer, weight.shape, "int4")
        small = pack_4bit(weight, layer.weight.dtype)
        return None if small is None else Int4Method(small)

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"4-bit {type(self.small).__name__} + {self.dense.name}"

    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        self.dense.process_weights_after_loading(layer)

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.small.fits(x):
            return self.dense.apply(layer, x, bias)
        out = self.small.matmul(x)
        return out if bias is None else out + bias


class GgmlBlockMethod(LinearMethod):
    """The GGUF's quantized blocks as stored, for every step size; no dense weight."""

    name = "GGUF blocks"

    def __init__(self, weight: BlockWeight) -> None:
        self.weight = weight

    def create_weights(self, layer: LinearLayer) -> None:
        _check_whole(layer, self.weight.shape, "GGUF block")
        # [0, in]: keeps the dtype and device for whoever asks, holds nothing
        layer.weight = nn.Parameter(
            layer.weight.new_empty(0, layer.weight.shape[1]), requires_grad=False
        )

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = self.weight.matmul(x)
        return out if bias is None else out + bias
