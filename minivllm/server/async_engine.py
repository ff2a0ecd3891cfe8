"""AsyncLLMEngine: one background thread steps an LLMEngine; asyncio code streams its outputs.

The contract:
- Only the engine thread touches the LLMEngine. The HTTP side sends it commands (add, abort)
  through a lock-guarded list and wakes it with an event; the thread applies them between steps.
- The thread steps while work exists and sleeps on the event when idle.
- Each request's outputs go to its own `asyncio.Queue`, fed with `loop.call_soon_threadsafe`
  once per committed step, so tokens stream out as they are committed.
- A request whose consumer goes away (its RequestStream is closed early, or the add is
  cancelled: a client disconnect) is aborted at once, which frees its KV blocks.
- Nothing a request does can stop the thread: ModelRunner faults end the failed batch's
  requests with finish_reason "error" (the engine does that); any other exception from a step
  ends every in-flight request with "error" and the thread keeps serving.
- With a StepRecorder (`minivllm serve --lab`), the recorder runs each step (the same plan,
  execute and commit) so it can note the plan, and photographs the engine after the commit,
  between steps; without one, nothing is recorded.
- Shutdown is graceful: `stop_accepting()` refuses new requests, those in flight go on until
  `abort_all()` (or `shutdown()`) ends the rest with finish_reason "abort".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from minivllm.engine import requests
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.requests import Choice
from minivllm.engine.sequence import FinishReason
from minivllm.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The waiting queue is at its limit: the server is overloaded (HTTP 503)."""


class ShuttingDownError(Exception):
    """The server is shutting down and takes no new requests (HTTP 503)."""


@dataclass
class _Stream:
    """The asyncio side of one request: where its sub-requests' outputs go."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[tuple[int, RequestOutput]]
    sub_ids: set[str] = field(default_factory=set)  # its unfinished sub-requests


@dataclass
class _Sub:
    """One sequence of a request (a choice: n > 1 or several prompts make several)."""

    sub_id: str  # the engine's request_id: "<request_id>/<index>"
    request_id: str
    index: int  # the choice index
    seq_id: int
    num_tokens: int = 0  # completion tokens delivered so far


@dataclass
class _Add:
    request_id: str
    choices: list[Choice]
    stream: _Stream
    done: concurrent.futures.Future[None]


@dataclass
class _Abort:
    request_id: str


@dataclass
class _AbortAll:
    """End every in-flight request with finish_reason "abort" (the end of a graceful shutdown)."""


class RequestStream:
    """One request's outputs as the engine commits them: async-iterate to get
    (choice index, cumulative RequestOutput) until every choice has finished."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        request_id: str,
        queue: asyncio.Queue[tuple[int, RequestOutput]],
        num_choices: int,
    ) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue = queue
        self.num_unfinished = num_choices
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if self.num_unfinished == 0 or self._closed:
            raise StopAsyncIteration
        index, output = await self._queue.get()
        if output.finished:
            self.num_unfinished -= 1
        return index, output

    def close(self) -> None:
        """Stop listening; abort the choices still running (a client disconnect). Idempotent."""
        if not self._closed and self.num_unfinished:
            self._engine._send(_Abort(self.request_id))
        self._closed = True


OutputHook = Callable[[RequestOutput, int], None]  # (output, number of new tokens)


class StepRecorder(Protocol):
    """Watches the engine on the engine thread (the lab's live view, `minivllm.lab.live`).
    `request_ids` maps the engine's seq_id to the request's id ("<request_id>/<index>")."""

    def step(self, engine: LLMEngine, request_ids: Mapping[int, str]) -> list[RequestOutput]:
        """One `engine.step()` (plan, then execute and commit), recorded."""
        ...

    def snapshot(self, engine: LLMEngine, request_ids: Mapping[int, str]) -> None:
        """Record the engine as it stands between steps (no step ran)."""
        ...


class AsyncLLMEngine:
    """Drives an LLMEngine from a background thread for asyncio callers."""

    def __init__(
        self,
        engine: LLMEngine,
        max_waiting_requests: int | None = None,
        on_output: OutputHook | None = None,
        recorder: StepRecorder | None = None,
    ) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.on_output = on_output
        self.recorder = recorder
        self._commands: list[_Add | _Abort | _AbortAll] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._accepting = True
        self._thread: threading.Thread | None = None
        # Engine thread only: request_id -> its stream, sub_id -> sub-request.
        self._streams: dict[str, _Stream] = {}
        self._subs: dict[str, _Sub] = {}
        # A copy of engine.stats(), refreshed by the engine thread after every step, so that
        # readers on other threads never walk the scheduler's structures while they change.
        self.stats: dict[str, float] = dict(engine.stats())
        self.num_steps = 0
        self.num_loop_errors = 0

    # ---- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="minivllm-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still in flight end with finish_reason "abort"."""
        if self._thread is None:
            return
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)
        self._thread = None

    def stop_accepting(self) -> None:
        """Refuse new requests from now on (ShuttingDownError); those in flight go on."""
        self._accepting = False

    def abort_all(self) -> None:
        """End every in-flight request now with finish_reason "abort"; safe from any thread."""
        self._send(_AbortAll())

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- the asyncio side -------------------------------------------------------------

    async def add_request(self, request_id: str, choices: list[Choice]) -> RequestStream:
        """Add one sub-request per choice, all or none, and return their output stream.

        Raises ValueError (bad request) or QueueFullError (overloaded). The caller must
        `close()` the stream when done with it: closing it early aborts what still runs.
        """
        if not self._accepting:
            raise ShuttingDownError("the server is shutting down; retry on another instance")
        if not self.is_running:
            raise RuntimeError("the engine loop is not running")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._send(_Add(request_id, choices, stream, done))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:  # the client left while the add was pending
            self._send(_Abort(request_id))
            raise
        return RequestStream(self, request_id, stream.queue, len(choices))

    def _send(self, command: _Add | _Abort | _AbortAll) -> None:
        with self._lock:
            self._commands.append(command)
            self._wake.set()

    # ---- the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop:
            try:
                self._run_once()
            except Exception as exc:  # a bug below the runner: fail what is in flight, go on
                logger.exception("engine step failed; ending all in-flight requests")
                self.num_loop_errors += 1
                self._end_all(exc)
        with self._lock:
            commands, self._commands = self._commands, []
        for command in commands:  # adds that arrived during shutdown
            if isinstance(command, _Add) and command.done.set_running_or_notify_cancel():
                command.done.set_exception(ShuttingDownError("the server is shutting down"))
        self._end_all(None)

    def _run_once(self) -> None:
        """Apply the pending commands, then one engine step (or sleep until woken)."""
        with self._lock:
            commands, self._commands = self._commands, []
            if not commands and not self.engine.has_unfinished_requests():
                self._wake.clear()
        for command in commands:
            self._apply(command)
        if not self.engine.has_unfinished_requests():
            self.stats = dict(self.engine.stats())
            if commands and self.recorder is not None:  # an abort may have emptied the queues
                self.recorder.snapshot(self.engine, self._request_ids())
            if not commands:
                self._wake.wait()
            return
        if self.recorder is None:
            outputs = self.engine.step()
        else:
            outputs = self.recorder.step(self.engine, self._request_ids())
        self.num_steps += 1
        self.stats = dict(self.engine.stats())
        for output in outputs:
            self._deliver(output)

    def _request_ids(self) -> dict[int, str]:
        return {sub.seq_id: sub.sub_id for sub in self._subs.values()}

    def _apply(self, command: _Add | _Abort | _AbortAll) -> None:
        if isinstance(command, _AbortAll):
            self._end_all(None)
            return
        if isinstance(command, _Abort):
            stream = self._streams.pop(command.request_id, None)
            for sub_id in stream.sub_ids if stream is not None else ():
                self.engine.abort_request(self._subs.pop(sub_id).seq_id)
            return
        if not command.done.set_running_or_notify_cancel():
            return  # the caller stopped waiting before the add was applied
        try:
            self._add(command)
        except Exception as exc:
            command.done.set_exception(exc)
        else:
            command.done.set_result(None)

    def _add(self, command: _Add) -> None:
        if not self._accepting:  # stop_accepting() raced with this add
            raise ShuttingDownError("the server is shutting down; retry on another instance")
        waiting = self.engine.stats()["num_requests_waiting"]
        limit = self.max_waiting_requests
        if limit is not None and waiting + len(command.choices) > limit:
            raise QueueFullError(
                f"the server is overloaded: {int(waiting)} requests are waiting "
                f"(limit {limit}); retry later"
            )
        sub_ids = [f"{command.request_id}/{i}" for i in range(len(command.choices))]
        seqs = requests.add_all(self.engine, command.choices, sub_ids)  # all or none
        added = [
            _Sub(sub_id, command.request_id, index, seq.seq_id)
            for index, (sub_id, seq) in enumerate(zip(sub_ids, seqs))
        ]
        for sub in added:
            self._subs[sub.sub_id] = sub
            command.stream.sub_ids.add(sub.sub_id)
        self._streams[command.request_id] = command.stream

    def _deliver(self, output: RequestOutput) -> None:
        """Hand one sub-request's output to its stream's event loop."""
        sub = self._subs.get(output.request_id)
        if sub is None:
            return  # aborted in the meantime
        stream = self._streams[sub.request_id]
        num_tokens = len(output.outputs[0].token_ids)
        if self.on_output is not None:
            try:
                self.on_output(output, num_tokens - sub.num_tokens)
            except Exception:
                logger.exception("output hook failed")
        sub.num_tokens = num_tokens
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, (sub.index, output))
        except RuntimeError:  # its event loop is closed: nobody is listening any more
            pass
        if output.finished:
            del self._subs[sub.sub_id]
            stream.sub_ids.discard(sub.sub_id)
            if not stream.sub_ids:
                del self._streams[sub.request_id]

    def _end_all(self, exc: Exception | None) -> None:
        """Abort every in-flight sub-request and deliver its final output: "error" after a
        failed step (`exc`), "abort" at shutdown (`exc` None)."""
        for sub in list(self._subs.values()):
            try:
                self.engine.abort_request(sub.seq_id)
            except Exception:  # the engine is already broken; the client must still hear
                logger.exception("abort of %s failed", sub.sub_id)
            self._deliver(_final_output(sub.sub_id, exc))


def _final_output(sub_id: str, exc: Exception | None) -> RequestOutput:
    if exc is None:
        reason, error = FinishReason.ABORT, "the server is shutting down"
    else:
        reason, error = FinishReason.ERROR, f"{type(exc).__name__}: {exc}"
    return RequestOutput(
        request_id=sub_id,
        prompt=None,
        prompt_token_ids=[],
        outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason=reason)],
        finished=True,
        error=error,
    )
