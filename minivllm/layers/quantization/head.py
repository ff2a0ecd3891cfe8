"""How the LM head's weight runs: one method per head, chosen at load like a linear layer's.

The head is the one GEMM whose output is vocabulary-sized, and its logits decide the tokens,
so its methods differ from the linear layers' in two ways: they return float32 logits, and a
bf16 product may have its top logits computed again in fp32 (`refine_top_logits`). The
methods:

- `DenseHead`: the dense weight, oneDNN-packed on the CPU (fp32 as an mkldnn linear, bf16
  prepacked), else `F.linear`; with tensor parallelism the logits gathered on rank 0.
- `Int8Head`: a GGUF's Q8_0 head as stored for steps of few rows (our qgemv, or two int4
  halves for torch's kernel), the dense head above: one row table.
- `BlockHead`: the GGUF's quantized rows (the head's own, or the tied embedding's) for every
  step size (`BlockWeight`), no dense weight.

`minivllm.layers.quantization.chooser.choose_head_method` picks one.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
import torch.utils.mkldnn
from torch import nn

from minivllm.distributed import parallel_state
from minivllm.layers.quantization.kernels.block_weight import BlockSegment, BlockWeight, Kernel
from minivllm.layers.quantization.kernels.onednn import OneDnnWeight, onednn_prepack_supported
from minivllm.layers.quantization.rows import RowTable, pick
from minivllm.layers.top_rows import topk_rows


class Head(Protocol):
    """What a head method reads of its head (a `minivllm.layers.embedding.ParallelLMHead`)."""

    weight: nn.Parameter  # [vocab / tp_size, hidden]; [0, hidden] where blocks replace it
    embedding_dim: int
    tp_size: int


class HeadMethod:
    """How one LM head computes `[N, hidden]` -> `[N, vocab]` float32 logits."""

    name = "dense"

    def create_weights(self, head: Head) -> None:
        """Set the head's weight up for this method, before the checkpoint is loaded."""

    def process_weights_after_loading(self, head: Head) -> None:
        """Put the loaded weight in the layout the kernel reads."""

    def apply(self, head: Head, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class DenseHead(HeadMethod):
    """The dense weight; oneDNN-packed once loaded, on the CPU (see process_weights...).

    At decode batch sizes oneDNN's packed weight runs the head faster than MKL's plain GEMM,
    and so the whole decode step (`benchmarks/lm_head.py`; docs/benchmarks.md, "Batching,
    attention and the LM head"), for one more copy of the weight. fp32 results differ from
    F.linear by float rounding only, bf16 ones not at all."""

    def __init__(self, exact_rows: BlockSegment | None = None) -> None:
        # the packed copy: a oneDNN bf16 weight, or an mkldnn linear for fp32 (not registered
        # as a submodule: no state_dict entry)
        self.packed: OneDnnWeight | nn.Module | None = None
        # a bf16 head's own rows at full precision (a GGUF's Q8_0), to refine its top logits
        self.exact_rows = exact_rows

    @property
    def name(self) -> str:  # type: ignore[override]
        return (
            "dense" if self.packed is None else f"dense, oneDNN-packed {type(self.packed).__name__}"
        )

    def process_weights_after_loading(self, head: Head) -> None:
        weight = head.weight
        if onednn_prepack_supported(weight):
            self.packed = OneDnnWeight(weight)
        elif (
            weight.device.type == "cpu"
            and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available()
        ):
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            linear.weight = weight
            self.packed = torch.utils.mkldnn.to_mkldnn(linear)

    def apply(self, head: Head, hidden: torch.Tensor) -> torch.Tensor:
        """With tp_size > 1 only rank 0 (which samples) gets the full logits; the other ranks
        get their own `[num_tokens, vocab_size / tp_size]` slice."""
        packed = self.packed
        if isinstance(packed, OneDnnWeight) and hidden.dtype == torch.bfloat16:
            logits = packed.matmul(hidden)  # [num_tokens, vocab_size / tp_size]
            if self.exact_rows is not None:
                return refine_top_logits(logits.float(), hidden, self.exact_rows)
        elif (
            isinstance(packed, nn.Module)
            and hidden.dtype == torch.float32
            and hidden.device.type == "cpu"
        ):
            logits = packed(hidden.contiguous())  # [num_tokens, vocab_size / tp_size]
        else:
            logits = F.linear(hidden, head.weight)  # [num_tokens, vocab_size / tp_size]
        if head.tp_size > 1:
            logits = parallel_state.gather_to_first(logits)  # [num_tokens, vocab_size] on rank 0
        return logits.float()


class Int8Head(HeadMethod):
    """An 8-bit head as stored for steps of few rows, the dense head above (one row table)."""

    def __init__(self, small: RowTable[Kernel], dense: DenseHead, kernel: str) -> None:
        self.dense = dense
        self.table = (
            *((rows, _as_head(k)) for rows, k in small),
            (float("inf"), dense.apply),
        )
        self.kernel = kernel

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"Q8_0 as stored ({self.kernel}) + {self.dense.name}"

    def create_weights(self, head: Head) -> None:
        if head.tp_size != 1:
            raise ValueError("an 8-bit LM head needs tensor_parallel_size=1")

    def process_weights_after_loading(self, head: Head) -> None:
        self.dense.process_weights_after_loading(head)

    def apply(self, head: Head, hidden: torch.Tensor) -> torch.Tensor:
        return pick(self.table, hidden)(head, hidden)


def _as_head(kernel: Kernel):  # noqa: ANN202 - a row-table entry: (head, hidden) -> logits
    def apply(head: Head, hidden: torch.Tensor) -> torch.Tensor:
        return kernel(hidden).float()  # [num_tokens, vocab_size] float32

    return apply


class BlockHead(HeadMethod):
    """The logits on the GGUF's quantized rows, every step size, the activations rounded as
    the BlockWeight says; each row's top logits refined in fp32 from the same rows."""

    name = "GGUF blocks"

    def __init__(self, weight: BlockWeight) -> None:
        self.weight = weight

    @property
    def segment(self) -> BlockSegment:
        """The rows, as the kernels read them (moved into tiles where their kind has them)."""
        return self.weight.segments[0]

    def create_weights(self, head: Head) -> None:
        if head.tp_size != 1:
            raise ValueError("GGUF block weights are supported with tensor_parallel_size=1 only")
        # [0, hidden]: keeps the dtype and device for whoever asks, holds nothing
        head.weight = nn.Parameter(
            head.weight.new_empty(0, head.embedding_dim), requires_grad=False
        )

    def apply(self, head: Head, hidden: torch.Tensor) -> torch.Tensor:
        # int8 (or bf16) activations: the top logits again from the exact rows
        logits = self.weight.matmul_float(hidden)  # [num_tokens, vocab_size]
        return refine_top_logits(logits, hidden, self.segment)


# How many of each row's highest bf16 logits `refine_top_logits` computes again in fp32.
REFINED_LOGITS = 16


def refine_top_logits(
    logits: torch.Tensor, hidden: torch.Tensor, exact_rows: BlockSegment
) -> torch.Tensor:
    """`logits` `[N, vocab]` fp32 from a bf16 matmul, their REFINED_LOGITS highest per row
    computed again in fp32 from the weight's exact rows: in place, returned.

    A bf16 matmul rounds its outputs to 8 bits of mantissa (0.06 at a logit of 16) and its
    weight too (a Q8_0 code times its fp16 scale needs more): enough to swap near-tied tokens,
    which took the default model below its top-1 bar on a CPU whose oneDNN runs AMX
    (docs/benchmarks.md, "Quality against HF fp32"). The true top token is among the highest
    rounded ones, so the greedy choice and the top logprobs become the fp32 ones, at the cost
    of a top-k and `N * 16` dot products."""
    top = topk_rows(logits, min(REFINED_LOGITS, logits.shape[-1]))[1]  # [N, k]
    rows = exact_rows.lookup(top.flatten(), hidden.shape[-1], torch.float32)  # [N * k, in]
    # a batched matmul, as einsum would call it, without einsum's parsing on every step
    exact = torch.bmm(rows.view(*top.shape, -1), hidden.float().unsqueeze(-1)).squeeze(-1)  # [N, k]
    return logits.scatter_(-1, top, exact)
