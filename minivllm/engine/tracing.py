"""An optional record of every field change of every sequence, for the lab and for tests.

Off by default and free when off: the engine holds a `NullTracer`, which makes plain
`Sequence` objects and records nothing. With a `Tracer`, the engine creates `TracedSequence`
objects instead, whose attribute writes (and block-table edits) are recorded with the phase the
engine is in (plan, execute, commit), the function that made the change, and its real source
line, read from the caller's frame. The engine marks its phases with scoped blocks,
`with tracer.phase("execute"): ...`, so `LLMEngine.step` still reads as plan -> execute ->
commit.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from minivllm.engine.sequence import FinishReason, Sequence, SequenceStatus
from minivllm.sampling_params import SamplingParams

TRACED_FIELDS = frozenset(
    {
        "status",
        "num_tokens",
        "num_cached_tokens",
        "num_scheduled_tokens",
        "block_table",
        "finish_reason",
    }
)

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds `minivllm/`


@dataclass
class TraceEvent:
    step: int
    phase: str  # "plan" | "execute" | "commit" | "add" | "abort"
    actor: str  # e.g. "Scheduler.schedule", "BlockManager.allocate"
    seq_id: int
    field: str
    before: Any
    after: Any
    source: str  # "minivllm/engine/scheduler.py:LINE"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _plain(value: Any) -> Any:
    if isinstance(value, SequenceStatus):
        return value.name
    if isinstance(value, FinishReason):
        return value.value
    if isinstance(value, list):
        return list(value)
    return value


def _where(depth: int) -> tuple[str, str]:
    """(actor, source) of the frame `depth` levels above the caller of `Tracer.record`."""
    frame = sys._getframe(depth + 2)  # 0: here, 1: Tracer.record, 2: record's caller
    code = frame.f_code
    actor = getattr(code, "co_qualname", code.co_name)
    return actor, f"{_relative(code.co_filename)}:{frame.f_lineno}"


def _relative(filename: str) -> str:
    try:
        return Path(filename).resolve().relative_to(PACKAGE_ROOT).as_posix()
    except ValueError:
        return Path(filename).name


def source_of(func: Any) -> str:
    """'minivllm/engine/x.py:LINE' of a function's definition (through decorators such as
    `torch.inference_mode()`, which would otherwise point into torch)."""
    code = inspect.unwrap(func).__code__
    return f"{_relative(code.co_filename)}:{code.co_firstlineno}"


class NullTracer:
    """The tracer when tracing is off: plain sequences, empty phases, nothing recorded."""

    step = 0
    current_phase: str | None = None

    def next_step(self) -> None:
        """Called by the engine at the start of each plan."""

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Changes made inside the block belong to phase `name` (see Tracer)."""
        yield

    def new_sequence(
        self, seq_id: int, token_ids: list[int], sampling_params: SamplingParams
    ) -> Sequence:
        return Sequence(seq_id, token_ids, sampling_params)

    def record_execute(self, batch: Any, output: Any, runner: Any) -> None:
        """What the runner did to each sequence of `batch` (it writes no Sequence field),
        from its `RunnerOutput`."""


class Tracer(NullTracer):
    """Collects TraceEvents. The engine marks steps and phases; sequences report changes.

    Subclasses may override `on_phase_enter` / `on_phase_exit` to act between phases (the
    lab photographs the whole state there).
    """

    def __init__(self) -> None:
        self.events: list[TraceEvent] = []
        self.step = 0
        self.current_phase: str | None = None

    def next_step(self) -> None:
        self.step += 1

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Changes recorded inside the block get phase `name`; the previous phase comes back
        at its end."""
        outer, self.current_phase = self.current_phase, name
        self.on_phase_enter(name)
        try:
            yield
        finally:
            self.on_phase_exit(name)
            self.current_phase = outer

    def on_phase_enter(self, name: str) -> None:
        """Hook: the engine has entered phase `name`."""

    def on_phase_exit(self, name: str) -> None:
        """Hook: the engine is leaving phase `name`."""

    def new_sequence(
        self, seq_id: int, token_ids: list[int], sampling_params: SamplingParams
    ) -> Sequence:
        return TracedSequence(self, seq_id, token_ids, sampling_params)

    def record_execute(self, batch: Any, output: Any, runner: Any) -> None:
        actor = f"{type(runner).__name__}.run"
        source = source_of(type(runner).run)
        for seq in batch.seqs:
            start = seq.num_cached_tokens
            self.record(
                seq.seq_id,
                "kv_written",
                start,
                start + seq.num_scheduled_tokens,
                actor=actor,
                source=source,
            )
        for seq, sample in zip(batch.sample_seqs, output.samples):
            self.record(
                seq.seq_id, "sampled_token", None, sample.token_id, actor=actor, source=source
            )

    def record(
        self,
        seq_id: int,
        field: str,
        before: Any,
        after: Any,
        depth: int = 0,
        actor: str | None = None,
        source: str | None = None,
    ) -> None:
        """Record one change; actor and source default to the code `depth` frames above
        the caller (0: the caller itself)."""
        if actor is None or source is None:
            found_actor, found_source = _where(depth)
            actor = actor or found_actor
            source = source or found_source
        self.events.append(
            TraceEvent(
                self.step,
                self.current_phase or "add",
                actor,
                seq_id,
                field,
                _plain(before),
                _plain(after),
                source,
            )
        )


class _TracedBlockTable(list):
    """A block table that reports in-place edits (append, extend, clear) to its tracer."""

    def __init__(self, items: list[int], seq: TracedSequence) -> None:
        super().__init__(items)
        self._seq = seq

    def _report(self, before: list[int]) -> None:
        if before != self:
            self._seq._tracer.record(self._seq.seq_id, "block_table", before, list(self), depth=2)

    def append(self, block_id: int) -> None:
        before = list(self)
        super().append(block_id)
        self._report(before)

    def extend(self, block_ids) -> None:
        before = list(self)
        super().extend(block_ids)
        self._report(before)

    def clear(self) -> None:
        before = list(self)
        super().clear()
        self._report(before)


class TracedSequence(Sequence):
    """A Sequence whose traced fields report every write to a Tracer."""

    _tracer: Tracer
    _ready: bool

    def __init__(self, tracer: Tracer, *args: Any, **kwargs: Any) -> None:
        object.__setattr__(self, "_tracer", tracer)
        object.__setattr__(self, "_ready", False)
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "block_table", _TracedBlockTable(self.block_table, self))
        object.__setattr__(self, "_ready", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if self._ready and name in TRACED_FIELDS:
            before = getattr(self, name)
            if name == "block_table":
                value = _TracedBlockTable(value, self)
            object.__setattr__(self, name, value)
            if before != value:
                self._tracer.record(self.seq_id, name, before, value, depth=1)
            return
        object.__setattr__(self, name, value)
