"""The engine process's side of `EngineProcess` (engine_process.py): `engine_main` builds the
engine from `EngineStart` and runs an `EngineLoop` whose commands come from, and whose
outputs go to, its end of the socket pair."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import pickle
import signal
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from minivllm.engine.runtime.engine_loop import (
    Abort,
    AbortAll,
    Add,
    Command,
    EngineLoop,
    QueueFullError,
    ShuttingDownError,
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
from minivllm.outputs import RequestOutput
from minivllm.startup import phase, show_progress

logger = logging.getLogger(__name__)


class _PipeCommands:
    """The engine loop's commands, read from the pipe; the others set the loop's state."""

    def __init__(self, conn: Connection, sink: _PipeSink) -> None:
        self._conn = conn
        self._sink = sink
        self.loop: EngineLoop | None = None
        self.stopped = False

    def take(self) -> list[Command]:
        commands: list[Command] = []
        while not self.stopped and self._conn.poll():
            try:
                message = self._conn.recv()
            except (EOFError, OSError):  # the HTTP process went away
                self.stopped = True
                break
            command = self._command(message)
            if command is not None:
                commands.append(command)
        return commands

    def wait(self) -> None:
        if not self.stopped:
            self._conn.poll(None)

    def _command(self, message: object) -> Command | None:
        assert self.loop is not None
        if isinstance(message, AddRequest):
            done: concurrent.futures.Future[None] = concurrent.futures.Future()
            request_id = message.request_id
            done.add_done_callback(
                lambda f: self._sink.send(RequestAdded(request_id, _portable(f.exception())))
            )
            return Add(request_id, message.choices, request_id, done, message.lora)
        if isinstance(message, AbortRequest):
            return Abort(message.request_id)
        if isinstance(message, AbortAllRequests):
            return AbortAll()
        if isinstance(message, StopAccepting):
            self.loop.accepting = False
        elif isinstance(message, SetWaitingLimit):
            self.loop.max_waiting_requests = message.limit
        elif isinstance(message, Shutdown):
            self.stopped = True
        else:
            logger.error("unknown message to the engine process: %r", message)
        return None


class _PipeSink:
    """Outputs batched per step and sent with the stats as one StepOutputs."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._batch: list[tuple[str, int, RequestOutput, int]] = []
        self._sent_stats: dict[str, float] | None = None
        self.loop: EngineLoop | None = None

    def deliver(self, target: str, index: int, output: RequestOutput, num_new: int) -> None:
        self._batch.append((target, index, output, num_new))

    def flush(self) -> None:
        loop = self.loop
        assert loop is not None
        if not self._batch and loop.stats == self._sent_stats:
            return
        batch, self._batch = self._batch, []
        self._sent_stats = loop.stats
        self.send(StepOutputs(batch, loop.stats, loop.num_steps, loop.num_loop_errors))

    def send(self, message: object) -> None:
        try:
            self._conn.send(message)
        except (BrokenPipeError, EOFError, OSError):  # the HTTP process went away
            pass


def _portable(exc: BaseException | None) -> Exception | None:
    """`exc` if it pickles, else the nearest class the HTTP side maps to a status."""
    if exc is None:
        return None
    try:
        pickle.loads(pickle.dumps(exc))
        return exc  # type: ignore[return-value]
    except Exception:
        for kind in (QueueFullError, ShuttingDownError, ValueError, TypeError):
            if isinstance(exc, kind):
                return kind(str(exc))
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _runs_on_the_cpu(engine_options: dict[str, Any]) -> bool:
    """Whether the engine these options build runs on the CPU, outside Triton's interpreter."""
    import torch

    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    device = engine_options.get("device")
    return device == "cpu" or (device is None and not torch.cuda.is_available())


def _name_the_model_in_each_line(model: str | None) -> None:
    """This process's log lines name its model: a server of several models may start several
    at once, and their start-up phases would interleave unnamed."""
    name = (Path(model).name if model else "the default model").replace("%", "%%")
    line = f"%(asctime)s %(levelname)s %(name)s [{name}]: %(message)s"
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter(line))


def engine_main(fd: int) -> None:
    """The engine process, on its end of the socket pair: read EngineStart, build the engine,
    answer EngineReady, run the loop until Shutdown (or until the HTTP process goes away);
    requests still in flight end with "abort"."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    show_progress()
    from minivllm.engine.llm_engine import LLMEngine

    conn = Connection(fd)
    try:
        start = conn.recv()
    except EOFError:  # the HTTP process gave up before sending it
        return
    assert isinstance(start, EngineStart), start
    logging.getLogger().setLevel(start.log_level)
    _name_the_model_in_each_line(start.engine_options.get("model"))
    with phase("importing torch"):
        on_the_cpu = _runs_on_the_cpu(start.engine_options)
    if on_the_cpu:
        # torch's compiler imports triton wherever it is installed (our dev extra installs it
        # for the Triton kernel's CPU tests), and that costs ~85 MB resident; a CPU engine
        # never runs a Triton kernel. None in sys.modules makes `import triton` fail as if
        # absent, which torch and triton_attention take as "no triton".
        if "triton" not in sys.modules:
            sys.modules["triton"] = None  # type: ignore[assignment]  # Python's "not found"
    try:
        engine = LLMEngine.from_options(
            on_resolved=lambda model_dir: conn.send(EngineResolved(str(model_dir))),
            decode_only_tokenizer=True,  # the HTTP side tokenizes the requests
            **start.engine_options,
        )
    except Exception as exc:
        bad_input = exc if isinstance(exc, (ValueError, FileNotFoundError, TypeError)) else None
        conn.send(EngineFailed(f"{type(exc).__name__}: {exc}", _portable(bad_input)))
        return
    sink = _PipeSink(conn)
    commands = _PipeCommands(conn, sink)
    loop = EngineLoop(engine, commands, sink, start.max_waiting_requests)
    sink.loop = commands.loop = loop
    conn.send(
        EngineReady(
            engine.config,
            dict(engine.default_sampling_params),
            engine.model_runner.vocab_size,
        )
    )
    try:
        while not commands.stopped:
            loop.run_once()
        loop.end_all(None)
        sink.flush()
    finally:
        engine.close()
        conn.close()
