"""An optional record of every field change of every sequence, for the lab and for tests.

Off by default and free when off: the engine then creates plain `Sequence` objects. With a
`Tracer`, the engine creates `TracedSequence` objects instead, whose attribute writes (and
block-table edits) are recorded with the phase the engine is in (plan, execute, commit), the
function that made the change, and its real source line, read from the caller's frame.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from minivllm.engine.sequence import Sequence, SequenceStatus

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

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds `minivllm/`


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
        return Path(filename).resolve().relative_to(_PACKAGE_ROOT).as_posix()
    except ValueError:
        return Path(filename).name


def source_of(func: Any) -> str:
    """'minivllm/engine/x.py:LINE' of a function's definition (through decorators such as
    `torch.inference_mode()`, which would otherwise point into torch)."""
    code = inspect.unwrap(func).__code__
    return f"{_relative(code.co_filename)}:{code.co_firstlineno}"


class Tracer:
    """Collects TraceEvents. The engine sets `step` and `phase`; sequences report changes."""

    def __init__(self) -> None:
        self.events: list[TraceEvent] = []
        self.step = 0
        self.phase = "add"

    def record(
        self, seq_id: int, field: str, before: Any, after: Any, depth: int = 0,
        actor: str | None = None, source: str | None = None,
    ) -> None:
        """Record one change; actor and source default to the code `depth` frames above
        the caller (0: the caller itself)."""
        if actor is None or source is None:
            found_actor, found_source = _where(depth)
            actor = actor or found_actor
            source = source or found_source
        self.events.append(
            TraceEvent(self.step, self.phase, actor, seq_id, field, _plain(before),
                       _plain(after), source)
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

    def extend(self, block_ids) -> None:  # type: ignore[override]
        before = list(self)
        super().extend(block_ids)
        self._report(before)

    def clear(self) -> None:
        before = list(self)
        super().clear()
        self._report(before)


class TracedSequence(Sequence):
    """A Sequence whose traced fields report every write to a Tracer."""

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
