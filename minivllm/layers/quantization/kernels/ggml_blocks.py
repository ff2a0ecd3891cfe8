"""GGUF's quantized blocks used as stored: matmul and dequantization kernels on raw ggml blocks.

A GGUF weight `[N, K]` of a quantized type is `N` rows of `K / block_elems` blocks of
`block_bytes` each, in ggml's layout (Q4_0 ... Q6_K, see `csrc/ggml_blocks.cpp`). The tensor
these functions take is exactly that, `[N, row_bytes]` uint8 (a view of the memory-mapped file
serves), so a weight lives once, as the file stores it, and each step size has its kernel:

- `ggml_matmul` for decode-sized steps (1 to a few rows): the activations quantized per group
  of 32 to int8, integer dot products (AVX-512 VNNI or AVX2, chosen at run time, or a portable
  scalar loop), each weight row read once for up to 4 activation rows. Output fp32.
- `dequant_matmul` for prefill-sized steps: the weight dequantized a tile of rows at a time
  (`DEQUANT_TILE_BYTES`) into one reused scratch buffer in x's dtype, each tile multiplied by
  torch's matmul, so no dense copy outlives the call.
- `ggml_dequantize`: the dense `[N, K]` weight (embedding rows, tests, types kept dense).

They are the torch operators `minivllm::ggml_*` (built and loaded by
`minivllm.layers.cpu_kernels`, so compiled graphs call them too). Where the kernels cannot run
(no AVX2, no compiler) the same functions fall back to gguf-py's numpy dequantization and a
dense matmul: slower, same results up to the activations' rounding.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from minivllm.layers.cpu_kernels import cpu_kernels_available

# The quantized GGML types the kernels run as stored (F32/F16/BF16 tensors are plain floats).
GGML_KERNEL_TYPES = frozenset(
    {
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)
# The matmul's instruction sets, as the operator numbers them; "auto" is the fastest one that
# runs here (AMX where the CPU has it, else AVX-512 VNNI where torch runs its AVX-512 kernels,
# else AVX2).
ISAS = {"auto": 0, "scalar": 1, "avx2": 2, "avx512_vnni": 3, "amx": 4}
# Added to an X8_KINDS qtype for the operator: the blocks are `repack_q4x8`'s tiles.
X8_FLAG = 256
X8_KINDS = (
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q6_K,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q5_0,
)
# Bytes of one K kind's x8 block (256 inputs of 8 rows) where it is not 8 blocks of the file:
# Q4_K's 6-bit scales and mins unpacked to bytes; Q6_K's codes in two planes, plus each row's
# integer offset (csrc/ggml_q6kx8_simd.h).
_X8_K_BLOCK_BYTES = {GGMLQuantizationType.Q4_K: 1184, GGMLQuantizationType.Q6_K: 1712}


def last_level_cache_bytes(path: str = "/sys/devices/system/cpu/cpu0/cache/index3/size") -> int:
    """The L3 cache's size as Linux reports it ("32768K"), 0 where it does not."""
    try:
        with open(path) as file:
            text = file.read().strip()
    except OSError:
        return 0
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1:].upper() in units and text[:-1].isdigit():
        return int(text[:-1]) * units[text[-1].upper()]
    return int(text) if text.isdigit() else 0


def dequant_tile_bytes(l3_bytes: int) -> int:
    """Bytes of dense weight rows `dequant_matmul` dequantizes at a time, for an L3 of
    `l3_bytes`: a quarter of it (the tile, its matmul's packed copy and the activations stay in
    cache between the dequantization and the matmul), from 4 to 64 MiB. Each tile is one
    `torch.mm` call, and a call costs beyond its products: on a Xeon with a 480 MB L3 the
    coder's layers at 1772 rows took 11% less time in 64 MiB tiles than in 4 MiB
    (docs/ggml-kernels.md, "Prefill"). The scratch buffer is at most one such tile."""
    return min(64 << 20, max(4 << 20, l3_bytes // 4))


DEQUANT_TILE_BYTES = dequant_tile_bytes(last_level_cache_bytes())


def dequant_tile_rows(cols: int, element_size: int, tile_bytes: int = DEQUANT_TILE_BYTES) -> int:
    """Dense rows of `cols` values of `element_size` bytes in one tile of `tile_bytes` (16 at
    least)."""
    return max(16, tile_bytes // (cols * element_size))


def ggml_type(qtype: GGMLQuantizationType | int | str) -> GGMLQuantizationType:
    """`qtype` (the enum, its number or its name, e.g. "Q4_K") as a supported kernel type;
    ValueError for any other."""
    try:
        kind = (
            GGMLQuantizationType[qtype.upper()]
            if isinstance(qtype, str)
            else GGMLQuantizationType(int(qtype))
        )
    except (KeyError, ValueError):
        raise ValueError(f"unknown GGML type {qtype!r}") from None
    if kind not in GGML_KERNEL_TYPES:
        names = ", ".join(sorted(t.name for t in GGML_KERNEL_TYPES))
        raise ValueError(f"GGML type {kind.name} has no block kernel (supported: {names})")
    return kind


def block_geometry(qtype: GGMLQuantizationType | int | str) -> tuple[int, int]:
    """`(block_elems, block_bytes)` of a supported type: inputs and bytes per block."""
    return GGML_QUANT_SIZES[ggml_type(qtype)]


def row_bytes(qtype: GGMLQuantizationType | int | str, cols: int) -> int:
    """Bytes of one weight row of `cols` inputs (a multiple of the type's block)."""
    kind = ggml_type(qtype)
    elems, nbytes = GGML_QUANT_SIZES[kind]
    if cols <= 0 or cols % elems:
        raise ValueError(
            f"{kind.name}: a row of {cols} inputs is not a whole number of {elems}-input blocks"
        )
    return cols // elems * nbytes


def _check_blocks(
    blocks: torch.Tensor, qtype: GGMLQuantizationType | int | str, cols: int
) -> GGMLQuantizationType:
    kind = ggml_type(qtype)
    expected = row_bytes(kind, cols)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise ValueError(
            f"{kind.name} blocks must be a [N, row_bytes] uint8 tensor, got "
            f"{blocks.dtype} {tuple(blocks.shape)}"
        )
    if blocks.shape[1] != expected:
        raise ValueError(
            f"{kind.name} rows of {cols} inputs are {expected} bytes, the blocks "
            f"have {blocks.shape[1]}"
        )
    return kind


def available_isas() -> tuple[str, ...]:
    """The matmul instruction sets that run here (beyond "auto")."""
    if not cpu_kernels_available():
        return ()
    ops = torch.ops.minivllm
    return ("scalar", "avx2") + ("avx512_vnni",) * ops.ggml_vnni() + ("amx",) * ops.ggml_amx()


def _isa(isa: str) -> int:
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {sorted(ISAS)}, got {isa!r}")
    if isa != "auto" and isa not in available_isas():
        raise ValueError(f"the {isa} path does not run on this CPU (here: {available_isas()})")
    return ISAS[isa]


def dequant_scratch_bytes() -> int:
    """Bytes of `dequant_matmul`'s scratch buffer on the calling thread (0 before its first
    call): the one dense buffer it keeps, sized by its largest tile, not by any weight."""
    return int(torch.ops.minivllm.ggml_scratch_bytes()) if cpu_kernels_available() else 0


def ggml_dequantize(
    blocks: torch.Tensor,
    qtype: GGMLQuantizationType | int | str,
    cols: int,
    dtype: torch.dtype = torch.float32,
    isa: str = "auto",
) -> torch.Tensor:
    """The dense `[N, cols]` weight in `dtype`; fp32 values equal gguf-py's bit for bit (bf16:
    those rounded to nearest even)."""
    kind = _check_blocks(blocks, qtype, cols)
    native = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    if cpu_kernels_available():
        dense = torch.ops.minivllm.ggml_dequantize(
            blocks.contiguous(), int(kind), cols, native, _isa(isa)
        )
    else:
        values = gguf_dequantize(blocks.numpy(), kind).astype(np.float32)
        dense = torch.from_numpy(values.reshape(blocks.shape[0], cols)).to(native)
    return dense.to(dtype)


def ggml_matmul(
    x: torch.Tensor,
    blocks: torch.Tensor,
    qtype: GGMLQuantizationType | int | str,
    isa: str = "auto",
) -> torch.Tensor:
    """`x @ W.T` for decode-sized steps: `x` `[..., K]` fp32 or bf16, W the `[N, row_bytes]`
    blocks -> `[..., N]` fp32. The activations are rounded to 8 bits per group of 32 (the
    groups' min terms use the codes' sums, as llama.cpp)."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"ggml_matmul: x must be float32 or bfloat16, got {x.dtype}")
    kind = _check_blocks(blocks, qtype, x.shape[-1])
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    if cpu_kernels_available():
        out = torch.ops.minivllm.ggml_matmul(rows, blocks.contiguous(), int(kind), _isa(isa))
    else:
        out = rows.float() @ ggml_dequantize(blocks, kind, x.shape[-1]).T
    return out.view(*x.shape[:-1], blocks.shape[0])  # [..., N]


def ggml_matmul_segments(
    x: torch.Tensor, segments: list[tuple[torch.Tensor, GGMLQuantizationType]], isa: str = "auto"
) -> torch.Tensor:
    """`x @ [W_0; W_1; ...].T` for a fused layer whose weight is several checkpoint tensors
    (`(blocks, qtype)` each, all of `x`'s K inputs): their outputs side by side, `[..., sum
    N_i]` fp32, from one call that rounds the activations once for all of them."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"ggml_matmul: x must be float32 or bfloat16, got {x.dtype}")
    kinds = [_check_blocks(blocks, qtype, x.shape[-1]) for blocks, qtype in segments]
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    if cpu_kernels_available():
        out = torch.ops.minivllm.ggml_matmul_segments(
            rows,
            [blocks.contiguous() for blocks, _ in segments],
            [int(k) for k in kinds],
            _isa(isa),
        )
    else:
        out = torch.cat(
            [
                rows.float() @ ggml_dequantize(blocks, kind, x.shape[-1]).T
                for (blocks, _), kind in zip(segments, kinds)
            ],
            dim=-1,
        )
    return out.view(*x.shape[:-1], out.shape[-1])  # [..., sum N_i]


def x8_tile_bytes(qtype: GGMLQuantizationType | int | str, cols: int) -> int:
    """Bytes of one x8 tile (8 weight rows of `cols` inputs) of `repack_q4x8`: 8 rows' bytes,
    for the K kinds their blocks' as `_X8_K_BLOCK_BYTES` says, for Q5_0 8 rows of Q8_0 (its
    codes a byte each)."""
    kind = ggml_type(qtype)
    if kind in _X8_K_BLOCK_BYTES:
        row_bytes(kind, cols)  # checks cols
        return _X8_K_BLOCK_BYTES[kind] * (cols // 256)
    if kind == GGMLQuantizationType.Q5_0:
        row_bytes(kind, cols)
        return 8 * row_bytes(GGMLQuantizationType.Q8_0, cols)
    return 8 * row_bytes(kind, cols)


def repack_q4x8(blocks: torch.Tensor, qtype: GGMLQuantizationType | int | str) -> torch.Tensor:
    """Q4_0, Q4_1, Q4_K, Q6_K, Q8_0 or Q5_0 blocks `[N, row_bytes]` (N a multiple of 8) as x8
    tiles: the same values, moved so that one vector instruction multiplies 8 weight rows
    (`csrc/ggml_q4x8_simd.h`, `csrc/ggml_q4kx8_simd.h`, `csrc/ggml_q6kx8_simd.h`,
    `csrc/ggml_q8x8_simd.h`: Q5_0's codes widened to a byte each), `[N / 8, x8_tile_bytes]`.
    `ggml_matmul_segments`' operator takes them with the qtype plus `X8_FLAG`. Needs the
    kernels."""
    kind = ggml_type(qtype)
    if kind not in X8_KINDS:
        raise ValueError(
            f"only Q4_0, Q4_1, Q4_K, Q6_K, Q8_0 and Q5_0 repack 8 rows at a time, got {kind.name}"
        )
    if blocks.dim() != 2 or blocks.shape[0] % 8:
        raise ValueError(f"x8 repacking needs [8k, row_bytes] blocks, got {tuple(blocks.shape)}")
    return torch.ops.minivllm.ggml_q4x8_repack(blocks.contiguous(), int(kind))


def dequant_matmul(
    x: torch.Tensor,
    blocks: torch.Tensor,
    qtype: GGMLQuantizationType | int | str,
    tile_rows: int | None = None,
) -> torch.Tensor:
    """`x @ W.T` for prefill-sized steps, in x's dtype (fp32 or bf16): W dequantized
    `tile_rows` rows at a time (default: `DEQUANT_TILE_BYTES` of them) into one reused scratch
    buffer, each tile multiplied by torch's matmul."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dequant_matmul: x must be float32 or bfloat16, got {x.dtype}")
    cols = x.shape[-1]
    kind = _check_blocks(blocks, qtype, cols)
    if tile_rows is None:
        tile_rows = dequant_tile_rows(cols, x.element_size())
    elif tile_rows <= 0:
        raise ValueError(f"tile_rows must be positive, got {tile_rows}")
    rows = x.reshape(-1, cols)  # [M, K]
    if cpu_kernels_available():
        out = torch.ops.minivllm.ggml_dequant_matmul(
            rows, blocks.contiguous(), int(kind), tile_rows
        )
    else:
        out = rows @ ggml_dequantize(blocks, kind, cols, x.dtype).T
    return out.view(*x.shape[:-1], blocks.shape[0])  # [..., N]
