"""Which kernel runs a checkpoint's 4- and 8-bit weights as stored, one dispatch for all.

- `"int4"`: torch's packed int4 kernel with bf16 activations (`minivllm.layers.int4`), where
  the model computes in bf16 on the CPU (CPUs with native bf16, by default); one-row steps
  (one sequence decoding) take our qgemv kernel instead where its AVX-512 VNNI path runs
  (`Int4WithQGemvRow`).
- `"qgemv"`: our AVX2 kernel with fp32 activations (`minivllm.layers.qgemv`), where the model
  computes in fp32 on an x86 CPU (AVX2-only CPUs, by default).
- None: dense weights (CUDA, other CPUs, or the kernel could not be built).

Each packs the weights for steps of few rows; larger steps use the layer's dense weight.
"""

from __future__ import annotations

import torch

from minivllm.layers.cpu_kernels import cpu_kernels_available
from minivllm.layers.int4 import Int4Weight, PackedInt4, PackedInt4Pair, int4_supported
from minivllm.layers.qgemv import QGEMV_BF16_HEAD_MAX_ROWS, QGemvWeight, vnni_path


class Int4WithQGemvRow:
    """A 4-bit weight for bf16 steps of up to `max_rows` rows: our qgemv kernel at one row
    (its AVX-512 VNNI path, faster there than torch's int4 kernel), torch's int4 kernel above.
    It holds the weight in both layouts (5 more bits a weight). The VNNI path is as fast at 2-4
    rows too, but with it there the default model's teacher-forced top-1 agreement in steps of
    4 tokens falls under the quality bar (tests/models/test_quality.py), so those rows keep
    torch's kernel. Figures: docs/benchmarks.md, "The thresholds the code uses"."""

    def __init__(self, weight: Int4Weight, dtype: torch.dtype) -> None:
        self.packed = PackedInt4(weight, dtype)
        self.one_row = QGemvWeight.from_int4(weight)
        self.max_rows = self.packed.max_rows

    def fits(self, x: torch.Tensor) -> bool:
        return self.packed.fits(x)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T`: `[..., in]` -> `[..., out]` in x's dtype."""
        if x.numel() == x.shape[-1]:  # one row
            return self.one_row.matmul(x).to(x.dtype)
        return self.packed.matmul(x)


SmallStepWeight = PackedInt4 | PackedInt4Pair | QGemvWeight | Int4WithQGemvRow


def stored_weight_kernel(device: torch.device, dtype: torch.dtype) -> str | None:
    """The kernel for weights kept as stored on `device` computing in `dtype` (see above)."""
    if int4_supported(device, dtype):
        return "int4"
    if device.type == "cpu" and dtype == torch.float32 and cpu_kernels_available():
        return "qgemv"
    return None


def pack_4bit(weight: Int4Weight,
              dtype: torch.dtype) -> PackedInt4 | QGemvWeight | Int4WithQGemvRow | None:
    """A 4-bit weight in the layout of the kernel that runs `dtype` activations; None where
    that kernel does not take its shape (the layer stays dense)."""
    if dtype == torch.float32:
        return QGemvWeight.from_int4(weight) if QGemvWeight.supports(weight) else None
    if QGemvWeight.supports(weight) and cpu_kernels_available() and vnni_path():
        return Int4WithQGemvRow(weight, dtype)
    return PackedInt4(weight, dtype)


def pack_8bit_halves(high: Int4Weight, low: Int4Weight,
                     dtype: torch.dtype) -> PackedInt4Pair | QGemvWeight | None:
    """An 8-bit weight given as `int4.split_int8`'s two halves (a Q8_0 LM head), for `dtype`
    activations: whole again for our kernel (bf16 activations too, at one row, where it is
    the fastest: `QGEMV_BF16_HEAD_MAX_ROWS`), else two packed int4 halves for torch's; None
    where no kernel takes its shape."""
    if not QGemvWeight.supports(low):
        return None if dtype == torch.float32 else PackedInt4Pair(high, low)
    if dtype == torch.float32:
        return QGemvWeight.from_int8_halves(high, low)
    if cpu_kernels_available():
        return QGemvWeight.from_int8_halves(high, low, QGEMV_BF16_HEAD_MAX_ROWS)
    return PackedInt4Pair(high, low)
