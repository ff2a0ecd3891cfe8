"""The KV-cache pool: fixed-size blocks, reference counts, a free list, prefix caching.

A sequence's `block_table[i]` is the physical block that holds its tokens
`i * block_size .. (i + 1) * block_size - 1`; the ModelRunner turns that into slots:
`slot = block_table[pos // block_size] * block_size + pos % block_size`.

Prefix caching: once a full block's KV is committed, the block gets a chained hash
(xxhash of the parent block's hash and the block's token ids). A new sequence whose prompt
starts with the same tokens reuses those blocks (ref_count > 1) instead of recomputing them.
A freed hashed block stays reusable until it is evicted, least recently freed first.

Pure Python: no torch here.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import xxhash

from minivllm.engine.sequence import Sequence
from minivllm.paging import blocks_for

HashFn = Callable[[int | None, tuple[int, ...]], int]


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block: depends on every token before it, through the parent."""
    h = xxhash.xxh3_64()
    h.update(b"root" if parent_hash is None else parent_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and its KV is committed
    parent_hash: int | None = None  # the hash it was chained from (verified on a hit)
    token_ids: tuple[int, ...] = ()  # the tokens it holds, kept to verify a hit

    def reset(self) -> None:
        self.hash = None
        self.parent_hash = None
        self.token_ids = ()


class BlockManager:
    """Owns every KV block; hands them to sequences and takes them back."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn = hash_block,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the first one is taken next. Unhashed blocks go to
        # the front (nothing to lose), hashed ones to the back (least recently freed first).
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[int, int] = {}  # hash -> block_id
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by some sequence (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    # ---- prefix cache -------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest committed prefix of `seq` found in the cache.

        Never the whole sequence: its last token must still be computed, since the model
        needs a query to produce the next token's logits.
        """
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return []  # prompt logprobs need the logits of every prompt position
        bs = self.block_size
        hits: list[int] = []
        parent = self._root(seq)
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = self.hash_fn(parent, tokens)
            block_id = self.cached_blocks.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            # A hash collision must never hand out another prefix's KV.
            if block.token_ids != tokens or block.parent_hash != parent:
                break
            hits.append(block_id)
            parent = h
        return hits

    def _root(self, seq: Sequence) -> int | None:
        """The first block's parent: None for the base model, the adapter's own value under
        a LoRA adapter, so a block hashed under one adapter never matches another (-1 is no
        token id: no real block hashes the same)."""
        return self.hash_fn(None, (-1, seq.lora_int_id)) if seq.lora_int_id else None

    def take_prefix(self, seq: Sequence, hits: Seq[int]) -> None:
        """Give `seq` the cached blocks `hits`; their tokens count as cached from now on."""
        assert not seq.block_table, "prefix blocks are taken only at admission"
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
        seq.block_table.extend(hits)
        seq.num_cached_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += seq.num_cached_tokens

    # ---- allocation -------------------------------------------------------------------

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Fresh blocks `seq` needs so its table covers cached + `num_new_tokens` tokens."""
        total = blocks_for(seq.num_cached_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hits: Seq[int] = ()) -> bool:
        """Whether the plan fits. At admission, `hits` are the prefix blocks `seq` takes first:
        they count as cached, and those sitting in the free list are no longer free."""
        if hits:
            cached, held = len(hits) * self.block_size, len(hits)
        else:
            cached, held = seq.num_cached_tokens, len(seq.block_table)
        fresh = max(0, blocks_for(cached + num_new_tokens, self.block_size) - held)
        reclaimed = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return fresh <= self.num_free_blocks - reclaimed

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend `seq`'s block table to cover its cached tokens plus `num_new_tokens`."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {needed}, {self.num_free_blocks} free")
        new_blocks = [self._take_free_block() for _ in range(needed)]
        seq.block_table.extend(new_blocks)

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.cached_blocks.get(block.hash) == block_id:
            del self.cached_blocks[block.hash]  # evicted: its old content is gone
        block.reset()
        block.ref_count = 1
        return block_id

    def free(self, seq: Sequence) -> None:
        """Release every block `seq` holds; hashed ones stay findable until evicted."""
        # Free the tail first so that, among a sequence's blocks, later ones are evicted first.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
                if block.hash is None:
                    self.free_blocks.move_to_end(block_id, last=False)
        seq.block_table.clear()

    # ---- commit ---------------------------------------------------------------------------

    def commit(self, seq: Sequence, num_cached_before: int) -> None:
        """Hash the blocks that became full and committed since `num_cached_before`."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(num_cached_before // bs, seq.num_cached_tokens // bs):
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:
                continue
            parent = self.blocks[seq.block_table[i - 1]].hash if i > 0 else self._root(seq)
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            block.hash = self.hash_fn(parent, tokens)
            block.parent_hash = parent
            block.token_ids = tokens
            # The same content may already be cached in another block (two sequences with one
            # prompt in one step): keep the first, this one still chains its children.
            self.cached_blocks.setdefault(block.hash, block.block_id)

    # ---- checks ---------------------------------------------------------------------------

    def check_consistency(self, tables: list[list[int]]) -> None:
        """Raise AssertionError unless each block's ref_count equals the tables holding it."""
        holders = [0] * self.num_blocks
        for table in tables:
            for block_id in table:
                holders[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == holders[block.block_id], (block, holders[block.block_id])
            assert (block.ref_count == 0) == (block.block_id in self.free_blocks), block
        for h, block_id in self.cached_blocks.items():
            assert self.blocks[block_id].hash == h, (h, self.blocks[block_id])
