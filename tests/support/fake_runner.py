"""A deterministic stand-in for the model, for engine-core tests without torch.

It guards the paging logic: `run` writes each scheduled token id into a fake KV cache at the
slot the block table gives, then "samples" the next token from the context it reads back
through the block table. A wrong block table, slot, or prefix-cache hit changes the output,
and a context slot never written (scheduled but not computed) fails loudly. With speculative
decoding it verifies a plan's draft tokens as the real runner does, greedily, so a commit that
kept a rejected draft's KV reads a stale slot and fails too. Faults are
injected the one way every test uses: wrap it in `support.faults.FaultyRunner`.
"""

from __future__ import annotations

from array import array

import xxhash

from minivllm.engine.runner_output import RunnerOutput, SampledToken
from minivllm.engine.scheduler import ScheduledBatch


def next_token(context: list[int], vocab_size: int, order: int | None = None) -> int:
    """The fake model: the next token is a hash of the whole context, or with `order` of its
    last `order` tokens only (a model that soon repeats itself, so n-gram drafts hit)."""
    tail = context if order is None else context[-order:]
    return xxhash.xxh64_intdigest(array("q", tail).tobytes()) % vocab_size


class FakeModelRunner:
    def __init__(
        self,
        num_kv_blocks: int,
        block_size: int,
        vocab_size: int = 1000,
        order: int | None = None,
    ) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.order = order
        self.kv: list[int | None] = [None] * (num_kv_blocks * block_size)

    def slot(self, block_table: list[int], pos: int) -> int:
        return block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def run(self, batch: ScheduledBatch, token_bitmask: object = None) -> RunnerOutput:
        for seq in batch.seqs:
            assert seq.num_scheduled_tokens > 0, "zero-length query scheduled"
            start = seq.num_cached_tokens
            tokens = seq.planned_token_ids
            for pos in range(start, start + seq.num_scheduled_tokens):
                self.kv[self.slot(seq.block_table, pos)] = tokens[pos]
        samples = []
        for seq in batch.sample_seqs:
            n = seq.num_cached_tokens + seq.num_scheduled_tokens
            context = [self.kv[self.slot(seq.block_table, p)] for p in range(n)]
            assert context == seq.planned_token_ids, f"KV cache disagrees with tokens of {seq}"
            drafts = seq.spec_token_ids
            targets = [  # the target's token after the last token and after each draft
                next_token(context[: seq.num_tokens + j], self.vocab_size, self.order)
                for j in range(len(drafts) + 1)
            ]
            # Greedy verification (the rejection sampler's rule, kept here so the engine's
            # tests stay torch-free): the longest prefix of drafts equal to the targets.
            accepted = next((j for j, d in enumerate(drafts) if d != targets[j]), len(drafts))
            samples.append(SampledToken(targets[accepted], num_accepted=accepted))
        return RunnerOutput(samples)


def reference_completion(
    prompt: list[int], max_tokens: int, vocab_size: int = 1000, order: int | None = None
) -> list[int]:
    """What the fake model generates for `prompt`, computed without any engine."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens, vocab_size, order))
    return tokens[len(prompt) :]
