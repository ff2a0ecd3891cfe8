"""Paged attention over a block-structured KV cache, for batches mixing prefills and decodes.

Each layer's cache is a pair `(k_cache, v_cache)`, each `[num_blocks, block_size, num_kv_heads,
head_dim]`. Token `p` of a sequence lives at slot `block_table[p // block_size] * block_size +
p % block_size`. A step writes its new K/V at `slot_mapping`, then every query token attends,
causally, to its own sequence's cached-plus-new tokens.

Two implementations of the attention itself:
- `paged_attention_sdpa` (any device): gather each sequence's K/V through its block table into
  `[num_seqs, max_seq_len, ...]`, pad the queries to `[num_seqs, max_query_len, ...]`, and make one
  `scaled_dot_product_attention` call with a boolean causal mask. All-decode batches skip the
  query padding; a lone prefill with no cached context attends over its own new K/V directly.
  Padding costs work in proportion to `num_seqs * max_query_len * max_seq_len`, so a batch is
  first split into a few groups of like sequences (`partition_batch`: decodes apart from
  prefills, then runs of similar lengths), one gather and one SDPA call per group. Without
  it, one 256-token prefill chunk padded 15 decodes to 256 queries each (10.7x the attention
  time of the split batch on this project's CPU, `benchmarks/attention_groups.py`).
- `paged_attention_flash` (CUDA, fp16/bf16, block_size a multiple of 256): flash-attn's varlen
  kernel reading the paged cache through the block table directly.
"""

import itertools
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

try:
    from flash_attn import flash_attn_varlen_func
except ImportError:  # CPU-only installs, or no flash-attn wheel for this GPU
    flash_attn_varlen_func = None

# flash-attn's paged-KV path requires the page (block) size to be a multiple of this.
FLASH_ATTN_BLOCK_MULTIPLE = 256


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

    def kv_gather_buffers(self, k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two `[num_seqs * max_seq_len, KVH, D]` tensors to gather K and V into, allocated
        once per step and reused by every layer: on the CPU a fresh allocation this large per
        layer costs more in page faults than the gather itself."""
        num_kv_heads, head_dim = k_cache.shape[-2:]
        key = (num_kv_heads, head_dim, k_cache.dtype, k_cache.device)
        if key not in self._scratch:
            shape = (self.num_seqs * self.max_seq_len, num_kv_heads, head_dim)
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
        max_blocks = -(-max(seq_lens) // self.block_size)
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


# Fixed cost of one more group, in units of padded work (one query against one key): the
# extra gather, mask, index copies and SDPA call. Tuned with `benchmarks/attention_groups.py`
# (SmolLM2 shapes, 30 layers, this project's 2-core CPU): at 512 the split batch is never
# slower than one group and is 1.3x faster for 16 decodes with contexts of 64-512 tokens,
# 1.5x for 64 such decodes, 1.6x for 16 prefills of 32-256 tokens.
GROUP_OVERHEAD = 512
MAX_GROUPS = 8


def partition_batch(
    query_lens: list[int], seq_lens: list[int], overhead: int = GROUP_OVERHEAD
) -> list[list[int]]:
    """Split a batch's sequences into groups that each pad little: decodes (one query) apart
    from prefill chunks, then, in order of length, split wherever the padded work saved
    (`n * max_query_len * max_seq_len` per group) exceeds `overhead`, at most MAX_GROUPS
    groups. Returns the sequence indices of each group (every index once)."""

    def cost(run: list[int]) -> int:
        return len(run) * max(query_lens[i] for i in run) * max(seq_lens[i] for i in run)

    def split(run: list[int]) -> list[list[int]]:
        best, best_at = cost(run) - overhead, 0
        q_suffix = [0] * (len(run) + 1)
        for j in range(len(run) - 1, -1, -1):
            q_suffix[j] = max(q_suffix[j + 1], query_lens[run[j]])
        q_prefix = 0
        for j in range(1, len(run)):
            q_prefix = max(q_prefix, query_lens[run[j - 1]])
            left = j * q_prefix * seq_lens[run[j - 1]]  # runs are sorted by seq_len
            right = (len(run) - j) * q_suffix[j] * seq_lens[run[-1]]
            if left + right < best:
                best, best_at = left + right, j
        if best_at == 0:
            return [run]
        return [run[:best_at], run[best_at:]]

    decodes = [i for i, q in enumerate(query_lens) if q == 1]
    prefills = [i for i, q in enumerate(query_lens) if q != 1]
    groups = [
        sorted(run, key=lambda i: (seq_lens[i], query_lens[i]))
        for run in (decodes, prefills)
        if run
    ]
    while len(groups) < MAX_GROUPS:
        gains = [(cost(g) - sum(cost(p) for p in split(g)), n) for n, g in enumerate(groups)]
        gain, n = max(gains)
        if gain <= overhead:
            break
        groups[n : n + 1] = split(groups[n])
    return groups


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
    query_lens: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int, max_seq_len: int
) -> torch.Tensor:
    """Boolean mask `[num_seqs, 1, max_query_len, max_seq_len]`: query `i` of sequence `s` sits at
    position `seq_lens[s] - query_lens[s] + i` and sees keys `0..that position`.

    Padded query rows (`i >= query_lens[s]`) see at least key 0, so no row is fully masked.
    """
    device = seq_lens.device
    context_lens = (seq_lens - query_lens)[:, None, None]  # [num_seqs, 1, 1]
    q_pos = context_lens + torch.arange(max_query_len, device=device)[None, :, None]
    k_pos = torch.arange(max_seq_len, device=device)[None, None, :]  # [1, 1, max_seq_len]
    return (k_pos <= q_pos).unsqueeze(1)  # [num_seqs, 1, max_query_len, max_seq_len]


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


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new keys/values `[num_tokens, num_kv_heads, head_dim]` into their cache slots."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)  # [slots, KVH, D]
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)  # [slots, KVH, D]


def paged_attention_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of `q` `[num_tokens, num_heads, head_dim]` over the paged cache (which already
    holds this step's K/V). Returns `[num_tokens, num_heads, head_dim]`."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[-2]
    num_seqs, max_q, max_kv = meta.num_seqs, meta.max_query_len, meta.max_seq_len
    gather = meta.kv_gather_index.view(-1)  # [S * max_kv]
    k_buf, v_buf = meta.kv_gather_buffers(k_cache)
    k = torch.index_select(k_cache.view(-1, num_kv_heads, head_dim), 0, gather, out=k_buf)
    v = torch.index_select(v_cache.view(-1, num_kv_heads, head_dim), 0, gather, out=v_buf)
    k = k.view(num_seqs, max_kv, num_kv_heads, head_dim)  # [S, max_kv, KVH, D]
    v = v.view(num_seqs, max_kv, num_kv_heads, head_dim)  # [S, max_kv, KVH, D]

    if meta.is_decode_only:
        # One query per sequence: fold each KV head's group of query heads into the query
        # dim, so SDPA reads every K/V once instead of expanding them for GQA (same mask row).
        group = num_heads // num_kv_heads
        q_folded = q.view(num_seqs, num_kv_heads, group, head_dim)  # [S, KVH, G, D]
        out = F.scaled_dot_product_attention(
            q_folded,
            k.transpose(1, 2),  # [S, KVH, max_kv, D]
            v.transpose(1, 2),  # [S, KVH, max_kv, D]
            attn_mask=meta.attn_mask,  # [S, 1, 1, max_kv]
            scale=scale,
        )  # [S, KVH, G, D]
        return out.reshape(num_tokens, num_heads, head_dim)  # [T, H, D]

    q_padded = q.new_zeros(num_seqs * max_q, num_heads, head_dim)
    q_padded.index_copy_(0, meta.query_pad_index, q)  # [S * max_q, H, D]
    q_padded = q_padded.view(num_seqs, max_q, num_heads, head_dim)  # [S, max_q, H, D]

    out = F.scaled_dot_product_attention(
        q_padded.transpose(1, 2),  # [S, H, max_q, D]
        k.transpose(1, 2),  # [S, KVH, max_kv, D]
        v.transpose(1, 2),  # [S, KVH, max_kv, D]
        attn_mask=meta.attn_mask,  # [S, 1, max_q, max_kv]
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )  # [S, H, max_q, D]
    out = out.transpose(1, 2)  # [S, max_q, H, D]
    out = out.reshape(num_seqs * max_q, num_heads, head_dim)  # [S * max_q, H, D]
    return out.index_select(0, meta.query_pad_index)  # [T, H, D]


def causal_attention_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Plain causal attention of one sequence's tokens among themselves (no cached context).

    `q` `[T, H, D]`, `k`/`v` `[T, KVH, D]` -> `[T, H, D]`; no gather, no mask tensor.
    """
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),  # [H, T, D]
        k.transpose(0, 1),  # [KVH, T, D]
        v.transpose(0, 1),  # [KVH, T, D]
        is_causal=True,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )  # [H, T, D]
    return out.transpose(0, 1)  # [T, H, D]


def paged_attention_flash(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """flash-attn varlen attention reading the paged cache through the block tables.

    `q` `[num_tokens, num_heads, head_dim]` -> `[num_tokens, num_heads, head_dim]`. flash-attn's
    `causal=True` aligns the mask bottom-right, i.e. the last query sees the last key.
    """
    return flash_attn_varlen_func(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q=meta.cu_seqlens_q_i32,
        cu_seqlens_k=meta.cu_seqlens_k_i32,
        max_seqlen_q=meta.max_query_len,
        max_seqlen_k=meta.max_seq_len,
        softmax_scale=scale,
        causal=True,
        block_table=meta.block_tables_i32,
    )


def can_use_flash_attn(q: torch.Tensor, block_size: int) -> bool:
    """Whether `paged_attention_flash` supports this device, dtype and block size."""
    return (
        flash_attn_varlen_func is not None
        and q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and block_size % FLASH_ATTN_BLOCK_MULTIPLE == 0
    )


class Attention(nn.Module):
    """Multi-head (or grouped-query) attention over a paged KV cache; no parameters.

    `forward(q [T, H*D], k [T, KVH*D], v [T, KVH*D], (k_cache, v_cache), meta) -> [T, H*D]`
    stores the step's K/V in the cache, then attends (see the module docstring).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        k_cache, v_cache = kv_cache
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if can_use_flash_attn(q, meta.block_size):
            out = paged_attention_flash(q, k_cache, v_cache, meta, self.scale)
            return out.reshape(num_tokens, self.num_heads * self.head_dim)  # [T, H*D]
        groups = meta.groups
        if len(groups) == 1:
            out = self._attend_sdpa(q, k, v, kv_cache, meta)
        else:
            out = torch.empty_like(q)  # [T, H, D]
            for tokens, sub in groups:
                part = self._attend_sdpa(
                    q.index_select(0, tokens), k.index_select(0, tokens),
                    v.index_select(0, tokens), kv_cache, sub,
                )
                out.index_copy_(0, tokens, part)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)  # [T, H*D]

    def _attend_sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """One group's attention, `[T, H, D]`: without the cache for a lone prefill that has no
        context, else through the paged cache."""
        if meta.is_single_prefill_without_context:
            return causal_attention_sdpa(q, k, v, self.scale)
        return paged_attention_sdpa(q, kv_cache[0], kv_cache[1], meta, self.scale)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
