"""EngineProcess: the engine loop in a process of its own; the HTTP side stays in this one.

Why (vLLM V1 splits its engine core off the same way): on the CPU an engine thread in the
HTTP process shares the GIL and the cores with uvicorn, and a step's torch threads stall in
their barriers whenever the HTTP thread holds the GIL or a core they wait on. In a process of
its own the engine loses only the CPU time the HTTP side really uses (docs/benchmarks.md).

The contract is AsyncLLMEngine's (same asyncio side, same add/abort/shutdown semantics), plus:
- The engine process is a fresh interpreter (no torch threads or locks inherited; started
  with `subprocess`, so no multiprocessing helper process outlives the server). It reads
  `EngineStart`, names the model's directory (`EngineResolved`: this side loads the tokenizer
  from it meanwhile), builds the engine and answers `EngineReady` with what the HTTP side
  needs (config, sampling defaults, vocabulary size), or `EngineFailed` at either point.
- The engine process runs `engine_core.engine_main`. Messages are the dataclasses of
  engine_messages.py, pickled over one socket pair (`multiprocessing.Pipe`'s `Connection`).
  To the engine: AddRequest, AbortRequest, AbortAllRequests, StopAccepting, SetWaitingLimit,
  Shutdown. From it: RequestAdded (None or the add's exception) and StepOutputs (one per
  step: the outputs, then the stats).
- The engine process ignores SIGINT and SIGTERM (a Ctrl-C reaches the whole process group):
  this process decides when it stops, and it stops by itself when this one goes away.
- If it dies, every request in flight ends with finish_reason "error" and `is_running` turns
  false (/health answers 503).
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from minivllm.engine.lora_registry import LoRARegistry
from minivllm.engine.requests import Choice
from minivllm.engine.runtime.async_engine import (
    OutputHook,
    RequestStream,
    Stream,
    add_and_wait,
    call_output_hook,
)
from minivllm.engine.runtime.engine_loop import (
    Abort,
    Add,
    Command,
    EngineDeadError,
    ShuttingDownError,
    final_output,
)
from minivllm.engine.runtime.engine_messages import (
    AbortAllRequests,
    AbortRequest,
    AddRequest,
    EngineFailed,
    EngineReady,
    EngineResolved,
    EngineStart,
    RequestAdded,
    SetWaitingLimit,
    Shutdown,
    StepOutputs,
    StopAccepting,
)
from minivllm.engine.runtime.tokenizer_load import (
    TokenizerLoad,
    load_tokenizer_behind_the_engine,
    predicted_model_dir,
)
from minivllm.lora_request import LoRARequest

if TYPE_CHECKING:
    from minivllm.engine.runtime.engine_client import EngineClient

logger = logging.getLogger(__name__)
_Start = TypeVar("_Start", EngineResolved, EngineReady)


@dataclass
class EngineStarting:
    """An engine process started (`start_engine_process`) and not yet waited for: the HTTP
    side's own imports run meanwhile, on the other core. `EngineProcess(..., starting=it)`
    takes it over; `close` kills it if nothing did."""

    process: subprocess.Popen[bytes]
    conn: Any  # multiprocessing.connection.Connection
    tokenizer_load: TokenizerLoad | None = None  # begun on the directory this side foresaw

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def start_engine_process(
    engine_options: dict[str, Any], max_waiting_requests: int | None = None
) -> EngineStarting:
    """Start the engine process on `engine_options` and send it its start; returns at once."""
    conn, child_conn = multiprocessing.Pipe()  # a socket pair
    fd = child_conn.fileno()
    code = f"from minivllm.engine.runtime.engine_core import engine_main; engine_main({fd})"
    process = subprocess.Popen([sys.executable, "-c", code], pass_fds=[fd])
    child_conn.close()
    starting = EngineStarting(process, conn)
    try:
        level = logging.getLogger().getEffectiveLevel()
        conn.send(EngineStart(engine_options, max_waiting_requests, level))
    except (BrokenPipeError, EOFError, OSError):
        pass  # it exited at once: the first receive says so
    # This side's tokenizer loads now where the model's directory can be foreseen, on the core
    # the engine's imports leave idle, not ~4 s on once the engine has named it: loaded
    # then, beside the engine's load, it sometimes finished after the engine (docs/real-models.md).
    predicted = predicted_model_dir(engine_options.get("model"))
    starting.tokenizer_load = TokenizerLoad(predicted) if predicted is not None else None
    return starting


@dataclass
class _Pending:
    """A request on this side: its stream and the choices still running."""

    stream: Stream
    unfinished: set[int]


class EngineProcess:
    """An engine in a process of its own, driven like AsyncLLMEngine: an EngineClient
    (engine_client.py), the model's facts (config, tokenizer, ...) sent over at start-up."""

    def __init__(
        self,
        engine_options: dict[str, Any],
        max_waiting_requests: int | None = None,
        starting: EngineStarting | None = None,
    ) -> None:
        """Start the engine process (or take over `starting`, started on the same options)
        and wait until it is ready."""
        self.on_output: OutputHook | None = None
        self.stats: dict[str, float] = {}
        self.num_steps = 0
        self.num_loop_errors = 0
        self._max_waiting_requests = max_waiting_requests
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards _requests and _adds
        self._requests: dict[str, _Pending] = {}
        self._adds: dict[str, concurrent.futures.Future[None]] = {}
        self._accepting = True
        self._reader: threading.Thread | None = None
        starting = starting or start_engine_process(engine_options, max_waiting_requests)
        self._conn, self._process = starting.conn, starting.process
        try:
            resolved = self._receive_start(EngineResolved)
            model_dir, early = Path(resolved.model_dir), starting.tokenizer_load
            # While the engine process loads the weights and compiles, on the other core.
            try:
                if early is not None and early.serves(model_dir):
                    self.tokenizer = early.result()
                else:
                    self.tokenizer = load_tokenizer_behind_the_engine(model_dir)
            except Exception as exc:  # the engine fails on it too: its EngineFailed is raised
                ready = self._receive_start(EngineReady)
                raise RuntimeError(f"the tokenizer of {resolved.model_dir}: {exc}") from exc
            ready = self._receive_start(EngineReady)
        except BaseException:
            self.close()
            raise
        self.config = ready.config
        # the adapters' names, this side's: each request carries its adapter to the engine
        self.loras = LoRARegistry(ready.config)
        self.default_sampling_params = ready.default_sampling_params
        self.vocab_size = ready.vocab_size

    def _receive_start(self, kind: type[_Start]) -> _Start:
        """The engine process's next start-up message, of `kind`; its failure raised here."""
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            code = self._join(5)
            raise RuntimeError(
                f"the engine process exited while starting (exit code {code})"
            ) from None
        if isinstance(message, EngineFailed):
            self._join(10)
            if message.bad_input is not None:
                raise message.bad_input
            raise RuntimeError(f"the engine could not start: {message.error}")
        assert isinstance(message, kind), message
        return message

    # ---- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        if self._reader is not None:
            return
        self._reader = threading.Thread(target=self._read, name="minivllm-engine-io", daemon=True)
        self._reader.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process; requests still in flight end with finish_reason "abort"."""
        self._send(Shutdown(), quiet=True)
        self._join(timeout)
        if self._reader is not None:
            self._reader.join(timeout)
        self.close()

    def close(self) -> None:
        """Make sure the engine process is gone (it is killed if it has not stopped)."""
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def _join(self, timeout: float) -> int | None:
        """Wait up to `timeout` s for the engine process to end; its exit code, or None."""
        try:
            return self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop_accepting(self) -> None:
        """Refuse new requests from now on (ShuttingDownError); those in flight go on."""
        self._accepting = False
        self._send(StopAccepting(), quiet=True)

    def abort_all(self) -> None:
        """End every in-flight request now with finish_reason "abort"; safe from any thread."""
        self._send(AbortAllRequests(), quiet=True)

    @property
    def is_running(self) -> bool:
        return self._reader is not None and self._reader.is_alive() and self._process.poll() is None

    @property
    def max_waiting_requests(self) -> int | None:
        return self._max_waiting_requests

    @max_waiting_requests.setter
    def max_waiting_requests(self, limit: int | None) -> None:
        self._max_waiting_requests = limit
        self._send(SetWaitingLimit(limit))

    # ---- the asyncio side -------------------------------------------------------------

    async def add_request(
        self, request_id: str, choices: list[Choice], lora: LoRARequest | None = None
    ) -> RequestStream:
        """As AsyncLLMEngine.add_request."""
        if not self._accepting:
            raise ShuttingDownError("the server is shutting down; retry on another instance")
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        return await add_and_wait(self._command, request_id, choices, lora)

    def _command(self, command: Command) -> None:
        if isinstance(command, Add):
            with self._lock:
                self._requests[command.request_id] = _Pending(
                    command.target, set(range(len(command.choices)))
                )
                self._adds[command.request_id] = command.done
            try:
                self._send(AddRequest(command.request_id, command.choices, command.lora))
            except Exception as exc:
                with self._lock:
                    self._requests.pop(command.request_id, None)
                    self._adds.pop(command.request_id, None)
                _resolve(command.done, exc)
        elif isinstance(command, Abort):
            with self._lock:
                self._requests.pop(command.request_id, None)
            self._send(AbortRequest(command.request_id), quiet=True)
        else:
            self._send(AbortAllRequests(), quiet=True)

    def _send(self, message: object, quiet: bool = False) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (BrokenPipeError, EOFError, OSError):
            if not quiet:
                raise EngineDeadError("the engine process is not running") from None

    # ---- the reader thread ------------------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._receive(message)
            except Exception:
                logger.exception("a message from the engine process failed: %r", message)
        self._end_all()

    def _receive(self, message: object) -> None:
        if isinstance(message, RequestAdded):
            with self._lock:
                done = self._adds.pop(message.request_id, None)
                if message.error is not None:
                    self._requests.pop(message.request_id, None)
            if done is not None:
                _resolve(done, message.error)
            return
        assert isinstance(message, StepOutputs), message
        self.stats = message.stats
        self.num_steps = message.num_steps
        self.num_loop_errors = message.num_loop_errors
        for request_id, index, output, num_new in message.outputs:
            with self._lock:
                pending = self._requests.get(request_id)
                if pending is not None and output.finished:
                    pending.unfinished.discard(index)
                    if not pending.unfinished:
                        del self._requests[request_id]
            if pending is None:
                continue  # aborted here in the meantime
            call_output_hook(self.on_output, output, num_new)
            pending.stream.put(index, output)

    def _end_all(self) -> None:
        """The engine process is gone: what still waits on it ends with an error."""
        code = self._join(5)
        exc = EngineDeadError(f"the engine process exited (exit code {code})")
        with self._lock:
            requests, self._requests = self._requests, {}
            adds, self._adds = self._adds, {}
        for done in adds.values():
            _resolve(done, exc)
        if requests:
            logger.error("%s with %d requests in flight", exc, len(requests))
        for request_id, pending in requests.items():
            for index in sorted(pending.unfinished):
                pending.stream.put(index, final_output(f"{request_id}/{index}", exc))


def _resolve(done: concurrent.futures.Future[None], error: Exception | None) -> None:
    if not done.set_running_or_notify_cancel():
        return  # the caller stopped waiting
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)


if TYPE_CHECKING:  # mypy checks here that the server may take an EngineProcess as its client
    _client: type[EngineClient] = EngineProcess
