"""A GGUF checkpoint read as the engine reads a model: config, tokenizer, weights by HF name.

A GGUF file (llama.cpp's format) holds a model in one file: metadata key/values, a tokenizer
description and (often quantized) tensors under llama.cpp's names. The engine loads it in place:

- the metadata becomes the architecture's transformers config and a `generation_config.json`
  (`gguf_arch.py`: the architecture table: llama, qwen2, qwen3, gemma2, gemma3, phi3), and the
  tokenizer is rebuilt offline by transformers' GGUF tokenizer conversion (`gguf_tokenizer.py`);
  these few small files are written once into a cache directory (`gguf_model_dir`), keyed on
  the file's size, mtime and `minivllm.cache.GGUF_METADATA_VERSION`, atomically, so a second
  start reads them at once;
- the weights are never written anywhere: `iter_state` yields them by HF name, straight from
  the memory-mapped file, dequantized one tensor at a time for the layers that compute densely,
  with what llama.cpp changed when it wrote them undone (the q/k row permutation of `llama`,
  Gemma's `1 + w` norm weights); quantized layers take their blocks as stored
  (`minivllm.models.gguf_weights`).

`convert_gguf` still writes a whole HF directory (float32 safetensors), for export and for the
tests that compare the two.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as _gguf_dequantize
from tqdm import tqdm

from minivllm.cache import gguf_cached_dir
from minivllm.layers.quantization.kernels.block_weight import BLOCK_TYPES
from minivllm.models.gguf_arch import (
    ARCHITECTURES,
    CONFIG_TENSORS,
    GLOBAL_TENSOR_NAMES,
    SUPPORTED_ARCHITECTURES,
    GGUFConversionError,
    architecture,
    build_config,
    layer_tensor_names,
    meta,
)
from minivllm.models.gguf_file import GGUFFile, GGUFFileError, GGUFTensor
from minivllm.models.gguf_tokenizer import build_tokenizer
from minivllm.startup import phase

logger = logging.getLogger(__name__)

# Re-exported: the converter's errors and the architectures it takes.
__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "GGUFConversionError",
    "GGUFFileError",
    "build_config",
    "build_tokenizer",
    "convert_gguf",
    "gguf_model_dir",
]


# Types the tests check against an independent reference; others go through gguf-py untested.
TESTED_TENSOR_TYPES = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q6_K,
)

# Types some path of ours runs as they are: dense floats, the stored-block kernels
# (minivllm.layers.quantization.kernels.block_weight) and the 4-bit ones
# (minivllm.layers.quantization.methods). Any other type gguf-py can decode (IQ*, TQ*, Q2_K, Q3_K,
# MXFP4, ...) is dequantized at load into dense weights, with a warning saying what that costs.
KERNEL_TYPES = BLOCK_TYPES | {
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
}

_LAYER_NAME_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_NAME_RE = re.compile(r"^(\w+)\.(weight|bias)$")


# ---------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """Map a llama.cpp tensor name (`blk.3.attn_q.weight`) of architecture `arch` to its HF
    name.

    Raises:
        GGUFConversionError: the name is not one of the architecture's tensors we know.
    """
    if m := _LAYER_NAME_RE.match(gguf_name):
        layer, part, suffix = m.groups()
        names = layer_tensor_names(arch)
        if part in names:
            return f"model.layers.{layer}.{names[part]}.{suffix}"
    elif m := _GLOBAL_NAME_RE.match(gguf_name):
        part, suffix = m.groups()
        if part in GLOBAL_TENSOR_NAMES:
            return f"{GLOBAL_TENSOR_NAMES[part]}.{suffix}"
    raise GGUFConversionError(f"unknown GGUF tensor name {gguf_name!r}; cannot map it to HF")


def dequantize_tensor(tensor: GGUFTensor) -> np.ndarray:
    """Decode one GGUF tensor to a float32 array in HF (row-major) shape.

    GGUF lists dimensions innermost first (`ne0, ne1, ...`), so the HF shape is the reverse:
    a `[576, 1536]` GGUF `ffn_down` is the HF `[1536 -> 576]` weight of shape `(576, 1536)`.
    """
    shape = tuple(int(d) for d in reversed(tensor.shape))
    try:
        values = _gguf_dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise GGUFConversionError(
            f"tensor {tensor.name!r} has type {tensor.tensor_type.name}, which gguf-py cannot "
            "dequantize"
        ) from exc
    values = np.ascontiguousarray(values, dtype=np.float32).reshape(shape)
    # F32 tensors come back as views of the read-only memory map; torch wants owned memory.
    return values if values.flags.writeable else values.copy()


@functools.cache
def readable_type(tensor_type: GGMLQuantizationType) -> bool:
    """Whether gguf-py can decode `tensor_type` (tried on one block of zeros)."""
    block_bytes = GGML_QUANT_SIZES[tensor_type][1]
    try:
        _gguf_dequantize(np.zeros((1, block_bytes), dtype=np.uint8), tensor_type)
    except NotImplementedError:
        return False
    return True


def check_tensor_types(reader: GGUFFile) -> None:
    """GGUFConversionError naming the first tensor of a type nothing here can read."""
    for tensor in reader.tensors:
        if not readable_type(tensor.tensor_type):
            raise GGUFConversionError(
                f"{reader.path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, "
                "which minivllm cannot read (no kernel runs it and gguf-py cannot dequantize it)"
            )


def warn_dense_fallback(reader: GGUFFile | None, dtype: torch.dtype) -> None:
    """One warning line when some tensors have a type no kernel of ours runs as stored: they
    are dequantized at load into dense `dtype` weights, which the line prices."""
    slow = [t for t in reader.tensors if t.tensor_type not in KERNEL_TYPES] if reader else []
    if reader is None or not slow:
        return
    types = "/".join(sorted({t.tensor_type.name for t in slow}))
    dense = sum(t.n_elements for t in slow) * torch.empty(0, dtype=dtype).element_size()
    logger.warning(
        "%s: %d tensors of type %s have no kernel here: dequantized at load into dense %s "
        "weights, %.1f MB in memory against %.1f MB as stored (slower loads and steps)",
        reader.path.name,
        len(slow),
        types,
        str(dtype).removeprefix("torch."),
        dense / 1e6,
        sum(t.n_bytes for t in slow) / 1e6,
    )


def permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Apply llama.cpp's rotary row permutation (`convert_hf_to_gguf.LlamaModel.permute`).

    HF rotates the two halves of each head (`rotate_half`); llama.cpp rotates interleaved
    pairs, so its converter reorders each head's rows from `[x0..x(d/2-1), y0..]` to
    `[x0, y0, x1, y1, ...]`. `n_head` is the number of heads of this projection (the kv heads
    for k). Works on weights `[n_head * head_dim, in]` and on biases `[n_head * head_dim]`.
    """
    rows = weight.shape[0]
    # [n_head, 2, head_dim // 2, ...] -> [n_head, head_dim // 2, 2, ...]
    return (
        weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Exact inverse of `permute_qk`: interleaved rotary pairs back to HF's half split."""
    rows = weight.shape[0]
    # [n_head, head_dim // 2, 2, ...] -> [n_head, 2, head_dim // 2, ...]
    return (
        weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def read_state_dict(reader: GGUFFile) -> dict[str, torch.Tensor]:
    """Every weight of the file as float32 under its HF name (see `iter_state`)."""
    return dict(iter_state(reader))


def qk_heads(reader: GGUFFile, hf_name: str) -> int | None:
    """The heads whose rows llama.cpp permuted in the tensor `hf_name` (q_proj: the query
    heads, k_proj: the KV heads), None where it permuted nothing."""
    arch = architecture(reader)
    if not ARCHITECTURES[arch].permute_qk:
        return None
    n_head = int(meta(reader, f"{arch}.attention.head_count"))
    part = hf_name.split(".")[-2]
    if part == "q_proj":
        return n_head
    if part == "k_proj":
        return int(meta(reader, f"{arch}.attention.head_count_kv", n_head))
    return None


def load_progress(tensors: list[GGUFTensor], desc: str) -> Iterator[GGUFTensor]:
    """`tensors`, with a progress bar on stderr when it is a terminal and the loop has run for
    a second (tqdm's `delay`); silent otherwise (tests, logs, pipes)."""
    return iter(tqdm(tensors, desc=desc, unit="tensor", disable=None, delay=1.0, leave=False))


def iter_state(
    reader: GGUFFile, skip: Callable[[str], bool] = lambda name: False
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(HF name, float32 tensor)` for every weight of the file but those `skip` names, as HF
    stores it: q/k rows un-permuted (llama), the norm offset taken back out (Gemma). One
    tensor is dequantized at a time, so a dense load holds one float copy at most."""
    arch = architecture(reader)
    spec = ARCHITECTURES[arch]
    for tensor in load_progress(reader.tensors, f"Loading {reader.path.name}"):
        if tensor.name == "rope_freqs.weight":
            raise GGUFConversionError(
                "this GGUF carries `rope_freqs` (Llama-3 style rope scaling), which the "
                "converter does not reconstruct into an HF rope_parameters config"
            )
        if tensor.name in CONFIG_TENSORS:  # read by build_config
            continue
        name = hf_tensor_name(tensor.name, arch)
        if skip(name):
            continue
        values = dequantize_tensor(tensor)
        if (heads := qk_heads(reader, name)) is not None:
            values = unpermute_qk(values, heads)
        if spec.norm_shift and name.endswith("norm.weight"):
            values = values - np.float32(spec.norm_shift)
        yield name, torch.from_numpy(values)


# ---------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------


def build_generation_config(config: Any) -> Any:
    """A `GenerationConfig` carrying the model's bos/eos/pad ids."""
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )


# ---------------------------------------------------------------------------------------------
# Conversion
# ---------------------------------------------------------------------------------------------


def write_model_files(reader: GGUFFile, out_dir: Path) -> Any:
    """Write the model's config, generation config and tokenizer files (no weights) into
    `out_dir`; returns the config."""
    config = build_config(reader)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    build_generation_config(config).save_pretrained(out_dir)
    if "tokenizer.ggml.tokens" in reader.metadata:
        build_tokenizer(reader.path, config.model_type).save_pretrained(out_dir)
    else:
        logger.warning("%s has no tokenizer metadata; wrote no tokenizer files", reader.path)
    return config


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write `gguf_path` as a whole HF-style model directory at `out_dir` and return it:
    `write_model_files`' files and `model.safetensors` (float32). For export and tests: the
    engine loads a GGUF in place (`gguf_model_dir` + `iter_state`).

    Raises:
        FileNotFoundError: `gguf_path` does not exist.
        GGUFFileError: the file is truncated or corrupt.
        GGUFConversionError: the file's architecture, tensors or metadata are not supported.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    reader = GGUFFile(gguf_path)
    config = write_model_files(reader, out_dir)
    state = read_state_dict(reader)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def gguf_model_dir(gguf_path: str | Path) -> Path:
    """A directory with the config and tokenizer files of `gguf_path` (no weights), written
    on first use: the engine reads them as it reads an HF directory's.

    The files are written into a temporary sibling directory and renamed into place, so the
    directory either exists complete or not at all; a concurrent writer that loses the rename
    race uses the winner's. Every tensor's bytes are checked to be in the file first, so a
    truncated or corrupt file, an unsupported architecture or a tensor type nothing here reads
    fails here with one line and leaves nothing in the cache.
    """
    reader = GGUFFile(gguf_path)
    architecture(reader)  # what no engine could load is refused before anything is written
    check_tensor_types(reader)
    target = gguf_cached_dir(gguf_path)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        # once per file: the next starts read the files kept in `target`
        with phase(f"{reader.path.name}: writing its config and tokenizer into {target}"):
            write_model_files(reader, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # Another process finished first; its result is as good as ours.
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
