"""The lab's scenarios: which engine to build and which requests to queue before the learner
takes over. This module holds chapter 03's (a Sequence's fields); `chapters.py` lists them all.

Each scenario is one experiment with its own predict -> run -> explain flow (the words live
in the page). The setup only uses the engine's public calls (`add_request`, `step`), so what
the learner sees afterwards is the real scheduler's doing. Prompt lengths are exact: with a
tokenizer the text is tokenized (and cut to length); without one (the fake runner in the
tests) deterministic token ids of the same length stand in for it.

Pure Python: no torch here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from minivllm.config import SpeculativeConfig
from minivllm.lab.lesson import Lesson


class Driver(Protocol):
    """What a scenario's setup may do (the experiment provides it): the setup knows nothing
    else of the lab, so this module imports none of it."""

    block_size: int

    def prompt(self, text: str, num_tokens: int) -> list[int]: ...

    def add_tokens(self, token_ids: list[int], max_tokens: int) -> Any: ...

    def step(self) -> Any: ...


# The engine options a learner may set on reset: the lab's shared KV pool is this big.
MAX_KV_BLOCKS = 64
MAX_BATCHED_TOKENS = 256
MAX_NUM_SEQS = 16


@dataclass(frozen=True)
class EngineShape:
    """The engine options a scenario needs; everything else comes from the lab's model."""

    num_kv_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int = 16
    speculative_config: SpeculativeConfig | None = None  # chapter 07's engine speculates
    # The draft source the engine gets (default: the one speculative_config names).
    proposer: Callable[[SpeculativeConfig], Any] | None = None

    def make_proposer(self) -> Any:
        """A fresh draft source for one engine, or None for the config's own."""
        if self.proposer is None or self.speculative_config is None:
            return None
        return self.proposer(self.speculative_config)


@dataclass(frozen=True)
class Scenario:
    name: str
    shape: EngineShape
    setup: Callable[[Driver], None]
    focus: int  # index, in order of arrival, of the sequence the page selects first
    chapter: str = "03"
    # Graded on the server (chapters 04-06); chapter 03's page grades its own questions.
    lesson: Lesson | None = None


SEQ8_TEXT = "A request is a sequence of tokens."
EARLIER_TEXT = "Hello, who are you today?"
CHUNKED_TEXT = (
    "Once upon a time, in a small village by the sea, there lived an old fisherman who loved"
)
PREFIX_TEXT = "The quick brown fox jumps over the lazy dog. Then the fox ran"
PREFIX_SUFFIX = " cat sat down"
PREEMPT_TEXTS = ("The capital of France is Paris, and", "Paged attention stores the KV cache")
FINISH_TEXT = "The sky is blue because of"


def _seq8(lab: Driver) -> None:
    """The chapter's preset: one 8-token Sequence, WAITING, nothing planned yet. An earlier
    request ran first and finished: its two blocks are free but still cached, and come last
    in the free list, so the Sequence gets blocks 2 and 3 and slot != position."""
    lab.add_tokens(lab.prompt(EARLIER_TEXT, 2 * lab.block_size - 1), max_tokens=2)
    lab.step()
    lab.step()
    lab.add_tokens(lab.prompt(SEQ8_TEXT, 8), max_tokens=4)


def _chunked(lab: Driver) -> None:
    """A 20-token prompt against an 8-token step budget: prefilled in chunks of 8, 8, 4."""
    lab.add_tokens(lab.prompt(CHUNKED_TEXT, 20), max_tokens=3)


def _prefix(lab: Driver) -> None:
    """Request A is prefilled (its full prompt blocks are committed and hashed) and keeps
    decoding; request B starts with A's first three blocks and waits to be planned."""
    bs = lab.block_size
    a = lab.prompt(PREFIX_TEXT, 3 * bs + 2)
    lab.add_tokens(a, max_tokens=6)
    lab.step()
    lab.add_tokens(a[: 3 * bs] + lab.prompt(PREFIX_SUFFIX, 3), max_tokens=4)


def _preempt(lab: Driver) -> None:
    """Two 2-block prompts fill a 4-block pool; the next decode needs a fifth block."""
    for text in PREEMPT_TEXTS:
        lab.add_tokens(lab.prompt(text, 2 * lab.block_size), max_tokens=4)
    lab.step()


def _finish(lab: Driver) -> None:
    """max_tokens=2: one token from the prefill, one from the first decode, then FINISHED."""
    lab.add_tokens(lab.prompt(FINISH_TEXT, 6), max_tokens=2)


CHAPTER_03 = [
    Scenario("seq8", EngineShape(16, 64), _seq8, focus=1),
    Scenario("chunked", EngineShape(16, 8), _chunked, focus=0),
    Scenario("prefix", EngineShape(16, 64), _prefix, focus=1),
    Scenario("preempt", EngineShape(4, 64), _preempt, focus=1),
    Scenario("finish", EngineShape(16, 64), _finish, focus=0),
]
