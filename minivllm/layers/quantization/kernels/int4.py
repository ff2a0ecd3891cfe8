"""4-bit weights executed as stored: torch's packed int4 kernel on the CPU.

A weight `[out, in]` is held as 4-bit codes `q` (0..15) with one scale and one zero per group
of `GROUP_SIZE` inputs: `w = (q - 8) * scale + zero`. That is torch's weight-only int4 layout
(`_weight_int4pack_mm_for_cpu`), and it holds llama.cpp's Q4_0 (`d * (q - 8)`), Q4_1
(`d * q + m`) and Q4_K (`d * sc * q - dmin * m`, sub-blocks of 32) blocks as they are (see
`minivllm.models.gguf_int4`). HF checkpoints are quantized at load (`quantize_int4`:
asymmetric, min/max per group).

The packed layout depends on the CPU, so weights are packed at load and never cached on disk.
The kernel is vectorised for bf16 activations only (fp32 activations run it scalar, far slower
than dense fp32), so int4 is used where the model computes in bf16. It reads 4x fewer bytes
than dense bf16 and wins at decode-sized row counts; at prefill sizes the dense bf16 matmul is
faster, so a layer with int4 weights keeps its dense weight too, and its method's row table
hands over at `int4` rows (`minivllm.layers.quantization.rows`, per CPU kind).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZE = 32


@dataclass
class Int4Weight:
    """A `[out, in]` weight as codes and per-group scales and zeros (`w = (q - 8) * s + z`)."""

    codes: torch.Tensor  # [out, in] uint8, values 0..15
    scales: torch.Tensor  # [out, in // GROUP_SIZE] float32
    zeros: torch.Tensor  # [out, in // GROUP_SIZE] float32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense `[out, in]` weight."""
        out, size = self.codes.shape
        q = self.codes.float().view(out, size // GROUP_SIZE, GROUP_SIZE)  # [out, groups, 32]
        w = (q - 8) * self.scales[..., None] + self.zeros[..., None]  # [out, groups, 32]
        return w.view(out, size).to(dtype)

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        """Stack weights along the output dim (fused projections)."""
        return Int4Weight(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat([p.zeros for p in parts]),
        )


def quantize_int4(weight: torch.Tensor) -> Int4Weight:
    """Asymmetric 4-bit quantization of `weight` `[out, in]`, one (scale, zero) per group of
    GROUP_SIZE inputs from the group's min and max."""
    out, size = weight.shape
    if size % GROUP_SIZE:
        raise ValueError(f"int4 needs the input size ({size}) to be a multiple of {GROUP_SIZE}")
    w = weight.detach().float().view(out, size // GROUP_SIZE, GROUP_SIZE)  # [out, groups, 32]
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [out, groups]
    scales = ((hi - lo) / 15).clamp(min=1e-10)
    codes = ((w - lo[..., None]) / scales[..., None]).round_().clamp_(0, 15)
    zeros = lo + 8 * scales  # (q - 8) * s + z == q * s + lo
    return Int4Weight(codes.to(torch.uint8).view(out, size), scales, zeros)


def split_int8(codes: torch.Tensor, scales: torch.Tensor) -> tuple[Int4Weight, Int4Weight]:
    """An 8-bit weight `w = s * q` (q in -128..127, one scale `s` per group of GROUP_SIZE, as
    llama.cpp's Q8_0) as two 4-bit weights whose sum it is: `q = 16h + l` with `h = floor(q /
    16)` in -8..7 and `l` in 0..15, so `w = (16h + 8) * s + (l - 8) * s`. The +8 goes to the
    high half so that the low half is centred on zero and its products stay small.
    `codes` `[out, in]` int8, `scales` `[out, in // GROUP_SIZE]` float32."""
    q = codes.to(torch.int16)
    high = torch.div(q, 16, rounding_mode="floor")  # [out, in], -8..7
    low = q - 16 * high  # [out, in], 0..15
    return (
        Int4Weight((high + 8).to(torch.uint8), 16 * scales, 8 * scales),  # (16h + 8) * s
        Int4Weight(low.to(torch.uint8), scales.clone(), torch.zeros_like(scales)),  # (l - 8) * s
    )


def int4_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed int4 weights run (fast) here: the CPU kernel with bf16 activations."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    )


class PackedInt4:
    """An Int4Weight in the CPU kernel's layout, ready for `matmul`."""

    def __init__(self, weight: Int4Weight, dtype: torch.dtype = torch.bfloat16) -> None:
        out, size = weight.shape
        if size % GROUP_SIZE:
            raise ValueError(f"int4 needs the input size ({size}) to be a multiple of {GROUP_SIZE}")
        self.out_features = out
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            weight.codes.to(torch.int32).contiguous(), 2
        )
        # [in // GROUP_SIZE, out, 2]: (scale, zero) of each group, as the kernel reads them
        self.scales_and_zeros = (
            torch.stack([weight.scales, weight.zeros], dim=-1).transpose(0, 1).contiguous()
        ).to(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T`: `[..., in]` -> `[..., out]` in x's dtype."""
        rows = x.reshape(-1, x.shape[-1])  # [N, in]
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.packed, GROUP_SIZE, self.scales_and_zeros
        )  # [N, out]
        return out.view(*x.shape[:-1], self.out_features)


class PackedInt4Pair:
    """An 8-bit weight as two packed 4-bit halves (`split_int8`), for the LM head: `matmul`
    sums the halves' products in float32 (`[..., in]` -> `[..., out]` float32)."""

    def __init__(self, high: Int4Weight, low: Int4Weight) -> None:
        self.high, self.low = PackedInt4(high), PackedInt4(low)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.high.matmul(x).float() + self.low.matmul(x).float()
