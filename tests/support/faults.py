"""Fault injection for reliability tests: a wrapper around any model runner's `run`.

`FaultyRunner(runner, fail_on_calls={3}, fail_when=pred)` behaves exactly like `runner` except
that `run` raises `InjectedFault` on the chosen call numbers (1-based) or whenever a batch
holds a sequence that `fail_when` picks. Before raising it records what the engine must
leave untouched (each sequence's committed `num_cached_tokens`, its prompt) so tests can
check that a failed step commits nothing and that only the failed batch's requests end.
It wraps the real ModelRunner (tiny checkpoints) as well as the FakeModelRunner, and can
offer the engine a smaller KV pool than the runner holds, so one loaded model serves many
engines (one at a time).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from minivllm.engine.runner_output import RunnerOutput
from minivllm.engine.scheduler import ScheduledBatch
from minivllm.engine.sequence import Sequence

INJECTED = "injected fault"


class InjectedFault(RuntimeError):
    """The exception a FaultyRunner raises; its message always contains INJECTED."""


@dataclass
class FailedRun:
    """One injected failure: the call number and, per sequence of the batch, what it held."""

    call: int
    seq_ids: list[int]
    prompts: list[tuple[int, ...]]
    num_cached_tokens: dict[int, int]  # seq_id -> committed KV progress when the run began
    num_tokens: dict[int, int]  # seq_id -> tokens when the run began
    seqs: list[Sequence]


class FaultyRunner:
    """A model runner that fails on chosen steps or for chosen sequences (test only)."""

    def __init__(
        self,
        runner: Any,
        fail_on_calls: Iterable[int] = (),
        fail_when: Callable[[Sequence], bool] | None = None,
        num_kv_blocks: int | None = None,
    ) -> None:
        self.runner = runner
        # A smaller pool on the same cache (the engine uses block ids < num_kv_blocks only):
        # forces preemption without loading the model again.
        assert num_kv_blocks is None or num_kv_blocks <= runner.num_kv_blocks
        self.num_kv_blocks = num_kv_blocks or runner.num_kv_blocks
        self.vocab_size = runner.vocab_size
        self.fail_on_calls = set(fail_on_calls)
        self.fail_when = fail_when
        self.calls = 0
        self.failures: list[FailedRun] = []

    def run(self, batch: ScheduledBatch, token_bitmask: object = None) -> RunnerOutput:
        self.calls += 1
        hit = self.calls in self.fail_on_calls or (
            self.fail_when is not None and any(self.fail_when(s) for s in batch.seqs)
        )
        if not hit:
            return self.runner.run(batch, token_bitmask)
        self.failures.append(
            FailedRun(
                call=self.calls,
                seq_ids=[s.seq_id for s in batch.seqs],
                prompts=[tuple(s.prompt_token_ids) for s in batch.seqs],
                num_cached_tokens={s.seq_id: s.num_cached_tokens for s in batch.seqs},
                num_tokens={s.seq_id: s.num_tokens for s in batch.seqs},
                seqs=list(batch.seqs),
            )
        )
        raise InjectedFault(f"{INJECTED} on run {self.calls}")

    @property
    def failed_prompts(self) -> set[tuple[int, ...]]:
        """The prompts of every sequence that was in a failed batch."""
        return {p for f in self.failures for p in f.prompts}
