"""Which attention heads each tensor-parallel rank holds.

Query heads are split in whole KV groups (the query heads that share one KV head), so each
rank's heads keep the uniform grouping grouped-query attention needs, and each rank keeps
exactly the KV heads its query heads read:

- `num_kv_heads >= tp_size`: the KV heads are split, as evenly as possible (SmolLM2-135M's
  3 KV heads over 2 ranks: 1 and 2), with their query heads.
- `num_kv_heads < tp_size`: every KV head is replicated on `tp_size / num_kv_heads` ranks;
  each rank holds `num_heads / tp_size` query heads, all inside one KV group. This needs
  `tp_size` to be a multiple of `num_kv_heads` and `num_heads` a multiple of `tp_size`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadShard:
    """One rank's contiguous run of query heads and of the KV heads they read."""

    q_start: int  # first query head of this rank
    num_heads: int  # query heads on this rank
    kv_start: int  # first KV head of this rank
    num_kv_heads: int  # KV heads on this rank (its KV cache width)


def shard_heads(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadShard:
    """The heads of rank `tp_rank` of `tp_size`; ValueError when the heads cannot be split."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads "
            f"({num_kv_heads})"
        )
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is outside 0..{tp_size - 1}")
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= tp_size:
        kv_start = tp_rank * num_kv_heads // tp_size
        kv_end = (tp_rank + 1) * num_kv_heads // tp_size
        return HeadShard(kv_start * group, (kv_end - kv_start) * group, kv_start, kv_end - kv_start)
    if tp_size % num_kv_heads or num_heads % tp_size:
        raise ValueError(
            f"cannot split {num_heads} attention heads ({num_kv_heads} KV heads) over "
            f"tensor_parallel_size={tp_size}: with fewer KV heads than ranks, tp_size must be a "
            f"multiple of the KV heads and the attention heads a multiple of tp_size"
        )
    per_rank = num_heads // tp_size
    q_start = tp_rank * per_rank
    return HeadShard(q_start, per_rank, q_start // group, 1)
