"""A request's record: its tokens, its progress counters, its block table, its state.

Who writes each field (the tutorial chapter's rule: scheduled is not cached):
- `token_ids`, `num_tokens`: set from the prompt at creation; `append_token()` after a sample.
- `num_prompt_tokens`: fixed at creation.
- `num_scheduled_tokens`: the Scheduler's plan for this step (`Scheduler.schedule`).
- `spec_token_ids`: with speculative decoding, the draft tokens the plan runs after the last
  token (`num_scheduled_tokens` = 1 + their number); written by the Scheduler at plan time,
  cleared by the commit. They are not in `token_ids` until the target accepts them.
- `num_cached_tokens`: committed KV progress, advanced only by `Scheduler.postprocess` after the
  ModelRunner has executed the plan (and, once, by a prefix-cache hit at admission).
- `block_table`: the BlockManager, when the plan needs blocks and when the sequence frees them.
- `pooling`: an embedding request's PoolingParams (None: a generation request), set by the
  engine before the Scheduler admits it. Such a sequence samples nothing: it finishes when its
  prompt has run. `pooled` is the runner's partial pool over the committed positions (mean
  pooling's running sum), taken from each step's output by the commit and reset by
  preemption; `embedding` is the final vector, written by the commit that finishes it.
- `lora_int_id`: the request's LoRA adapter (0: the base model), set by the engine at
  creation; the runner maps it to a slot and the prefix cache keys the first block by it.
- `status`: the Scheduler (WAITING -> RUNNING on admission, RUNNING -> WAITING on preemption,
  -> FINISHED on a stop condition or abort).

Pure Python: no torch here.
"""

from __future__ import annotations

import time
from enum import Enum
from typing import Any

from minivllm.logprobs import Logprob
from minivllm.paging import blocks_for
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "WAITING"
    RUNNING = "RUNNING"
    FINISHED = "FINISHED"


class FinishReason(str, Enum):
    """Why a sequence ended; the values are OpenAI's and vLLM's `finish_reason` strings."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # the client went away or the request was cancelled
    ERROR = "error"  # the model run of its batch failed

    def __str__(self) -> str:  # f-strings and format() give the plain value
        return self.value


class Sequence:
    """One request's state machine: WAITING -> RUNNING -> FINISHED."""

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.status = SequenceStatus.WAITING
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.spec_token_ids: list[int] = []
        self.block_table: list[int] = []
        self.sampling_params = sampling_params or SamplingParams()
        self.finish_reason: FinishReason | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # One entry per completion token when sampling_params.logprobs is set:
        # {token_id: Logprob} of the sampled token and the top-N.
        self.logprobs: list[dict[int, Logprob]] = []
        # When sampling_params.prompt_logprobs is set: for prompt positions 1.., committed in
        # order, {token_id: Logprob} of the prompt's own token plus the top-N.
        self.prompt_logprobs: list[dict[int, Logprob]] = []
        self.num_preemptions = 0
        self.pooling: PoolingParams | None = None
        self.pooled: Any = None  # opaque here: the runner's tensor
        self.embedding: list[float] | None = None
        self.lora_int_id = 0

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, {self.status.name}, tokens={self.num_tokens}, "
            f"prompt={self.num_prompt_tokens}, cached={self.num_cached_tokens}, "
            f"scheduled={self.num_scheduled_tokens}, blocks={self.block_table})"
        )

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncached_tokens(self) -> int:
        """Tokens whose KV is not committed yet: what the scheduler still has to plan."""
        return self.num_tokens - self.num_cached_tokens

    @property
    def planned_token_ids(self) -> list[int]:
        """The tokens this step's plan reads: `token_ids`, then any draft tokens."""
        return self.token_ids + self.spec_token_ids if self.spec_token_ids else self.token_ids

    def num_blocks(self, block_size: int) -> int:
        """Blocks needed to hold all `num_tokens` tokens."""
        return blocks_for(self.num_tokens, block_size)

    def append_token(self, token_id: int) -> None:
        """Record a sampled token. Changes only the token record, never cached or scheduled."""
        self.token_ids.append(token_id)
        self.num_tokens += 1

    def truncate(self, num_tokens: int) -> None:
        """Drop the completion tokens past `num_tokens` (a finished sequence whose stop string
        ended inside the last step's run of accepted tokens)."""
        assert self.num_prompt_tokens <= num_tokens <= self.num_tokens, (self, num_tokens)
        del self.token_ids[num_tokens:]
        self.num_tokens = num_tokens
        self.num_cached_tokens = min(self.num_cached_tokens, num_tokens)
        del self.logprobs[num_tokens - self.num_prompt_tokens :]


def check_invariants(seq: Sequence, block_size: int) -> None:
    """Raise AssertionError if `seq` breaks one of the state machine's invariants."""
    where = repr(seq)
    assert 0 <= seq.num_cached_tokens <= seq.num_tokens, where
    assert seq.num_scheduled_tokens >= 0, where
    num_planned = seq.num_tokens + len(seq.spec_token_ids)
    assert seq.num_cached_tokens + seq.num_scheduled_tokens <= num_planned, where
    if seq.spec_token_ids:  # drafts follow the last token, in one decode step
        assert seq.num_cached_tokens == seq.num_tokens - 1, where
        assert seq.num_scheduled_tokens == 1 + len(seq.spec_token_ids), where
    assert seq.num_tokens == len(seq.token_ids), where
    assert seq.num_prompt_tokens <= seq.num_tokens, where
    if seq.status == SequenceStatus.RUNNING:
        covered = len(seq.block_table) * block_size
        assert covered >= seq.num_cached_tokens + seq.num_scheduled_tokens, where
    else:
        assert seq.block_table == [], where
        assert seq.num_scheduled_tokens == 0, where
        assert seq.spec_token_ids == [], where
    if seq.status == SequenceStatus.WAITING:
        assert seq.num_cached_tokens == 0, where
    if seq.status == SequenceStatus.FINISHED:
        assert isinstance(seq.finish_reason, FinishReason), where
    else:
        assert seq.finish_reason is None, where
