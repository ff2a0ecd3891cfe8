"""How the token embedding's table is read: one method per embedding, chosen at load.

- `DenseLookup`: the dense `[vocab / tp_size, hidden]` table; with tensor parallelism each
  rank looks up the ids it owns, zeroes the rows of the others, and the ranks sum.
- `BlockLookup`: the GGUF's quantized rows (`[vocab, row_bytes]`, or the tied LM head's tiles
  of 8 rows); a lookup dequantizes the rows it reads, so no dense copy of a vocabulary-sized
  table is kept.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed import parallel_state
from minivllm.layers.quantization.kernels.block_weight import BlockSegment


class Table(Protocol):
    """What a lookup reads of its embedding (a `layers.embedding.VocabParallelEmbedding`)."""

    weight: nn.Parameter  # [vocab / tp_size, hidden]; [0, hidden] where blocks replace it
    num_embeddings: int
    num_embeddings_per_partition: int
    embedding_dim: int
    tp_size: int
    tp_rank: int


class LookupMethod:
    """How one embedding maps `[num_tokens]` int64 ids to `[num_tokens, hidden]` rows."""

    name = "dense"

    def create_weights(self, table: Table) -> None:
        """Set the table up for this method, before the checkpoint is loaded."""

    def apply(self, table: Table, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class DenseLookup(LookupMethod):
    """The dense table, vocab-parallel."""

    def apply(self, table: Table, ids: torch.Tensor) -> torch.Tensor:
        if table.tp_size == 1:
            return F.embedding(ids, table.weight)
        start = table.tp_rank * table.num_embeddings_per_partition
        owned = (ids >= start) & (ids < start + table.num_embeddings_per_partition)
        local_ids = torch.where(owned, ids - start, 0)  # [num_tokens]
        out = F.embedding(local_ids, table.weight)  # [num_tokens, hidden_size]
        out.masked_fill_(~owned.unsqueeze(-1), 0.0)
        return parallel_state.all_reduce(out)


class BlockLookup(LookupMethod):
    """The GGUF's quantized rows; the dense weight, not loaded yet, is dropped."""

    name = "GGUF blocks"

    def __init__(self, segment: BlockSegment) -> None:
        self.segment = segment

    def create_weights(self, table: Table) -> None:
        if table.tp_size != 1:
            raise ValueError("GGUF block weights are supported with tensor_parallel_size=1 only")
        if self.segment.rows != table.num_embeddings:
            raise ValueError(
                f"{self.segment.rows} block rows for a vocabulary of {table.num_embeddings}"
            )
        # [0, hidden]: keeps the dtype and device for whoever asks, holds nothing
        table.weight = nn.Parameter(
            table.weight.new_empty(0, table.embedding_dim), requires_grad=False
        )

    def apply(self, table: Table, ids: torch.Tensor) -> torch.Tensor:
        return self.segment.lookup(ids, table.embedding_dim, table.weight.dtype)
