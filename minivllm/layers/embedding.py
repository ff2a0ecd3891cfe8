"""Token embedding and LM head, vocab-parallel.

Both hold a `[vocab_size / tp_size, hidden_size]` weight: rank r owns token ids
`[r * vocab_size / tp_size, (r + 1) * vocab_size / tp_size)`. The embedding looks up the ids
it owns, zeroes the rows of the others, and sums over the ranks (each id is owned once); the
LM head computes its vocab slice of the logits and gathers the full logits on rank 0.
"""

import torch
import torch.nn.functional as F
import torch.utils.mkldnn
from torch import nn

from minivllm.distributed import parallel_state
from minivllm.layers.block_weight import BlockSegment, BlockWeight
from minivllm.layers.int4 import PackedInt4Pair
from minivllm.layers.onednn import OneDnnWeight, onednn_prepack_supported
from minivllm.layers.qgemv import QGemvWeight


class VocabParallelEmbedding(nn.Module):
    """Lookup table `token id -> [hidden_size]` vector."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, tp_size: int = 1, tp_rank: int = 0
    ) -> None:
        super().__init__()
        if num_embeddings % tp_size:
            raise ValueError(f"vocab size {num_embeddings} is not divisible by tp_size {tp_size}")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.num_embeddings_per_partition = num_embeddings // tp_size
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        # the GGUF's quantized rows, once set_blocks() has run: then the only weight
        self.block_weight: BlockSegment | None = None

    def set_blocks(self, segment: BlockSegment) -> None:
        """Keep the table as the GGUF's quantized rows (`[vocab, row_bytes]`, or the tied LM
        head's tiles of 8 rows): a lookup dequantizes the rows it reads. The dense weight, not
        loaded yet, is dropped."""
        if self.tp_size != 1:
            raise ValueError("GGUF block weights are supported with tensor_parallel_size=1 only")
        if segment.rows != self.num_embeddings:
            raise ValueError(f"{segment.rows} block rows for a vocabulary of {self.num_embeddings}")
        self.block_weight = segment
        # [0, hidden]: keeps the dtype and device for whoever asks, holds nothing
        self.weight = nn.Parameter(
            self.weight.new_empty(0, self.embedding_dim), requires_grad=False
        )

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        """Copy this rank's rows of a full `[vocab_size, hidden_size]` checkpoint tensor."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shards, got shard_id={shard_id!r}")
        if tuple(loaded.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"shape mismatch: expected {(self.num_embeddings, self.embedding_dim)}, "
                f"got {tuple(loaded.shape)}"
            )
        size = self.num_embeddings_per_partition
        param.data.copy_(loaded.narrow(0, self.tp_rank * size, size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`[num_tokens]` int64 -> `[num_tokens, hidden_size]`."""
        if self.block_weight is not None:
            return self.block_weight.lookup(input_ids, self.embedding_dim, self.weight.dtype)
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        start = self.tp_rank * self.num_embeddings_per_partition
        owned = (input_ids >= start) & (input_ids < start + self.num_embeddings_per_partition)
        local_ids = torch.where(owned, input_ids - start, 0)  # [num_tokens]
        out = F.embedding(local_ids, self.weight)  # [num_tokens, hidden_size]
        out.masked_fill_(~owned.unsqueeze(-1), 0.0)
        return parallel_state.all_reduce(out)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp_size={self.tp_size}"


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection `hidden -> logits`; may share its weight with the token embedding."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, tp_size: int = 1, tp_rank: int = 0
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, tp_size, tp_rank)

        # A oneDNN-packed copy of the weight for forward on the CPU (see pack_for_cpu), kept
        # in a tuple so that it is not registered as a submodule (no state_dict entry).
        self._packed: tuple[nn.Module | OneDnnWeight, ...] = ()
        # a Q8_0 head for small steps: whole for our qgemv kernel (fp32 or bf16 activations),
        # else two packed int4 halves for torch's int4 kernel (bf16, no kernels built)
        self.int8_head: PackedInt4Pair | QGemvWeight | None = None
        # the head as the GGUF's quantized rows (its own, or the tied embedding's)
        self.head_blocks: BlockWeight | None = None
        # a bf16 head's own rows at full precision (a GGUF's Q8_0), to refine its top logits
        self.exact_rows: BlockSegment | None = None

    def set_int8_head(self, head: PackedInt4Pair | QGemvWeight) -> None:
        """Run decode-sized steps on an 8-bit head as stored (`minivllm.layers.
        linear_method.pack_8bit_halves`); larger steps keep the dense weight."""
        if self.tp_size != 1:
            raise ValueError("an 8-bit LM head needs tensor_parallel_size=1")
        self.int8_head = head

    def set_blocks(self, segment: BlockSegment, activations: str = "int8") -> None:
        """Compute the logits on the GGUF's quantized rows, for every step size, the
        activations rounded as `activations` says (`BlockWeight`); the dense weight, not
        loaded yet (or the tied embedding's, dropped there), is not used. The same rows
        refine each row's top logits in fp32 (`refine_top_logits`)."""
        if self.tp_size != 1:
            raise ValueError("GGUF block weights are supported with tensor_parallel_size=1 only")
        self.head_blocks = BlockWeight([segment], self.embedding_dim, activations)
        self.weight = nn.Parameter(
            self.weight.new_empty(0, self.embedding_dim), requires_grad=False
        )

    def set_exact_rows(self, segment: BlockSegment | None) -> None:
        """The head's weight at full precision (the file's Q8_0 rows, a view of the map) for
        the bf16 steps of several rows: see `refine_top_logits`."""
        self.exact_rows = segment

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (tie_word_embeddings): one tensor, loaded once."""
        self.weight = embedding.weight

    def pack_for_cpu(self) -> bool:
        """Keep a oneDNN-packed copy of the (loaded) weight and use it in forward: fp32 as an
        mkldnn linear, bf16 prepacked (`minivllm.layers.onednn`).

        The LM head is the one GEMM whose output is huge (49k columns for SmolLM2): at decode
        batch sizes oneDNN's packed weight runs it faster than MKL's plain GEMM, and so the
        whole decode step (`benchmarks/lm_head.py`; the figures are in docs/benchmarks.md,
        "Batching, attention and the LM head"). It costs one more copy of the weight. fp32 results
        differ from F.linear by float rounding only, bf16 ones not at all. False (nothing
        done) off the CPU or in other dtypes.
        """
        weight = self.weight
        if self.head_blocks is not None:
            return False
        if onednn_prepack_supported(weight):
            self._packed = (OneDnnWeight(weight),)
            return True
        if (
            weight.device.type != "cpu"
            or weight.dtype != torch.float32
            or not torch.backends.mkldnn.is_available()
        ):
            return False
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight = weight
        self._packed = (torch.utils.mkldnn.to_mkldnn(linear),)
        return True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[num_tokens, hidden_size]` -> `[num_tokens, vocab_size]` float32 logits.

        With tp_size > 1 only rank 0 (which samples) gets the full logits; the other ranks
        get their own `[num_tokens, vocab_size / tp_size]` slice.
        """
        if self.head_blocks is not None:
            # int8 (or bf16) activations: the top logits again from the exact rows
            logits = self.head_blocks.matmul(hidden).float()  # [num_tokens, vocab_size]
            return refine_top_logits(logits, hidden, self.head_blocks.segments[0])
        if self.int8_head is not None and self.int8_head.fits(hidden):
            return self.int8_head.matmul(hidden).float()  # [num_tokens, vocab_size] float32
        packed = self._packed[0] if self._packed else None
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
            logits = F.linear(hidden, self.weight)  # [num_tokens, vocab_size / tp_size]
        if self.tp_size > 1:
            logits = parallel_state.gather_to_first(logits)  # [num_tokens, vocab_size] on rank 0
        return logits.float()


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
    top = logits.topk(min(REFINED_LOGITS, logits.shape[-1]), dim=-1).indices  # [N, k]
    rows = exact_rows.lookup(top.flatten(), hidden.shape[-1], torch.float32)  # [N * k, in]
    exact = torch.einsum("nki,ni->nk", rows.view(*top.shape, -1), hidden.float())  # [N, k]
    return logits.scatter_(-1, top, exact)
