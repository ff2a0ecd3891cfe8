"""The live lab's recorder: a running server's engine, photographed between steps.

`minivllm serve --lab` hands the server's engine thread a LiveRecorder. The recorder runs each
step itself with the engine's own two halves (`LLMEngine.plan`, then `execute_and_commit`:
exactly `LLMEngine.step`), so it can count the plan's prefill and decode tokens before the
commit consumes `num_scheduled_tokens`. After the commit, between steps, it copies only the
few numbers the live page shows: each queued request's Sequence fields and block table, the
pool's free and hashed blocks, the step's tokens, batch size, time and preemptions. The last
`history` frames stay in a ring (a deque) for the page to scrub; readers on other threads get
these immutable records, never the engine's own objects.

Without --lab there is no recorder and the engine thread calls `engine.step()` as before.
Why not `Snapshotter` (snapshot.py): it decodes text and walks every KV slot, right for the
teaching lab's few tokens, too slow to run after every step of a busy server.

Pure Python: no torch here.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from minivllm.config import EngineConfig
from minivllm.engine.engine_output import EngineOutput
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.scheduler import ScheduledBatch
from minivllm.engine.sequence import Sequence

logger = logging.getLogger(__name__)

DEFAULT_HISTORY = 300  # frames kept for the page's pause-and-scrub

# One request in a frame: the Sequence fields of the tutorial chapter, in docs/lab.md's order.
REQUEST_FIELDS = (
    "request_id",
    "status",
    "num_tokens",
    "num_prompt_tokens",
    "num_cached_tokens",
    "num_scheduled_tokens",
    "block_table",
)
TIMELINE_FIELDS = ("step", "num_prefill_tokens", "num_decode_tokens", "num_seqs", "seconds")

RequestRow = tuple[str, str, int, int, int, int, tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one step did, from its plan (read before the commit) and its wall time."""

    step: int
    num_prefill_tokens: int  # prompt (or recompute) tokens planned
    num_decode_tokens: int  # one per sequence that decodes
    num_seqs: int  # the batch size
    seconds: float  # plan + execute + commit
    preempted: tuple[str, ...]  # request ids the plan preempted (RUNNING -> WAITING)
    scheduled: tuple[tuple[str, int], ...]  # (request id, tokens planned for it)

    def to_dict(self, extra: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {name: getattr(self, name) for name in TIMELINE_FIELDS}
        if extra:
            out["preempted"] = list(self.preempted)
            out["scheduled"] = dict(self.scheduled)
        return out


@dataclass(frozen=True, slots=True)
class Frame:
    """The engine between two steps: queues, Sequence fields, pool occupancy."""

    index: int  # frames recorded before this one (the page asks for frames after an index)
    step: int  # steps run so far
    time: float  # wall clock (time.time())
    requests: tuple[RequestRow, ...]  # waiting queue first, then running, in queue order
    num_free_blocks: int
    hashed_blocks: tuple[int, ...]  # blocks with a prefix-cache hash (held or free)
    num_preemptions: int  # since the server started
    record: StepRecord | None  # the step that led here; None for a photo with no step

    def requests_json(self) -> list[dict[str, Any]]:
        return [
            {**dict(zip(REQUEST_FIELDS[:-1], row[:-1])), "block_table": list(row[-1])}
            for row in self.requests
        ]


class LiveRecorder:
    """Records the engine on its own thread (see the module docstring); thread-safe reads."""

    def __init__(self, num_blocks: int, config: EngineConfig, history: int = DEFAULT_HISTORY):
        if history < 1:
            raise ValueError(f"history must be at least 1 frame, got {history}")
        self.num_blocks = num_blocks
        self.block_size = config.block_size
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.history = history
        self._frames: deque[Frame] = deque(maxlen=history)
        self._lock = threading.Lock()
        self._index = itertools.count()
        self._steps = 0

    @classmethod
    def for_engine(cls, engine: LLMEngine, history: int = DEFAULT_HISTORY) -> LiveRecorder:
        """A recorder sized for `engine`'s KV pool and step budget: the one place the server
        hands the lab an engine, so the server never reads the scheduler itself."""
        return cls(engine.scheduler.block_manager.num_blocks, engine.config, history)

    # ---- the engine thread ------------------------------------------------------------

    def step(self, engine: LLMEngine, request_ids: Mapping[int, str]) -> list[EngineOutput]:
        """One engine step, recorded: plan, note the plan, execute and commit, photograph."""
        start = time.perf_counter()
        batch = engine.plan()
        planned = _planned(batch, request_ids)
        outputs = engine.execute_and_commit(batch)
        seconds = time.perf_counter() - start
        self._steps += 1
        prefill, decode, scheduled = planned
        preempted = tuple(_name(s, request_ids) for s in batch.preempted)
        record = StepRecord(
            self._steps, prefill, decode, len(scheduled), seconds, preempted, scheduled
        )
        try:
            self._photograph(engine, request_ids, record)
        except Exception:  # a missed photo must never cost the step's outputs
            logger.exception("the live lab could not record step %d", self._steps)
        return outputs

    def snapshot(self, engine: LLMEngine, request_ids: Mapping[int, str]) -> None:
        """Photograph the engine as it stands (between steps; no step ran)."""
        self._photograph(engine, request_ids, None)

    def _photograph(
        self, engine: LLMEngine, request_ids: Mapping[int, str], record: StepRecord | None
    ) -> None:
        scheduler = engine.scheduler
        bm = scheduler.block_manager
        rows = tuple(
            (
                _name(seq, request_ids),
                seq.status.name,
                seq.num_tokens,
                seq.num_prompt_tokens,
                seq.num_cached_tokens,
                seq.num_scheduled_tokens,
                tuple(seq.block_table),
            )
            for seq in itertools.chain(scheduler.waiting, scheduler.running)
        )
        frame = Frame(
            next(self._index),
            self._steps,
            time.time(),
            rows,
            bm.num_free_blocks,
            tuple(bm.cached_blocks.values()),
            scheduler.num_preemptions,
            record,
        )
        with self._lock:
            self._frames.append(frame)

    # ---- readers (any thread) ---------------------------------------------------------

    def frames(self) -> list[Frame]:
        """The recorded frames, oldest first (at most `history`)."""
        with self._lock:
            return list(self._frames)

    def live(self) -> dict[str, Any]:
        """GET /lab/api/live: the latest frame and the timeline of the recorded steps."""
        frames = self.frames()
        latest = frames[-1] if frames else None
        return {
            "step": latest.step if latest else 0,
            "requests": latest.requests_json() if latest else [],
            "kv_cache": {
                "num_blocks": self.num_blocks,
                "num_free_blocks": latest.num_free_blocks if latest else self.num_blocks,
            },
            "num_preemptions": latest.num_preemptions if latest else 0,
            "timeline": [f.record.to_dict(extra=False) for f in frames if f.record is not None],
        }

    def frames_after(self, index: int) -> dict[str, Any]:
        """What the page polls: the frames recorded after frame `index` (-1: all kept), with
        the pool's shape. A frame's `hashed_blocks` is null when it equals the one of the
        frame before it in the same answer (the first frame always carries them)."""
        out: list[dict[str, Any]] = []
        previous: tuple[int, ...] | None = None
        for frame in self.frames():
            if frame.index <= index:
                continue
            same = previous is not None and frame.hashed_blocks == previous
            out.append(_frame_json(frame, None if same else frame.hashed_blocks))
            previous = frame.hashed_blocks
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "history": self.history,
            "frames": out,
        }


def _name(seq: Sequence, request_ids: Mapping[int, str]) -> str:
    return request_ids.get(seq.seq_id) or str(seq.seq_id)


def _planned(
    batch: ScheduledBatch, request_ids: Mapping[int, str]
) -> tuple[int, int, tuple[tuple[str, int], ...]]:
    """(prefill tokens, decode tokens, per request planned tokens) of a plan not yet executed.
    A decode is one token after a fully cached prompt; anything else (a prompt chunk, a
    recompute after preemption) is prefill."""
    prefill = decode = 0
    for seq in batch.seqs:
        n = seq.num_scheduled_tokens
        is_decode = (
            n == 1
            and seq.num_cached_tokens == seq.num_tokens - 1
            and seq.num_cached_tokens >= seq.num_prompt_tokens
        )
        if is_decode:
            decode += 1
        else:
            prefill += n
    scheduled = tuple((_name(s, request_ids), s.num_scheduled_tokens) for s in batch.seqs)
    return prefill, decode, scheduled


def _frame_json(frame: Frame, hashed: tuple[int, ...] | None) -> dict[str, Any]:
    return {
        "index": frame.index,
        "step": frame.step,
        "time": frame.time,
        "requests": frame.requests_json(),
        "num_free_blocks": frame.num_free_blocks,
        "hashed_blocks": None if hashed is None else list(hashed),
        "num_preemptions": frame.num_preemptions,
        "timeline": None if frame.record is None else frame.record.to_dict(),
    }
