"""AsyncLLMEngine: one background thread steps an LLMEngine; asyncio code streams its outputs.

The contract:
- Only the engine thread touches the LLMEngine: it runs an `EngineLoop` (engine_loop.py), which
  applies the commands the HTTP side sends (add, abort) between steps and sleeps when idle.
- Each request's outputs go to its own `asyncio.Queue`, fed with `loop.call_soon_threadsafe`
  once per committed step, so tokens stream out as they are committed.
- A request whose consumer goes away (its RequestStream is closed early, or the add is
  cancelled: a client disconnect) is aborted at once, which frees its KV blocks.
- Shutdown is graceful: `stop_accepting()` refuses new requests, those in flight go on until
  `abort_all()` (or `shutdown()`) ends the rest with finish_reason "abort".

`EngineProcess` (engine_process.py) has the same asyncio side with the engine loop in a
process of its own; both are `EngineClient`s (engine_client.py), all the server talks to.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.lora_registry import LoRARegistry
from minivllm.engine.requests import Choice
from minivllm.engine.runtime.engine_loop import (
    Abort,
    AbortAll,
    Add,
    Command,
    EngineDeadError,
    EngineLoop,
    QueueFullError,
    ShuttingDownError,
    StepRecorder,
    ThreadCommands,
)
from minivllm.lora_request import LoRARequest
from minivllm.outputs import RequestOutput

__all__ = [
    "AsyncLLMEngine",
    "EngineDeadError",
    "QueueFullError",
    "RequestStream",
    "ShuttingDownError",
    "StepRecorder",
]

logger = logging.getLogger(__name__)

OutputHook = Callable[[RequestOutput, int], None]  # (output, number of new tokens)


@dataclass
class Stream:
    """The asyncio side of one request: where its choices' outputs go."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[tuple[int, RequestOutput]]

    def put(self, index: int, output: RequestOutput) -> None:
        """Hand one output to the stream's event loop; safe from any thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, output))
        except RuntimeError:  # its event loop is closed: nobody is listening any more
            pass


class RequestStream:
    """One request's outputs as the engine commits them: async-iterate to get
    (choice index, cumulative RequestOutput) until every choice has finished."""

    def __init__(
        self,
        send_abort: Callable[[str], None],
        request_id: str,
        queue: asyncio.Queue[tuple[int, RequestOutput]],
        num_choices: int,
    ) -> None:
        self.request_id = request_id
        self._send_abort = send_abort
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
            self._send_abort(self.request_id)
        self._closed = True


def call_output_hook(hook: OutputHook | None, output: RequestOutput, num_new: int) -> None:
    """Run the server's hook (metrics) on a delivered output: a failing hook is logged, and the
    output is delivered all the same."""
    if hook is None:
        return
    try:
        hook(output, num_new)
    except Exception:
        logger.exception("output hook failed")


async def add_and_wait(
    send: Callable[[Command], None],
    request_id: str,
    choices: list[Choice],
    lora: LoRARequest | None = None,
) -> RequestStream:
    """Send an Add for `choices` and wait until the engine has taken (or refused) it; a
    cancelled wait (the client left) sends an Abort."""
    stream = Stream(asyncio.get_running_loop(), asyncio.Queue())
    done: concurrent.futures.Future[None] = concurrent.futures.Future()
    send(Add(request_id, choices, stream, done, lora))
    try:
        await asyncio.wrap_future(done)
    except asyncio.CancelledError:  # the client left while the add was pending
        send(Abort(request_id))
        raise
    return RequestStream(lambda rid: send(Abort(rid)), request_id, stream.queue, len(choices))


class _StreamSink:
    """Outputs straight to their asyncio streams, the output hook called first."""

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self._engine = engine

    def deliver(self, target: Stream, index: int, output: RequestOutput, num_new: int) -> None:
        call_output_hook(self._engine.on_output, output, num_new)
        target.put(index, output)

    def flush(self) -> None:
        pass


class AsyncLLMEngine:
    """Drives an LLMEngine from a background thread for asyncio callers (an EngineClient)."""

    def __init__(
        self,
        engine: LLMEngine,
        max_waiting_requests: int | None = None,
        on_output: OutputHook | None = None,
        recorder: StepRecorder | None = None,
    ) -> None:
        self.engine = engine
        self.on_output = on_output
        self._commands = ThreadCommands()
        self._loop = EngineLoop(
            engine, self._commands, _StreamSink(self), max_waiting_requests, recorder
        )
        self._stop = False
        self._thread: threading.Thread | None = None

    @property
    def recorder(self) -> StepRecorder | None:
        return self._loop.recorder

    # ---- the model's facts (read once by the server; fixed for the engine's life) ----------

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def loras(self) -> LoRARegistry:
        return self.engine.loras

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def default_sampling_params(self) -> dict[str, Any]:
        return self.engine.default_sampling_params

    @property
    def vocab_size(self) -> int:
        return self.engine.model_runner.vocab_size

    @property
    def max_waiting_requests(self) -> int | None:
        return self._loop.max_waiting_requests

    @max_waiting_requests.setter
    def max_waiting_requests(self, limit: int | None) -> None:
        self._loop.max_waiting_requests = limit

    @property
    def stats(self) -> dict[str, float]:
        """The engine's stats as of its last step (read from any thread)."""
        return self._loop.stats

    def num_tracked(self) -> tuple[int, int]:
        """(requests, sub-requests) the engine loop still tracks: both 0 once idle."""
        return self._loop.num_tracked()

    @property
    def num_steps(self) -> int:
        return self._loop.num_steps

    @property
    def num_loop_errors(self) -> int:
        return self._loop.num_loop_errors

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
        self._commands.send(None)
        self._thread.join(timeout)
        self._thread = None

    def close(self) -> None:
        """Release the engine's runner processes, if any (tensor parallelism); idempotent."""
        self.engine.close()

    def stop_accepting(self) -> None:
        """Refuse new requests from now on (ShuttingDownError); those in flight go on."""
        self._loop.accepting = False

    def abort_all(self) -> None:
        """End every in-flight request now with finish_reason "abort"; safe from any thread."""
        self._commands.send(AbortAll())

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- the asyncio side -------------------------------------------------------------

    async def add_request(
        self, request_id: str, choices: list[Choice], lora: LoRARequest | None = None
    ) -> RequestStream:
        """Add one sub-request per choice (under the LoRA adapter `lora`, if given), all
        or none, and return their output stream.

        Raises ValueError (bad request) or QueueFullError (overloaded). The caller must
        `close()` the stream when done with it: closing it early aborts what still runs.
        """
        if not self._loop.accepting:
            raise ShuttingDownError("the server is shutting down; retry on another instance")
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        return await add_and_wait(self._commands.send, request_id, choices, lora)

    # ---- the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop:
            self._loop.run_once()
        self._loop.refuse_pending()
        self._loop.end_all(None)
