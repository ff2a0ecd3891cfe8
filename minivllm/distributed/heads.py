"""Which attention heads each tensor-parallel rank holds.

Each rank holds a contiguous run of query heads and exactly the KV heads they read:

- `num_kv_heads >= tp_size`: the KV heads are split, as evenly as possible, each with its
  whole group of query heads (SmolLM2-135M's 3 KV heads over 2 ranks: 1 and 2).
- `num_kv_heads < tp_size`: the ranks are dealt out to the KV heads in contiguous runs, as
  evenly as possible; each rank of a run holds that one KV head (replicated) and a share of
  its query heads, the shares differing by at most one head. 5 heads / 1 KV head over 2 ranks:
  3 + 2 query heads, both ranks holding the KV head; Qwen2.5-0.5B's 14 heads / 2 KV heads over
  4 ranks: 4 + 3 query heads per KV head. Any layout works up to one query head per rank.
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
    if tp_size > num_heads:
        raise ValueError(
            f"cannot split {num_heads} attention heads over tensor_parallel_size={tp_size}: "
            "every rank needs at least one query head"
        )
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= tp_size:
        kv_start = tp_rank * num_kv_heads // tp_size
        kv_end = (tp_rank + 1) * num_kv_heads // tp_size
        return HeadShard(kv_start * group, (kv_end - kv_start) * group, kv_start, kv_end - kv_start)
    kv_head = tp_rank * num_kv_heads // tp_size
    replicas = [r for r in range(tp_size) if r * num_kv_heads // tp_size == kv_head]
    # A KV head has at most ceil(tp_size / num_kv_heads) <= group replicas (tp_size <= heads).
    index, count = replicas.index(tp_rank), len(replicas)
    start, end = index * group // count, (index + 1) * group // count
    return HeadShard(kv_head * group + start, end - start, kv_head, 1)
