"""Which method runs each linear layer's weight: decided once at load, in this one place.

`WeightPolicy.decide` reads the engine's options, the device and dtype, the number of
processes, whether the checkpoint is a GGUF, and the CPU's capabilities (`cpu_caps()`), and
answers three questions, before any weight is loaded:

- `keep_blocks`: do a GGUF's quantized tensors (`BLOCK_TYPES`: Q4_0 ... Q6_K) stay as stored
  blocks (`GgmlBlockMethod`, attached while loading by `minivllm.models.gguf_blocks`)?
- `stored_kernel`: which kernel runs the 4-bit weights not kept as blocks, and a Q8_0 LM
  head (`Int4Method`, the 8-bit head): "int4" (torch's int4, bf16 on the CPU), "qgemv" (ours,
  fp32 on x86 with AVX2) or None (dense)?
- `int8`: `quantization="int8"` (`Int8Method` on `INT8_LAYERS`)?

`token_exact` is the fp32 path held token-exact to HF transformers: float32 asked for
explicitly with the default quantization. It keeps every weight dense (no blocks, no qgemv)
and its decode step eager. `apply_weight_policy` then gives the loaded layers their methods and
runs each method's `process_weights_after_loading` (oneDNN prepacking of dense bf16 weights).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from minivllm.config import EngineConfig
from minivllm.layers.block_weight import BlockSegment, two_code_block
from minivllm.layers.cpu_kernels import cpu_caps
from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.int4 import Int4Weight, int4_supported, quantize_int4
from minivllm.layers.linear import LinearBase
from minivllm.layers.quantization.int8 import INT8_LAYERS, check_quantization
from minivllm.layers.quantization.methods import (
    GgmlBlockMethod,
    Int4Method,
    Int8Method,
    UnquantizedMethod,
    pack_8bit_halves,
)
from minivllm.models.gguf_blocks import q8_0_head_rows
from minivllm.models.gguf_file import GGUFFile
from minivllm.models.gguf_int4 import LM_HEAD_HIGH, LM_HEAD_LOW, read_int4_weights
from minivllm.models.loader import PackedMapping, checkpoint_to_param_name

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightPolicy:
    """How the weights run, decided once at load (see the module docstring)."""

    keep_blocks: bool
    stored_kernel: str | None  # "int4", "qgemv" or None
    int8: bool
    quantize_int4: bool  # quantization="int4": the layers with no 4-bit tensor get one at load
    token_exact: bool

    @staticmethod
    def decide(
        config: EngineConfig, device: torch.device, dtype: torch.dtype, tp_size: int, gguf: bool
    ) -> WeightPolicy:
        """The policy for these options on this machine; ValueError for a quantization that
        cannot run here."""
        method = config.quantization
        token_exact = (
            method is None and config.dtype not in (None, "auto") and dtype == torch.float32
        )
        alone_on_cpu = device.type == "cpu" and tp_size == 1
        keep_blocks = (
            gguf and alone_on_cpu and method is None and not token_exact and cpu_caps().kernels
        )
        if method == "int8":
            check_quantization(method, device, dtype)
        kernel = None
        if method not in ("int8", "none") and (method == "int4" or tp_size == 1):
            kernel = stored_weight_kernel(device, dtype)
            if token_exact:
                kernel = None
            if method == "int4" and (kernel is None or tp_size > 1):
                raise ValueError(
                    "quantization='int4' runs on the CPU (bfloat16, or float32 on "
                    "an x86 CPU with AVX2) with tensor_parallel_size=1 (got "
                    f"device {device.type}, dtype {dtype}, "
                    f"tensor_parallel_size {tp_size})"
                )
        return WeightPolicy(
            keep_blocks=keep_blocks,
            stored_kernel=kernel,
            int8=method == "int8",
            quantize_int4=method == "int4",
            token_exact=token_exact,
        )


# The activation precision of the stored-block kernels (`BlockWeight`'s `activations`), per
# block over which the integer kernel rounds them: 256 inputs for the K kinds (Q4_K, Q5_K,
# Q6_K), 32 for Q5_0/Q5_1/Q8_0. A block holding one of the huge activations of a model such
# as Gemma 3 gets a step that rounds its other inputs to 0; a second 8-bit code for the
# residual brings them back, at the same weight reads (docs/ggml-kernels.md, "Activation
# precision", measured on real files).
BLOCK_ACTIVATIONS = {256: "int8x2", 32: "int8x2"}


def block_activations(segments: list[BlockSegment]) -> str:
    """The activation precision for a stored-block weight of `segments` (BLOCK_ACTIVATIONS;
    "int8" where its kinds round over different blocks)."""
    block = two_code_block(segments)
    return "int8" if block is None else BLOCK_ACTIVATIONS[block]


def stored_weight_kernel(device: torch.device, dtype: torch.dtype) -> str | None:
    """The kernel for 4-bit weights kept as stored on `device` computing in `dtype`: torch's
    int4 where the model computes in bf16 on the CPU, our qgemv in fp32 on an x86 CPU with
    AVX2 (where the kernels loaded), else None (dense)."""
    if int4_supported(device, dtype):
        return "int4"
    if device.type == "cpu" and dtype == torch.float32 and cpu_caps().kernels:
        return "qgemv"
    return None


def apply_weight_policy(
    model: nn.Module, policy: WeightPolicy, gguf: GGUFFile | None, block_weights: set[str]
) -> str | None:
    """Give the loaded model's linear layers their methods as `policy` says, process their
    weights after loading, and pack the LM head; returns the kernel of the weights kept as
    stored: that of the 4-bit ones ("int4", "qgemv"), else "blocks" where only GGUF blocks
    are (None: none are)."""
    kernel = policy.stored_kernel
    count = 0
    if policy.int8:
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in INT8_LAYERS and isinstance(module, LinearBase):
                module.set_method(Int8Method())
    elif kernel is not None:
        weights = read_int4_weights(gguf, exclude=block_weights) if gguf else {}
        head = getattr(model, "lm_head", None)
        if LM_HEAD_HIGH in weights and isinstance(head, ParallelLMHead):
            packed = pack_8bit_halves(
                weights.pop(LM_HEAD_HIGH), weights.pop(LM_HEAD_LOW), head.weight.dtype
            )
            if packed is not None:
                head.set_int8_head(packed)
                logger.info("LM head: its Q8_0 weight as stored for small steps (%s)", kernel)
            if gguf is not None and head.weight.dtype == torch.bfloat16:
                head.set_exact_rows(q8_0_head_rows(gguf))
        count = attach_int4(model, weights)
        if policy.quantize_int4:
            count += quantize_linear_int4(model)
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


def process_weights_after_loading(model: nn.Module) -> None:
    """Each linear layer's method puts its loaded weight in its kernel's layout; the LM head
    is packed for oneDNN where that applies. The methods in use are logged once."""
    methods: Counter[str] = Counter()
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.method.process_weights_after_loading(module)
            methods[module.method.name] += 1
    head = getattr(model, "lm_head", None)
    if isinstance(head, ParallelLMHead) and head.pack_for_cpu():
        logger.info("LM head: oneDNN-packed %s weight", head.weight.dtype)
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


def attach_int4(model: nn.Module, weights: dict[str, Int4Weight]) -> int:
    """Give every linear layer whose checkpoint tensors are all in `weights` (checkpoint name
    -> 4-bit weight) an `Int4Method`. A fused layer with one shard missing (e.g. k/q in 4
    bits, v in 6) stays dense. Returns how many layers got one."""
    count = 0
    for module_name, weight in _layers_with(model, weights).items():
        module = model.get_submodule(module_name)
        if (method := Int4Method.for_layer(module, weight)) is not None:
            module.set_method(method)
            count += 1
    return count


def quantize_linear_int4(model: nn.Module) -> int:
    """Quantize every linear layer still dense from its dense weight (`quantization="int4"`
    on an HF checkpoint). Returns how many layers got an `Int4Method`."""
    count = 0
    for module in list(model.modules()):
        if isinstance(module, LinearBase) and type(module.method) is UnquantizedMethod:
            method = Int4Method.for_layer(module, quantize_int4(module.weight))
            if method is not None:
                module.set_method(method)
                count += 1
    return count


def log_block_weights(model: nn.Module, tensors: int) -> None:
    """The memory of the weights kept as the GGUF's stored blocks, beside the dense rest."""
    stored = sum(
        m.method.weight.nbytes
        for m in model.modules()
        if isinstance(m, LinearBase) and isinstance(m.method, GgmlBlockMethod)
    )
    stored += sum(
        m.block_weight.nbytes
        for m in model.modules()
        if isinstance(m, VocabParallelEmbedding) and m.block_weight is not None
    )
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    logger.info(
        "weights: %d GGUF tensors kept as stored blocks (%.2f GB, no dense copy), %.2f GB dense",
        tensors,
        stored / 1e9,
        dense / 1e9,
    )
