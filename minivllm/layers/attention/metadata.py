"""Per-step attention inputs (`AttentionMetadata`) and the index tensors derived from them.

Each layer's cache is a pair `(k_cache, v_cache)`, each `[num_blocks, block_size, num_kv_heads,
head_dim]`. Token `p` of a sequence lives at slot `block_table[p // block_size] * block_size +
p % block_size`.
"""

import itertools
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F

from minivllm.layers.attention.partition import partition_batch
from minivllm.paging import blocks_for


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built by ModelRunner and passed explicitly to the model.

    The runner fills the fields; the cached properties below are derived lazily, once per
    step, on the fields' device, and shared by every layer.
    """

    # [num_tokens] int64: KV slot of each new token (block * block_size + offset)
    slot_mapping: torch.Tensor
    # [num_seqs + 1] int64: cumulative query lengths (tokens of this step)
    query_start_loc: torch.Tensor
    # [num_seqs] int64: tokens in the KV cache after this step (cached + new)
    seq_lens: torch.Tensor
    # [num_seqs, max_blocks] int64, padded with 0
    block_tables: torch.Tensor
    # python mirrors, to size things without device syncs
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    # Per-step scratch for gathered K/V, keyed by (KVH, D, dtype, device); see kv_gather_buffers.
    _scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, init=False, repr=False
    )
    # Per-step sliding-window gather indices and masks, keyed by window; see kv_view.
    _window_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, init=False, repr=False
    )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @cached_property
    def num_tokens(self) -> int:
        return sum(self.query_lens_cpu)

    @cached_property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu)

    @cached_property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu)

    @cached_property
    def is_decode_only(self) -> bool:
        """Every sequence brings exactly one new token."""
        return self.max_query_len == 1

    @cached_property
    def query_lens(self) -> torch.Tensor:
        """`[num_seqs]` int64 new tokens per sequence, on the metadata's device."""
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @cached_property
    def kv_gather_index(self) -> torch.Tensor:
        """`[num_seqs, max_seq_len]` cache slot of every (sequence, position) pair."""
        return paged_kv_gather_index(
            self.block_tables, self.seq_lens, self.max_seq_len, self.block_size
        )

    @cached_property
    def attn_mask(self) -> torch.Tensor:
        """`[num_seqs, 1, max_query_len, max_seq_len]` bool, True where a query sees a key."""
        return paged_causal_mask(
            self.query_lens, self.seq_lens, self.max_query_len, self.max_seq_len
        )

    def kv_view(self, sliding_window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """What a layer gathers and how it masks it: `(index [num_seqs, kv_len], mask
        [num_seqs, 1, max_query_len, kv_len])`, built once per step and window.

        Without a window (or one no query outgrows) it is `(kv_gather_index, attn_mask)`. With
        one, each sequence's gather starts `sliding_window - 1` keys before its first query,
        so `kv_len` is at most `sliding_window - 1 + max_query_len`, however long the sequence:
        the keys every window has left behind are neither gathered nor scored.
        """
        if sliding_window is None or sliding_window >= self.max_seq_len:
            return self.kv_gather_index, self.attn_mask
        if sliding_window not in self._window_views:
            if sliding_window - 1 + self.max_query_len >= self.max_seq_len:
                view = (
                    self.kv_gather_index,
                    paged_causal_mask(
                        self.query_lens,
                        self.seq_lens,
                        self.max_query_len,
                        self.max_seq_len,
                        sliding_window,
                    ),
                )
            else:
                view = windowed_kv_view(
                    self.block_tables,
                    self.query_lens,
                    self.seq_lens,
                    self.max_query_len,
                    sliding_window,
                    self.block_size,
                )
            self._window_views[sliding_window] = view
        return self._window_views[sliding_window]

    @cached_property
    def query_pad_index(self) -> torch.Tensor:
        """`[num_tokens]` row of each token in the padded `[num_seqs * max_query_len]` queries."""
        return query_pad_index(
            self.query_start_loc, self.query_lens, self.num_tokens, self.max_query_len
        )

    @cached_property
    def is_single_prefill_without_context(self) -> bool:
        """One sequence whose cache holds nothing but this step's tokens."""
        return self.num_seqs == 1 and self.seq_lens_cpu[0] == self.query_lens_cpu[0]

    def kv_gather_buffers(
        self, k_cache: torch.Tensor, kv_len: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Two `[num_seqs * kv_len, KVH, D]` tensors (`kv_len` defaults to `max_seq_len`) to
        gather K and V into, allocated once per step and reused by every layer: on the CPU a
        fresh allocation this large per layer costs more in page faults than the gather."""
        num_kv_heads, head_dim = k_cache.shape[-2:]
        kv_len = self.max_seq_len if kv_len is None else kv_len
        key = (num_kv_heads, head_dim, k_cache.dtype, k_cache.device, kv_len)
        if key not in self._scratch:
            shape = (self.num_seqs * kv_len, num_kv_heads, head_dim)
            self._scratch[key] = (k_cache.new_empty(shape), k_cache.new_empty(shape))
        return self._scratch[key]

    @cached_property
    def query_starts_cpu(self) -> list[int]:
        """Python mirror of `query_start_loc`."""
        return list(itertools.accumulate(self.query_lens_cpu, initial=0))

    @cached_property
    def groups(self) -> list[tuple[torch.Tensor, "AttentionMetadata"]]:
        """The batch split by `partition_batch`: `(token_index, metadata)` per group, where
        `token_index` `[group_tokens]` int64 picks the group's rows of the step's tokens. One
        group is the whole batch (an empty index: nothing to pick)."""
        parts = partition_batch(self.query_lens_cpu, self.seq_lens_cpu)
        if len(parts) == 1:
            return [(self.slot_mapping[:0], self)]
        return [self._subset(seqs) for seqs in parts]

    def _subset(self, seqs: list[int]) -> tuple[torch.Tensor, "AttentionMetadata"]:
        device = self.query_start_loc.device
        starts = self.query_starts_cpu
        tokens = [t for i in seqs for t in range(starts[i], starts[i + 1])]
        query_lens = [self.query_lens_cpu[i] for i in seqs]
        seq_lens = [self.seq_lens_cpu[i] for i in seqs]
        rows = torch.tensor(seqs, dtype=torch.int64, device=device)
        token_index = torch.tensor(tokens, dtype=torch.int64, device=device)
        max_blocks = blocks_for(max(seq_lens), self.block_size)
        sub = AttentionMetadata(
            slot_mapping=self.slot_mapping.index_select(0, token_index),
            query_start_loc=torch.tensor(
                list(itertools.accumulate(query_lens, initial=0)), dtype=torch.int64, device=device
            ),
            seq_lens=self.seq_lens.index_select(0, rows),
            block_tables=self.block_tables.index_select(0, rows)[:, :max_blocks],
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            block_size=self.block_size,
        )
        return token_index, sub

    @cached_property
    def cu_seqlens_q_i32(self) -> torch.Tensor:
        """`[num_seqs + 1]` int32 cumulative query lengths (flash-attn)."""
        return self.query_start_loc.to(torch.int32)

    @cached_property
    def cu_seqlens_k_i32(self) -> torch.Tensor:
        """`[num_seqs + 1]` int32 cumulative KV lengths (flash-attn)."""
        return F.pad(self.seq_lens.cumsum(0), (1, 0)).to(torch.int32)

    @cached_property
    def block_tables_i32(self) -> torch.Tensor:
        """`[num_seqs, max_blocks]` int32 block tables (flash-attn)."""
        return self.block_tables.to(torch.int32)


def paged_kv_gather_index(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, block_size: int
) -> torch.Tensor:
    """Slot of position `j` of sequence `s`: `block_tables[s, j // bs] * bs + j % bs`.

    Returns `[num_seqs, max_seq_len]` int64. Positions past a sequence's length (padding, masked
    out later) are clamped to its last token, so only written slots are ever read: masked-out
    garbage (e.g. NaN in never-written memory) would otherwise leak through `0 * NaN`.
    """
    pos = torch.arange(max_seq_len, device=block_tables.device)[None, :]  # [1, max_seq_len]
    pos = torch.minimum(pos, seq_lens[:, None] - 1)  # [num_seqs, max_seq_len]
    blocks = block_tables.gather(1, pos // block_size)  # [num_seqs, max_seq_len]
    return blocks * block_size + pos % block_size


def paged_causal_mask(
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Boolean mask `[num_seqs, 1, max_query_len, max_seq_len]`: query `i` of sequence `s` sits at
    position `p = seq_lens[s] - query_lens[s] + i` and sees keys `0..p`, or with a sliding
    window only keys `p - sliding_window + 1 .. p` (HF's `kv_idx > q_idx - sliding_window`).

    Padded query rows (`i >= query_lens[s]`) see at least key 0, so no row is fully masked.
    """
    device = seq_lens.device
    context_lens = (seq_lens - query_lens)[:, None, None]  # [num_seqs, 1, 1]
    rows = torch.arange(max_query_len, device=device)[None, :, None]  # [1, max_query_len, 1]
    q_pos = context_lens + rows  # [num_seqs, max_query_len, 1]
    k_pos = torch.arange(max_seq_len, device=device)[None, None, :]  # [1, 1, max_seq_len]
    mask = k_pos <= q_pos  # [num_seqs, max_query_len, max_seq_len]
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
        # A padded row's position can lie past every key its window would reach.
        mask |= (rows >= query_lens[:, None, None]) & (k_pos == 0)
    return mask.unsqueeze(1)  # [num_seqs, 1, max_query_len, max_seq_len]


def windowed_kv_view(
    block_tables: torch.Tensor,
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    sliding_window: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather index `[num_seqs, kv_len]` and mask `[num_seqs, 1, max_query_len, kv_len]` of a
    sliding-window layer, `kv_len = sliding_window - 1 + max_query_len`: key `j` of sequence
    `s` is position `start[s] + j`, `start[s]` the first position its first query can see.

    Positions past the sequence are clamped to its last token (only written slots are read)
    and masked by causality; padded query rows see key 0, so no row is fully masked.
    """
    device = seq_lens.device
    kv_len = sliding_window - 1 + max_query_len
    context_lens = seq_lens - query_lens  # [num_seqs]
    starts = (context_lens - (sliding_window - 1)).clamp(min=0)  # [num_seqs]
    keys = torch.arange(kv_len, device=device)[None, :]  # [1, kv_len]
    k_pos = starts[:, None] + keys  # [num_seqs, kv_len]
    clamped = torch.minimum(k_pos, seq_lens[:, None] - 1)
    blocks = block_tables.gather(1, clamped // block_size)  # [num_seqs, kv_len]
    index = blocks * block_size + clamped % block_size
    rows = torch.arange(max_query_len, device=device)[None, :, None]  # [1, max_query_len, 1]
    q_pos = context_lens[:, None, None] + rows  # [num_seqs, max_query_len, 1]
    k_pos = k_pos[:, None, :]  # [num_seqs, 1, kv_len]
    mask = (k_pos <= q_pos) & (k_pos > q_pos - sliding_window)
    mask |= (rows >= query_lens[:, None, None]) & (keys[:, None, :] == 0)
    return index, mask.unsqueeze(1)  # [S, kv_len], [S, 1, max_query_len, kv_len]


def query_pad_index(
    query_start_loc: torch.Tensor, query_lens: torch.Tensor, num_tokens: int, max_query_len: int
) -> torch.Tensor:
    """Row of token `t` (the `i`-th new token of sequence `s`) in `[num_seqs * max_query_len]`:
    `s * max_query_len + i`. Returns `[num_tokens]` int64."""
    device = query_start_loc.device
    num_seqs = query_lens.shape[0]
    seq_of_token = torch.repeat_interleave(
        torch.arange(num_seqs, device=device), query_lens, output_size=num_tokens
    )  # [num_tokens]
    token = torch.arange(num_tokens, device=device)
    return token - query_start_loc[seq_of_token] + seq_of_token * max_query_len
