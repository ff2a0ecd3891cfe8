"""The one place a weight's method is chosen: `choose_method`, at load, for every linear layer,
the LM head and the token embedding.

Its inputs are the layer, how the checkpoint stores its weight (`StoredFormat`, read by the
loader: GGUF blocks, 4-bit codes, a Q8_0 head split in two halves), the engine's
`WeightPolicy` and the CPU's frozen capabilities (`CpuCaps`). Its answer is the layer's method,
which owns its packing and its row table (`minivllm.layers.quantization.rows`): which kernel
runs up to how many rows, from the registry of thresholds for this CPU's kind. Nothing after
load picks a kernel by format, row count or instruction set except by reading that table.
This is vLLM's `get_quant_method(layer, prefix)` for our kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from minivllm.layers.cpu_kernels import CpuCaps, cpu_caps
from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.linear import LinearBase
from minivllm.layers.quantization.head import BlockHead, DenseHead, HeadMethod, Int8Head
from minivllm.layers.quantization.int8 import INT8_LAYERS
from minivllm.layers.quantization.kernels.block_weight import BlockSegment, BlockWeight, Kernel
from minivllm.layers.quantization.kernels.int4 import Int4Weight, PackedInt4, PackedInt4Pair
from minivllm.layers.quantization.kernels.qgemv import QGemvWeight
from minivllm.layers.quantization.lookup import BlockLookup, DenseLookup, LookupMethod
from minivllm.layers.quantization.methods import (
    GgmlBlockMethod,
    Int4Method,
    Int8Method,
    LinearMethod,
    UnquantizedMethod,
    check_whole,
)
from minivllm.layers.quantization.policy import WeightPolicy
from minivllm.layers.quantization.rows import RowTable, kernel_rows


@dataclass(frozen=True)
class StoredFormat:
    """A weight as the checkpoint stores it, where some kernel of ours can run it as such;
    the default (nothing set) is a dense weight."""

    blocks: tuple[BlockSegment, ...] = ()  # GGUF blocks, one segment per fused shard
    activations: str = "int8"  # how the block kernels round the activations (BlockWeight)
    int4: Int4Weight | None = None  # the whole [out, in] weight as 4-bit codes
    int8_halves: tuple[Int4Weight, Int4Weight] | None = None  # a Q8_0 head, `split_int8`
    exact_rows: BlockSegment | None = None  # a bf16 head's rows at full precision


DENSE = StoredFormat()
Method = LinearMethod | HeadMethod | LookupMethod


def choose_method(
    layer: nn.Module,
    stored: StoredFormat,
    policy: WeightPolicy,
    prefix: str = "",
    caps: CpuCaps | None = None,
) -> Method:
    """Choose the method of `layer` (a linear layer, the LM head or the token embedding, named
    `prefix` in the model) whose checkpoint weight is `stored`, under `policy` on a CPU of
    `caps` (default: this one's), and give it to the layer (its `create_weights` runs now);
    returns it. ValueError for a layer of another kind."""
    caps = cpu_caps() if caps is None else caps
    if isinstance(layer, ParallelLMHead):
        head = _head_method(layer, stored, policy, caps)
        layer.set_method(head)
        return head
    if isinstance(layer, VocabParallelEmbedding):
        lookup = BlockLookup(stored.blocks[0]) if stored.blocks else DenseLookup()
        layer.set_lookup(lookup)
        return lookup
    if not isinstance(layer, LinearBase):
        raise ValueError(f"no weight method for a {type(layer).__name__} ({prefix or 'unnamed'})")
    method = _linear_method(layer, stored, policy, prefix, caps)
    layer.set_method(method)
    return method


def _linear_method(
    layer: LinearBase, stored: StoredFormat, policy: WeightPolicy, prefix: str, caps: CpuCaps
) -> LinearMethod:
    if stored.blocks:
        weight = BlockWeight(
            list(stored.blocks),
            layer.input_size,
            stored.activations,
            two_code_rows=_two_code_rows(layer.weight.dtype),
        )
        return GgmlBlockMethod(weight)
    if policy.int8:
        return Int8Method() if prefix.rsplit(".", 1)[-1] in INT8_LAYERS else UnquantizedMethod()
    if stored.int4 is not None and policy.stored_kernel is not None:
        check_whole(layer, stored.int4.shape, "int4")
        table = int4_table(stored.int4, layer.weight.dtype, caps)
        if table is not None:
            return Int4Method(table, UnquantizedMethod(), _kernel_names(table))
    return UnquantizedMethod()


def _two_code_rows(dtype: torch.dtype) -> float:
    """Above how many rows a two-code stored-block step dequantizes instead: the row table's
    crossover for bf16 activations; fp32's dequantized matmul is slower than the integer
    kernel's at every count measured."""
    return kernel_rows().ggml_two_codes if dtype == torch.bfloat16 else float("inf")


def _head_method(
    head: ParallelLMHead, stored: StoredFormat, policy: WeightPolicy, caps: CpuCaps
) -> HeadMethod:
    if stored.blocks:
        # One code: BlockHead computes each row's top logits again in fp32 from the same
        # rows, so a second code would only sharpen the others, which decide no more than
        # which rows are refined and a logprob's normalizer (docs/ggml-kernels.md).
        return BlockHead(BlockWeight(list(stored.blocks), head.embedding_dim, "int8"))
    dense = DenseHead(stored.exact_rows)
    if stored.int8_halves is None or policy.stored_kernel is None:
        return dense
    table = int8_head_table(*stored.int8_halves, head.weight.dtype, caps)
    return dense if table is None else Int8Head(table, dense, _kernel_names(table))


def int4_table(weight: Int4Weight, dtype: torch.dtype, caps: CpuCaps) -> RowTable[Kernel] | None:
    """A 4-bit weight packed for the kernels that run `dtype` activations, as a row table:
    qgemv for fp32; torch's int4 for bf16, with qgemv's VNNI path at one row where it runs
    (faster there; it holds the weight in both layouts, 5 more bits a weight). None where
    no kernel takes its shape (the layer stays dense)."""
    rows = kernel_rows()
    if dtype == torch.float32:
        if not QGemvWeight.supports(weight):
            return None
        return ((rows.qgemv, QGemvWeight.from_int4(weight).matmul),)
    packed = PackedInt4(weight, dtype)
    if QGemvWeight.supports(weight) and caps.qgemv_vnni:
        one_row = QGemvWeight.from_int4(weight)

        def qgemv_vnni(x: torch.Tensor) -> torch.Tensor:
            return one_row.matmul(x).to(x.dtype)

        return ((rows.qgemv_vnni_bf16, qgemv_vnni), (rows.int4, packed.matmul))
    return ((rows.int4, packed.matmul),)


def int8_head_table(
    high: Int4Weight, low: Int4Weight, dtype: torch.dtype, caps: CpuCaps
) -> RowTable[Kernel] | None:
    """An 8-bit head given as `int4.split_int8`'s two halves, for `dtype` activations: whole
    again for our kernel (bf16 activations widened), else two packed int4 halves for torch's
    (bf16 only); None where no kernel takes its shape."""
    rows = kernel_rows()
    if QGemvWeight.supports(low) and dtype == torch.float32:
        return ((rows.qgemv, QGemvWeight.from_int8_halves(high, low).matmul),)
    if QGemvWeight.supports(low) and caps.kernels:
        return ((rows.qgemv_bf16_head, QGemvWeight.from_int8_halves(high, low).matmul),)
    if dtype != torch.bfloat16:
        return None
    return ((rows.int8_as_int4_pair, PackedInt4Pair(high, low).matmul),)


def _kernel_names(table: RowTable[Kernel]) -> str:
    """The kernels of a row table, for the log: `QGemvWeight <= 1, PackedInt4 <= 4`."""
    names = [
        type(kernel.__self__).__name__ if hasattr(kernel, "__self__") else kernel.__name__
        for _, kernel in table
    ]
    return ", ".join(f"{name} <= {rows:g}" for name, (rows, _) in zip(names, table, strict=True))
