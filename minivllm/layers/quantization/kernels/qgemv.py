"""4- and 8-bit weights times fp32 activations on x86 CPUs with AVX2: our own kernel.

torch's packed int4 kernel (`minivllm.layers.quantization.kernels.int4`) is vectorised for
bf16 activations only, and on a CPU without native bf16 (AVX2 only: AMD Zen 3, Intel before Cooper
Lake) the model computes in fp32, where the only torch kernels left read a dense fp32 copy of every
weight: 32 bits a weight for a GGUF that stores 4.5. `csrc/qgemv.cpp` multiplies fp32 activations by
the weights as llama.cpp stores them (groups of 32, `w = q * scale + min`; 4-bit codes two to a byte
as in Q4_0/Q4_1, or 8-bit as in Q8_0), with integer dot products (`vpmaddwd`) over the activations
quantized per group of 32 to 16-bit integers (8-bit ones, llama.cpp's Q8 activations, fail the
quality bar of tests/models/test_quality.py; the min term takes the exact fp32 sums), so the only
rounding beyond fp32's is the activations' to 16 bits (`quantize_activations` is the reference). The
weights are stored in blocks of 4 output columns interleaved group by group (`QGemvWeight` packs
them), read in one stream, with fp16 scales and mins as GGUF stores them. It is the torch operator
`minivllm::qgemv`, built and loaded by `minivllm.layers.cpu_kernels` (so compiled graphs call it
too).

The kernel is for few rows (decode steps); above `qgemv` rows (`minivllm.layers.quantization.
rows`) the dense fp32 matmul (MKL) is as fast, so a layer keeps its dense weight for those
steps, its method's row table handing over there, as the int4 layers do.
"""

from __future__ import annotations

import torch

from minivllm.layers.quantization.kernels.int4 import GROUP_SIZE, Int4Weight

COLUMNS = 4  # output columns whose groups the kernel stores interleaved


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """The kernel's view of fp32 activations `[..., K]`: each group of 32 rounded to 16-bit
    integers, `step * round(x / step)` with `step = max|x| / 32767` (what its integer dot
    products multiply)."""
    groups = x.reshape(*x.shape[:-1], -1, GROUP_SIZE)  # [..., K / 32, 32]
    amax = groups.abs().amax(dim=-1, keepdim=True)  # [..., K / 32, 1]
    inverse = torch.where(amax > 0, 32767.0 / amax, torch.zeros_like(amax))
    return ((groups * inverse).round() * (amax / 32767.0)).reshape(x.shape)


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """`[N, groups, ...]` -> the same bytes in blocks of COLUMNS outputs, group by group:
    `[N / 4, groups, 4, ...]`, flattened back to `[N, -1]`."""
    n, groups = t.shape[:2]
    blocks = t.reshape(n // COLUMNS, COLUMNS, groups, -1).transpose(1, 2)  # [N/4, g, 4, ...]
    return blocks.contiguous().reshape(n, -1)


class QGemvWeight:
    """A `[out, in]` weight in the kernel's layout, ready for `matmul` (fp32 activations).
    `codes` `[out, in * bits / 8]` bytes and `scales`, `mins` `[out, in / 32]` are given in
    plain row order and interleaved here."""

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
        bits: int,
    ) -> None:
        out, width = codes.shape
        groups = width * 8 // bits // GROUP_SIZE
        if bits not in (4, 8) or scales.shape != (out, groups):
            raise ValueError(
                f"qgemv: {bits}-bit codes {tuple(codes.shape)} do not match "
                f"scales {tuple(scales.shape)}"
            )
        if out % COLUMNS:
            raise ValueError(f"qgemv: the output size ({out}) must be a multiple of {COLUMNS}")
        self.bits = bits
        self.out_features = out
        self.codes = _interleave(codes.reshape(out, groups, -1))  # [out, in * bits / 8]
        # fp16, as GGUF stores them (Q4_K's products of two scales round to 11 bits)
        self.scales = _interleave(scales.half()[..., None])  # [out, in / 32]
        self.mins = (
            torch.empty(0, dtype=torch.half)
            if mins is None
            else _interleave(mins.half()[..., None])
        )

    @staticmethod
    def supports(weight: Int4Weight) -> bool:
        """Whether a weight of this shape fits the kernel (outputs in blocks of 4)."""
        return weight.shape[0] % COLUMNS == 0

    @staticmethod
    def from_int4(weight: Int4Weight) -> QGemvWeight:
        """Codes two to a byte per group of 32 (low nibble: input i, high: input 16 + i), and
        `w = (q - 8) * s + z` rewritten as `q * s + (z - 8 s)`."""
        out, size = weight.shape
        codes = weight.codes.view(out, size // GROUP_SIZE, 2, GROUP_SIZE // 2)  # [out, g, 2, 16]
        packed = (codes[:, :, 0] | (codes[:, :, 1] << 4)).reshape(out, size // 2)  # [out, in/2]
        return QGemvWeight(packed, weight.scales, weight.zeros - 8 * weight.scales, 4)

    @staticmethod
    def from_int8_halves(high: Int4Weight, low: Int4Weight) -> QGemvWeight:
        """The 8-bit weight that `int4.split_int8` split in two halves, whole again: codes
        `q = 16 (h - 8) + l` (int8), scales those of the low half."""
        q = 16 * (high.codes.to(torch.int16) - 8) + low.codes.to(torch.int16)  # [out, in]
        return QGemvWeight(q.to(torch.int8), low.scales, None, 8)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T`: `[..., in]` fp32 or bf16 -> `[..., out]` fp32."""
        rows = x.reshape(-1, x.shape[-1]).float()  # [N, in]
        out = torch.ops.minivllm.qgemv(rows, self.codes, self.scales, self.mins, self.bits)
        return out.view(*x.shape[:-1], self.out_features)  # [..., out]
