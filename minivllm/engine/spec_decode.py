"""Speculative decoding's engine-side half: the proposer seam, the n-gram (prompt lookup)
proposer and the greedy acceptance rule. (The draft-model proposer, which runs a model, lives
in `draft_model.py`.)

Each step the Scheduler asks the proposer, in one call, for up to k draft tokens per decoding
sequence and
plans 1 + k tokens for it (its last token and the drafts), so the ModelRunner runs all of them
through the target model in one step and writes k + 1 KV slots. The runner returns the target's
tokens; the commit (`Scheduler.postprocess`) appends the accepted drafts plus the target's own
next token and advances `num_cached_tokens` by accepted + 1: the KV of rejected drafts stays in
its slots, uncommitted, and is overwritten by a later step. Scheduled is not cached, even after
execute.

Pure Python and numpy: no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from minivllm.config import SpeculativeConfig
from minivllm.engine.sequence import Sequence


class Proposer(Protocol):
    """What the Scheduler asks of a proposer: `NgramProposer` here, `DraftModelProposer` in
    `draft_model.py` (built by the engine, so the Scheduler imports no torch)."""

    def propose_batch(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Drafts for each (decoding sequence, most drafts it has room for), in order; [] for a
        sequence that does not speculate this step. Reads the sequences, writes none."""
        ...

    def release(self, seq_id: int) -> None:
        """The sequence finished, was aborted or preempted: drop what is kept for it."""
        ...

    def stats(self) -> dict[str, float]:
        """The proposer's own counters for `engine.stats()` (none for a lookup)."""
        ...


class NgramProposer:
    """Prompt lookup: find the sequence's last n tokens earlier in its prompt or output (n from
    `prompt_lookup_max` down to `prompt_lookup_min`, the most recent occurrence) and propose
    the tokens that followed them there."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to `min(num_speculative_tokens, max_tokens)` draft tokens to follow `token_ids`;
        [] when no n-gram matches."""
        k = min(self.num_speculative_tokens, max_tokens)
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        return propose_ngram(np.asarray(token_ids, dtype=np.int64), self.min_n, self.max_n, k)

    def propose_batch(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        """`propose` for each sequence: a lookup has nothing to batch."""
        return [self.propose(seq.token_ids, max_tokens) for seq, max_tokens in requests]

    def release(self, seq_id: int) -> None:
        """Nothing is kept per sequence."""

    def stats(self) -> dict[str, float]:
        return {}


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The reference rule on an int array: for n = max_n .. min_n, the latest start i < L - n
    with tokens[i : i + n] == tokens[L - n :] proposes tokens[i + n : i + n + k]."""
    length = tokens.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]  # [n]
        # Windows that start before the suffix itself, so a match has a token after it.
        windows = sliding_window_view(tokens[: length - 1], n)  # [L - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


PER_POSITION_KEY = "spec_decode_num_accepted_tokens_per_pos"


@dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters, kept by the commit: sequence-steps that verified drafts,
    draft tokens, accepted ones, and accepted ones by draft position (position j counts the
    steps whose draft j was accepted, so `accepted_per_pos[0] / num_drafts` is the acceptance
    rate of the first draft)."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One sequence's verified step."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    def as_stats(self) -> dict[str, float]:
        """The counters as `engine.stats()` entries; position j under `PER_POSITION_KEY/j`."""
        stats: dict[str, float] = {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
        }
        for j, count in enumerate(self.accepted_per_pos):
            stats[f"{PER_POSITION_KEY}/{j}"] = count
        return stats


def per_position(stats: dict[str, float]) -> list[float]:
    """The per-position accepted counts of an `engine.stats()` dict, position 0 first."""
    prefix = PER_POSITION_KEY + "/"
    found = {int(k[len(prefix) :]): v for k, v in stats.items() if k.startswith(prefix)}
    return [found[j] for j in sorted(found)]


def mean_acceptance_length(num_drafts: float, num_accepted: float) -> float | None:
    """vLLM's mean acceptance length: tokens a verifying step yields, 1 + accepted / drafts
    (the target's own token counts); None before any draft was verified."""
    return 1 + num_accepted / num_drafts if num_drafts else None
