"""A linear layer's weight kept as the GGUF stores it: ggml's quantized blocks, one copy.

A layer whose checkpoint tensors are K-quants or 8-bit blocks (what Q4_K_M, Q5_K_M, Q6_K and
Q8_0 files hold) keeps no dense weight: its `BlockWeight` is the file's rows of blocks (a view
of the memory map, or for llama's permuted q/k rows a reordered copy), and every step size runs
on them (`minivllm.layers.quantization.kernels.ggml_blocks`):

- the integer kernel: the activations rounded to 8 bits (in tiles, two 8-bit codes each,
  about 15 bits) and integer dot products, each weight row unpacked once for 4 activation
  rows; every step size for the K kinds and tiles, up to `rows.block_rows` rows for the other
  32-input ones (Q5_1). Q4_0, Q4_1, Q4_K, Q6_K, Q8_0 and Q5_0 tensors of 8k rows are moved at
  load into tiles of 8 rows ("x8": `csrc/ggml_q4x8_simd.h`, `csrc/ggml_q4kx8_simd.h`,
  `csrc/ggml_q6kx8_simd.h`, `csrc/ggml_q8x8_simd.h`), the same values (Q5_0's codes widened
  to a byte each), so that one vector instruction serves 8 output columns;
- beyond (those kinds' prefills): the weight dequantized a tile at a time into one reused
  buffer, each tile multiplied by torch's matmul.

A fused layer (qkv_proj, gate_up_proj) holds one segment per checkpoint tensor, each in its own
type (Q4_K_M stores some `attn_v` in Q6_K): one kernel call computes them side by side.

"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from minivllm.layers.cpu_kernels import cpu_kernels_available
from minivllm.layers.quantization.kernels.ggml_blocks import (
    X8_FLAG,
    X8_KINDS,
    dequant_matmul,
    dequant_tile_rows,
    ggml_dequantize,
    ggml_matmul_segments,
    repack_q4x8,
    row_bytes,
    x8_tile_bytes,
)
from minivllm.layers.quantization.rows import K_KINDS, RowTable, block_rows, pick

# The one table of which GGUF tensor types run as stored blocks.
BLOCK_TYPES = frozenset(
    {
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
    }
)


# The token embedding and the LM head run as stored blocks in every block type: a lookup
# dequantizes the rows it reads, the head's steps run on the blocks (`BlockWeight.matmul`), so
# no dense copy of a vocabulary-sized table is kept.
EMBEDDING_BLOCK_TYPES = BLOCK_TYPES


@dataclass(frozen=True)
class BlockSegment:
    """Rows `[N, row_bytes]` (uint8) of one checkpoint tensor `[N, cols]` of type `qtype`; or
    with `x8`, the same values moved into tiles of 8 rows, `[N / 8, x8_tile_bytes]`."""

    blocks: torch.Tensor
    qtype: GGMLQuantizationType
    x8: bool = False

    @property
    def rows(self) -> int:
        return int(self.blocks.shape[0]) * (8 if self.x8 else 1)

    def for_kernels(self) -> BlockSegment:
        """The segment in the layout the integer kernel reads fastest: X8_KINDS of 8k rows
        repacked (a new tensor; the file's pages are then never read again), others as
        is."""
        if self.x8 or self.qtype not in X8_KINDS or self.rows % 8:
            return self
        return BlockSegment(repack_q4x8(self.blocks, self.qtype), self.qtype, x8=True)

    @property
    def nbytes(self) -> int:
        return int(self.blocks.numel())

    def lookup(self, ids: torch.Tensor, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` (`[T]` int64) of the `[N, cols]` weight, dequantized: `[T, cols]`. From
        tiles, each row alone (moved back out of its tile): dequantizing each id's whole tile
        and keeping one row cost the head's refinement of its top 16 logits ~0.25 ms a
        one-sequence step, on caches the weights had just evicted."""
        if not self.x8:
            return ggml_dequantize(self.blocks[ids], self.qtype, cols, dtype)
        native = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        picked = torch.ops.minivllm.ggml_dequantize(
            self.blocks, int(self.qtype) + X8_FLAG, cols, native, 0, ids
        )  # [T, cols]
        return picked.to(dtype)


def two_code_block(segments: list[BlockSegment]) -> int | None:
    """The block (256 for the K kinds, 32 for Q5_0/Q5_1/Q8_0) over which the integer kernel
    rounds the activations of all `segments`, where a second code can follow it; None where
    the segments' kinds round differently (or, the 32-input kinds in tiles, keep two codes
    already)."""
    blocks = {
        256 if s.qtype in K_KINDS else 32 if not (s.x8 and s.qtype in X8_KINDS) else 0
        for s in segments
    }
    return blocks.pop() if len(blocks) == 1 and 0 not in blocks else None


# `x` `[..., in]` -> `x @ W.T` `[..., out]` on one kernel
Kernel = Callable[[torch.Tensor], torch.Tensor]

# How a BlockWeight rounds the activations of its integer-kernel steps (chosen per layer by
# `minivllm.engine.weight_policy`, docs/ggml-kernels.md "Activation precision"):
# "int8": one 8-bit code per input (a step per block of 32 or 256 inputs);
# "int8x2": a second 8-bit code for what the first leaves (the residual, as a second row of
# the same call: each weight row is still read once, about 15 bits an activation);
# "float": no integer kernel, the weight dequantized a tile at a time for x's dtype.
ACTIVATIONS = ("int8", "int8x2", "float")


class BlockWeight:
    """The `[out, in]` weight of a linear layer as ggml blocks, segments stacked along out."""

    def __init__(
        self,
        segments: list[BlockSegment],
        cols: int,
        activations: str = "int8",
        two_code_rows: float = float("inf"),
    ) -> None:
        """`two_code_rows`: above this many rows, a step whose activations would take a second
        code as a second row (int8x2) dequantizes the weight instead (`rows.KernelRows.
        ggml_two_codes`, for bf16 activations where oneDNN runs bf16 natively)."""
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
        if not segments:
            raise ValueError("a BlockWeight needs at least one segment")
        for segment in segments:
            expected = (x8_tile_bytes if segment.x8 else row_bytes)(segment.qtype, cols)
            if segment.blocks.dtype != torch.uint8 or tuple(segment.blocks.shape[1:]) != (
                expected,
            ):
                raise ValueError(
                    f"{segment.qtype.name} rows of {cols} inputs are {expected} "
                    f"bytes; got blocks {tuple(segment.blocks.shape)}"
                )
        self._kernels = cpu_kernels_available()
        if self._kernels:
            segments = [s.for_kernels() for s in segments]
        self.segments = segments
        self.cols = cols
        # What the one-call kernel takes, prepared once: a compiled decode step then calls the
        # operator with no Python checks in between (each would break its graph).
        self._blocks = [s.blocks.contiguous() for s in segments]
        self._qtypes = [int(s.qtype) + (X8_FLAG if s.x8 else 0) for s in segments]
        # ... and as a tensor for the one-call kernel: a value Dynamo does not specialise on,
        # so layers of different kinds share a compiled step's graph.
        self._kinds = torch.tensor(self._qtypes, dtype=torch.int64)
        self._columns = sum(s.rows for s in segments)
        # the block of the second code's residual; None: one code (or no integer kernel)
        self._residual_block = two_code_block(segments) if activations == "int8x2" else None
        self.activations = (
            activations if activations != "int8x2" or self._residual_block else "int8"
        )
        # The row table: up to the smallest segment's integer-kernel rows one call computes
        # every segment (x rounded once); above, one call dequantizes every segment a tile
        # at a time. Both take the kinds as a tensor, so that in a compiled step the layers
        # sharing a graph each pass their own.
        limits = [0.0 if activations == "float" else block_rows(s.qtype, s.x8) for s in segments]
        if self._residual_block is not None:  # the second code doubles the integer rows
            limits = [min(limit, two_code_rows) for limit in limits]
        self.table: RowTable[Kernel] = (
            (min(limits), self._one_call),
            (float("inf"), self._dequant),
        )

    @property
    def shape(self) -> tuple[int, int]:
        return self._columns, self.cols

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T`: `[..., in]` -> `[..., out]` in x's dtype (fp32 or bf16)."""
        return pick(self.table, x)(x)

    def matmul_float(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T` in float32 whatever x's dtype: the integer kernel's float32 sums as it
        makes them. An LM head's logits rounded to bf16 and widened again cost a vocabulary-
        sized output two copies (16 rows of Gemma 3's 262k: 1.3 ms a step) and their bits."""
        kernel = pick(self.table, x)
        return self._integer_sums(x) if kernel == self._one_call else kernel(x).float()

    def _one_call(self, x: torch.Tensor) -> torch.Tensor:
        """Every segment in one integer-kernel call, x rounded once."""
        return self._integer_sums(x).to(x.dtype)

    def _integer_sums(self, x: torch.Tensor) -> torch.Tensor:
        """`_one_call`'s products in float32, as the kernel returns them."""
        if not self._kernels:
            return ggml_matmul_segments(x, [(s.blocks, s.qtype) for s in self.segments])
        flat = x.reshape(-1, self.cols)  # [M, in]
        # With a second code the kernel rounds each row twice: x, then what x's code leaves
        # (as a second row of the same call, each weight row still read once).
        out = torch.ops.minivllm.ggml_matmul_kinds(
            flat, self._blocks, self._kinds, self._columns, 0, self._residual_block or 0
        )
        return out.view(*x.shape[:-1], out.shape[-1])

    def _dequant(self, x: torch.Tensor) -> torch.Tensor:
        """Every segment with its weight dequantized a tile at a time, in x's dtype."""
        if not self._kernels:
            outs = [dequant_matmul(x, s.blocks, s.qtype) for s in self.segments]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        flat = x.reshape(-1, self.cols)
        tile_rows = dequant_tile_rows(self.cols, x.element_size())
        out = torch.ops.minivllm.ggml_dequant_matmul_kinds(
            flat, self._blocks, self._kinds, self._columns, tile_rows
        )
        return out.view(*x.shape[:-1], out.shape[-1])
