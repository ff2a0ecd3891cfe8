"""GGUF's 4-bit blocks read straight into `Int4Weight`s (codes, scales, zeros), no float copy.

llama.cpp's Q4_0, Q4_1 and Q4_K blocks are groups of 32 weights with 4-bit codes and an affine
map, which is exactly `minivllm.layers.quantization.kernels.int4`'s `w = (q - 8) * scale + zero`:

- Q4_0 (18 bytes / 32): fp16 `d`, 16 bytes of codes; `w = d * (q - 8)`.
- Q4_1 (20 bytes / 32): fp16 `d`, fp16 `m`, 16 bytes of codes; `w = d * q + m`.
- Q4_K (144 bytes / 256): fp16 `d`, fp16 `dmin`, 12 bytes of 6-bit sub-block scales and mins,
  128 bytes of codes; sub-block `j` has `w = d * sc_j * q - dmin * m_j`.

In a Q4_0/Q4_1 block the low nibbles of the 16 bytes are weights 0..15 and the high nibbles
weights 16..31; in Q4_K each 32 bytes hold two sub-blocks (low nibbles, then high nibbles).
Other tensor types (Q6_K, F32...) are not 4-bit and stay with the dense loader, but for a
Q8_0 LM head (34 bytes / 32: fp16 `d`, 32 int8 `q`; `w = d * q`), which is read as two 4-bit
halves (`minivllm.layers.quantization.kernels.int4.split_int8`) under LM_HEAD_HIGH and LM_HEAD_LOW.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import torch
from gguf import GGMLQuantizationType

from minivllm.layers.quantization.kernels.int4 import Int4Weight, split_int8
from minivllm.models.gguf import hf_tensor_name, load_progress, qk_heads, unpermute_qk
from minivllm.models.gguf_arch import architecture
from minivllm.models.gguf_file import GGUFFile, GGUFTensor

INT4_TENSOR_TYPES = (
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q4_K,
)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """`[..., 16]` bytes -> `[..., 32]` codes: low nibbles first, then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _f16(raw: np.ndarray) -> np.ndarray:
    """`[..., 2]` little-endian bytes -> `[...]` float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(blocks[..., 0:2])  # [rows, groups]
    return _nibbles(blocks[..., 2:18]), d, np.zeros_like(d)


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [rows, groups]
    return _nibbles(blocks[..., 4:20]), d, m + 8 * d  # d * q + m == d * (q - 8) + (m + 8d)


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`[..., 12]` packed bytes -> 8 six-bit sub-block scales and 8 mins, each `[..., 8]`."""
    raw = raw.astype(np.uint8)
    lo, hi = raw[..., 0:4], raw[..., 4:8]
    top = raw[..., 8:12]
    scales = np.concatenate([lo & 63, (top & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mins = np.concatenate([hi & 63, (top >> 4) | ((hi >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows, supers = blocks.shape[:2]
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [rows, supers]
    sc, m = _k_scales(blocks[..., 4:16])  # each [rows, supers, 8]
    qs = blocks[..., 16:144].reshape(rows, supers, 4, 32)  # 4 chunks of two sub-blocks
    codes = np.stack([qs & 0x0F, qs >> 4], axis=3)  # [rows, supers, 4, 2, 32]
    scale = d[..., None] * sc  # [rows, supers, 8]
    zero = 8 * scale - dmin[..., None] * m
    groups = supers * 8
    return codes.reshape(rows, groups, 32), scale.reshape(rows, groups), zero.reshape(rows, groups)


_DECODERS = {
    GGMLQuantizationType.Q4_0: (18, _q4_0),
    GGMLQuantizationType.Q4_1: (20, _q4_1),
    GGMLQuantizationType.Q4_K: (144, _q4_k),
}


def int4_from_tensor(tensor: GGUFTensor) -> Int4Weight:
    """One Q4_0/Q4_1/Q4_K tensor as an Int4Weight in HF shape `[out, in]`."""
    block_bytes, decode = _DECODERS[tensor.tensor_type]
    out, size = (int(d) for d in reversed(tensor.shape))
    data = np.asarray(tensor.data).reshape(out, -1)  # [out, bytes per row]
    codes, scales, zeros = decode(data.reshape(out, -1, block_bytes))
    return Int4Weight(
        torch.from_numpy(np.ascontiguousarray(codes).reshape(out, size)),
        torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32)),
        torch.from_numpy(np.ascontiguousarray(zeros, dtype=np.float32)),
    )


LM_HEAD_HIGH, LM_HEAD_LOW = "lm_head.int8_high", "lm_head.int8_low"


def q8_0_halves(tensor: GGUFTensor) -> tuple[Int4Weight, Int4Weight]:
    """A Q8_0 tensor `[out, in]` as the two 4-bit halves whose sum it is."""
    out, size = (int(d) for d in reversed(tensor.shape))
    blocks = np.asarray(tensor.data).reshape(out, size // 32, 34)
    scales = torch.from_numpy(_f16(blocks[..., 0:2]))  # [out, groups]
    codes = np.ascontiguousarray(blocks[..., 2:34]).view(np.int8).reshape(out, size)
    return split_int8(torch.from_numpy(codes), scales)


def lm_head_q8_0(reader: GGUFFile) -> GGUFTensor | None:
    """The LM head's tensor (`output`, else the tied `token_embd`) when it is Q8_0."""
    by_name = {t.name: t for t in reader.tensors}
    head = by_name.get("output.weight", by_name.get("token_embd.weight"))
    return head if head is not None and head.tensor_type == GGMLQuantizationType.Q8_0 else None


def read_int4_weights(reader: GGUFFile, exclude: Collection[str] = ()) -> dict[str, Int4Weight]:
    """Every 4-bit tensor of the file under its HF name (q/k rows un-permuted for llama, as
    the dense loader does) but those named in `exclude`, from the memory-mapped blocks; a
    Q8_0 LM head's two halves under LM_HEAD_HIGH and LM_HEAD_LOW."""
    arch = architecture(reader)
    weights: dict[str, Int4Weight] = {}
    for tensor in load_progress(reader.tensors, "Packing 4-bit weights"):
        if tensor.tensor_type not in INT4_TENSOR_TYPES:
            continue
        name = hf_tensor_name(tensor.name, arch)
        if name in exclude:
            continue
        weight = int4_from_tensor(tensor)
        if (heads := qk_heads(reader, name)) is not None:
            weight = Int4Weight(
                *(
                    torch.from_numpy(unpermute_qk(t.numpy(), heads).copy())
                    for t in (weight.codes, weight.scales, weight.zeros)
                )
            )
        weights[name] = weight
    head = lm_head_q8_0(reader)
    if head is not None and "lm_head.weight" not in exclude:
        weights[LM_HEAD_HIGH], weights[LM_HEAD_LOW] = q8_0_halves(head)
    return weights
