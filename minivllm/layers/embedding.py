"""Token embedding and LM head, vocab-parallel.

Both hold a `[vocab_size / tp_size, hidden_size]` weight: rank r owns token ids
`[r * vocab_size / tp_size, (r + 1) * vocab_size / tp_size)`. The embedding looks up the ids
it owns, zeroes the rows of the others, and sums over the ranks (each id is owned once); the
LM head computes its vocab slice of the logits and gathers the full logits on rank 0. How each
reads its weight is its method, chosen at load (`minivllm.layers.quantization.chooser`): the
embedding's a `LookupMethod`, the head's a `HeadMethod`.
"""

import torch
from torch import nn

from minivllm.layers.quantization.head import DenseHead, HeadMethod
from minivllm.layers.quantization.lookup import DenseLookup, LookupMethod


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
        self.lookup: LookupMethod = DenseLookup()

    def set_lookup(self, method: LookupMethod) -> None:
        """Read the table with `method` from now on (its `create_weights` runs here)."""
        method.create_weights(self)
        self.lookup = method

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
        return self.lookup.apply(self, input_ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp_size={self.tp_size}"


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection `hidden -> logits`; may share its weight with the token embedding."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, tp_size: int = 1, tp_rank: int = 0
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, tp_size, tp_rank)
        self.method: HeadMethod = DenseHead()

    def set_method(self, method: HeadMethod) -> None:
        """Compute the logits with `method` from now on (its `create_weights` runs here; its
        `process_weights_after_loading` once the checkpoint is loaded)."""
        method.create_weights(self)
        self.method = method

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (tie_word_embeddings): one tensor, loaded once."""
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[num_tokens, hidden_size]` -> `[num_tokens, vocab_size]` float32 logits (with
        tp_size > 1, on rank 0; the other ranks get their own vocab slice)."""
        return self.method.apply(self, hidden)
