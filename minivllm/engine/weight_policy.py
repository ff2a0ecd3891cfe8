"""The weights' methods given at load: the checkpoint's stored formats read, the chooser asked.

The policy (`minivllm.layers.quantization.policy.WeightPolicy`) is decided before any weight
is loaded; a GGUF's block-typed tensors are then given to their layers as stored while the
model is built (`minivllm.models.gguf_blocks.attach_blocks`). Once the dense weights are
loaded, `apply_weight_policy` reads the stored format of every other weight (a GGUF's 4-bit
tensors, its Q8_0 LM head; `quantization="int4"`: 4 bits quantized at load), asks
`minivllm.layers.quantization.chooser.choose_method` for each layer's method, and runs each
method's `process_weights_after_loading` (oneDNN prepacking of dense bf16 weights, the head's
packed copy). Nothing here picks a kernel: the chooser does.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.linear import LinearBase
from minivllm.layers.quantization.chooser import StoredFormat, choose_method
from minivllm.layers.quantization.head import DenseHead
from minivllm.layers.quantization.kernels.int4 import Int4Weight, quantize_int4
from minivllm.layers.quantization.lookup import BlockLookup
from minivllm.layers.quantization.methods import GgmlBlockMethod, Int4Method, UnquantizedMethod
from minivllm.layers.quantization.policy import WeightPolicy
from minivllm.models.gguf_blocks import q8_0_head_rows
from minivllm.models.gguf_file import GGUFFile
from minivllm.models.gguf_int4 import LM_HEAD_HIGH, LM_HEAD_LOW, read_int4_weights
from minivllm.models.loader import PackedMapping, checkpoint_to_param_name

logger = logging.getLogger(__name__)


def apply_weight_policy(
    model: nn.Module, policy: WeightPolicy, gguf: GGUFFile | None, block_weights: set[str]
) -> str | None:
    """Give the loaded model's linear layers and LM head their methods as `policy` says and
    process their weights after loading; returns the kernel of the weights kept as stored:
    that of the 4-bit ones ("int4", "qgemv"), else "blocks" where only GGUF blocks are
    (None: none are)."""
    kernel = policy.stored_kernel
    count = 0
    if policy.int8:
        for name, module in model.named_modules():
            if isinstance(module, LinearBase):
                choose_method(module, StoredFormat(), policy, prefix=name)
    elif kernel is not None:
        weights = read_int4_weights(gguf, exclude=block_weights) if gguf else {}
        _choose_head(model, policy, gguf, weights)
        count = attach_int4(model, weights, policy)
        if policy.quantize_int4:
            count += quantize_linear_int4(model, policy)
        logger.info(
            "4-bit weights for %d linear layers (%s kernel, %s)",
            count,
            kernel,
            "from the GGUF's 4-bit blocks" if gguf else "quantized at load",
        )
    process_weights_after_loading(model)
    if kernel is None:
        return None
    return kernel if count else ("blocks" if block_weights else None)


def _choose_head(
    model: nn.Module, policy: WeightPolicy, gguf: GGUFFile | None, weights: dict[str, Int4Weight]
) -> None:
    """The LM head's method: a Q8_0 head as stored for small steps where a kernel takes it; a
    bf16 head refines its top logits from the file's Q8_0 rows."""
    head = getattr(model, "lm_head", None)
    if LM_HEAD_HIGH not in weights or not isinstance(head, ParallelLMHead):
        return
    halves = (weights.pop(LM_HEAD_HIGH), weights.pop(LM_HEAD_LOW))
    exact = (
        q8_0_head_rows(gguf) if gguf is not None and head.weight.dtype == torch.bfloat16 else None
    )
    stored = StoredFormat(int8_halves=halves, exact_rows=exact)
    method = choose_method(head, stored, policy)
    if not isinstance(method, DenseHead):
        logger.info("LM head: its Q8_0 weight as stored for small steps (%s)", method.name)


def process_weights_after_loading(model: nn.Module) -> None:
    """Each linear layer's method, and the LM head's, puts its loaded weight in its kernel's
    layout. The methods in use are logged once."""
    methods: Counter[str] = Counter()
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.method.process_weights_after_loading(module)
            methods[module.method.name] += 1
    head = getattr(model, "lm_head", None)
    if isinstance(head, ParallelLMHead):
        head.method.process_weights_after_loading(head)
        logger.info("LM head: %s, %s", head.method.name, head.weight.dtype)
    logger.info("linear layers: %s", ", ".join(f"{n} {name}" for name, n in methods.items()))


def _layers_with(model: nn.Module, weights: dict[str, Int4Weight]) -> dict[str, Int4Weight]:
    """Module name -> its whole 4-bit weight (shards stacked as in the fused layer), for each
    linear layer still dense whose checkpoint tensors are all in `weights`."""
    packed: PackedMapping = getattr(model, "packed_modules_mapping", {})
    shards: dict[str, dict[int | str | None, Int4Weight]] = {}
    for ckpt_name, weight in weights.items():
        param_name, shard_id = checkpoint_to_param_name(ckpt_name, packed)
        module_name, _, kind = param_name.rpartition(".")
        if kind == "weight":
            shards.setdefault(module_name, {})[shard_id] = weight
    whole = {}
    for module_name, parts in shards.items():
        module = model.get_submodule(module_name)
        if (
            isinstance(module, LinearBase)
            and type(module.method) is UnquantizedMethod
            and set(parts) == set(module.shard_ids)
        ):
            whole[module_name] = Int4Weight.cat([parts[i] for i in module.shard_ids])
    return whole


def attach_int4(model: nn.Module, weights: dict[str, Int4Weight], policy: WeightPolicy) -> int:
    """Ask the chooser for a method for every linear layer whose checkpoint tensors are all
    in `weights` (checkpoint name -> 4-bit weight). A fused layer with one shard missing (e.g.
    k/q in 4 bits, v in 6) stays dense. Returns how many layers got an `Int4Method`."""
    count = 0
    for module_name, weight in _layers_with(model, weights).items():
        module = model.get_submodule(module_name)
        method = choose_method(module, StoredFormat(int4=weight), policy, prefix=module_name)
        count += isinstance(method, Int4Method)
    return count


def quantize_linear_int4(model: nn.Module, policy: WeightPolicy) -> int:
    """Quantize every linear layer still dense from its dense weight (`quantization="int4"`
    on an HF checkpoint) and ask the chooser for its method. Returns how many layers got an
    `Int4Method`."""
    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, LinearBase) and type(module.method) is UnquantizedMethod:
            stored = StoredFormat(int4=quantize_int4(module.weight))
            method = choose_method(module, stored, policy, prefix=name)
            count += isinstance(method, Int4Method)
    return count


def log_block_weights(model: nn.Module, tensors: int) -> None:
    """The memory of the weights kept as the GGUF's stored blocks, beside the dense rest."""
    stored = sum(
        m.method.weight.nbytes
        for m in model.modules()
        if isinstance(m, LinearBase) and isinstance(m.method, GgmlBlockMethod)
    )
    stored += sum(
        m.lookup.segment.nbytes
        for m in model.modules()
        if isinstance(m, VocabParallelEmbedding)
        and not isinstance(m, ParallelLMHead)
        and isinstance(m.lookup, BlockLookup)
    )
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    logger.info(
        "weights: %d GGUF tensors kept as stored blocks (%.2f GB, no dense copy), %.2f GB dense",
        tensors,
        stored / 1e9,
        dense / 1e9,
    )
