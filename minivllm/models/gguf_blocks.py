"""A GGUF's quantized linear weights given to the model as stored blocks, no dense copy.

`attach_blocks` runs after the model is built and before its weights are loaded: every linear
layer whose checkpoint tensors all have a type in `BLOCK_TYPES`, and the token embedding and
LM head, get the chooser's method for those blocks (`minivllm.layers.quantization.chooser`;
for a linear layer a `GgmlBlockMethod` over a `BlockWeight` of the memory-mapped file) and
drop their dense weights, never written; the names it returns are the checkpoint tensors the
dense loader then skips. llama's q/k rows, permuted by llama.cpp's converter, are put back in
HF's order by moving whole rows of blocks.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from torch import nn

from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.linear import LinearBase
from minivllm.layers.quantization.chooser import StoredFormat, choose_method
from minivllm.layers.quantization.head import BlockHead
from minivllm.layers.quantization.kernels.block_weight import (
    BLOCK_TYPES,
    EMBEDDING_BLOCK_TYPES,
    BlockSegment,
)
from minivllm.layers.quantization.methods import GgmlBlockMethod
from minivllm.layers.quantization.policy import WeightPolicy, block_activations
from minivllm.models.gguf import hf_tensor_name, qk_heads, unpermute_qk
from minivllm.models.gguf_arch import architecture
from minivllm.models.gguf_file import GGUFFile, GGUFTensor
from minivllm.models.gguf_int4 import lm_head_q8_0
from minivllm.models.loader import PackedMapping, checkpoint_to_param_name


def _segment(reader: GGUFFile, tensor: GGUFTensor, hf_name: str) -> BlockSegment:
    rows: np.ndarray = tensor.data  # [N, row_bytes], a read-only view of the map
    if (heads := qk_heads(reader, hf_name)) is not None:
        rows = np.ascontiguousarray(unpermute_qk(rows, heads))
    with warnings.catch_warnings():  # read-only by design: the kernels never write weights
        warnings.simplefilter("ignore", UserWarning)
        blocks = torch.from_numpy(rows)
    return BlockSegment(blocks, tensor.tensor_type)


def q8_0_head_rows(reader: GGUFFile) -> BlockSegment | None:
    """The LM head's Q8_0 tensor (`output`, else the tied `token_embd`) as stored rows, or
    None where the head is not Q8_0."""
    head = lm_head_q8_0(reader)
    return None if head is None else _segment(reader, head, "lm_head.weight")


def attach_blocks(model: nn.Module, reader: GGUFFile, policy: WeightPolicy) -> set[str]:
    """Give each linear layer whose checkpoint tensors are all block-typed the chooser's
    method for its stored blocks, its activations rounded as `block_activations` says for its
    segments and the layer; returns the checkpoint names so supplied. A fused layer with a
    shard of another type (e.g. a float v_proj) stays dense."""
    arch = architecture(reader)
    packed: PackedMapping = getattr(model, "packed_modules_mapping", {})
    found: dict[str, dict[Any, tuple[str, GGUFTensor]]] = {}
    for tensor in reader.tensors:
        if tensor.tensor_type not in BLOCK_TYPES or len(tensor.shape) != 2:
            continue
        name = hf_tensor_name(tensor.name, arch)
        param_name, shard_id = checkpoint_to_param_name(name, packed)
        module_name, _, kind = param_name.rpartition(".")
        if kind == "weight":
            found.setdefault(module_name, {})[shard_id] = (name, tensor)
    supplied: set[str] = set()
    for module_name, parts in found.items():
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            continue
        if not isinstance(module, LinearBase) or set(parts) != set(module.shard_ids):
            continue
        names = [parts[i][0] for i in module.shard_ids]
        segments = [_segment(reader, parts[i][1], parts[i][0]) for i in module.shard_ids]
        stored = _stored(segments, module_name)
        method = choose_method(module, stored, policy, prefix=module_name)
        supplied.update(names)
        assert isinstance(method, GgmlBlockMethod)  # what the chooser gives stored blocks
        for i, segment in zip(module.shard_ids, method.weight.segments, strict=True):
            if segment.x8:  # moved into tiles: the file's pages are not read again
                reader.release_tensor_pages(parts[i][1])
    return supplied | _attach_embedding_blocks(model, reader, policy)


def _stored(segments: list[BlockSegment], layer: str = "") -> StoredFormat:
    return StoredFormat(blocks=tuple(segments), activations=block_activations(segments, layer))


def _attach_head(
    head: ParallelLMHead, reader: GGUFFile, tensor: GGUFTensor, policy: WeightPolicy
) -> BlockSegment:
    """The LM head on `tensor`'s blocks; returns its rows as the kernels read them (moved
    into tiles where its kind has them: then the file's pages are not read again)."""
    method = choose_method(head, _stored([_segment(reader, tensor, "lm_head.weight")]), policy)
    assert isinstance(method, BlockHead)  # what the chooser gives stored blocks
    if method.segment.x8:
        reader.release_tensor_pages(tensor)
    return method.segment


def _attach_embedding_blocks(model: nn.Module, reader: GGUFFile, policy: WeightPolicy) -> set[str]:
    """The token embedding (and the LM head tied to it) or an untied LM head as stored
    blocks, where their tensors have a type of EMBEDDING_BLOCK_TYPES."""
    supplied: set[str] = set()
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    table = reader.by_name.get("token_embd.weight")
    if (
        isinstance(embedding, VocabParallelEmbedding)
        and table is not None
        and table.tensor_type in EMBEDDING_BLOCK_TYPES
    ):
        if tied and isinstance(head, ParallelLMHead):
            # one table for both: the head's rows, in tiles where its kind has them
            segment = _attach_head(head, reader, table, policy)
            supplied.add("lm_head.weight")
        else:
            segment = _segment(reader, table, "model.embed_tokens.weight")
        choose_method(embedding, StoredFormat(blocks=(segment,)), policy)
        supplied.add("model.embed_tokens.weight")
    output = reader.by_name.get("output.weight")
    if (
        not tied
        and isinstance(head, ParallelLMHead)
        and output is not None
        and output.tensor_type in EMBEDDING_BLOCK_TYPES
    ):
        _attach_head(head, reader, output, policy)
        supplied.add("lm_head.weight")
    return supplied
