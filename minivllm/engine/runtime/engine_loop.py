"""EngineLoop: the runtime's side that owns an LLMEngine and steps it for a server.

It runs on one thread: the engine thread of an in-process server (`AsyncLLMEngine`), or the
main thread of the engine process (`engine_process`). The contract:
- Commands (add, abort, abort all) come from a `CommandSource` and are applied between steps,
  never during one.
- The loop steps while work exists and waits on the source when idle.
- Each step's token outputs go through the `OutputProcessor` (text, stop strings, logprob
  texts) at once, before the next plan, so a stop string ends its request where it is found.
- Each committed output goes to the `OutputSink` with the request's `target` (whatever the
  caller attached to the add: an asyncio stream, or a request id to send back), the choice's
  index, and how many tokens it adds; the sink's `flush` runs after each step and before the
  loop waits, so a sink may batch.
- Nothing a request does can stop the loop: ModelRunner faults end the failed batch's
  requests with finish_reason "error" (the engine does that); any other exception from a step
  ends every in-flight request with "error" and the loop keeps serving.
- With a StepRecorder (`minivllm serve --lab`), the recorder runs each step (the same plan,
  execute and commit) so it can note the plan, and photographs the engine after the commit,
  between steps; without one, nothing is recorded.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from minivllm.engine import requests
from minivllm.engine.engine_output import EngineOutput
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.requests import Choice
from minivllm.engine.runtime.output_processor import OutputProcessor
from minivllm.engine.sequence import FinishReason
from minivllm.engine.stat_logger import StatLogger
from minivllm.lora_request import LoRARequest
from minivllm.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The waiting queue is at its limit: the server is overloaded (HTTP 503)."""


class ShuttingDownError(Exception):
    """The server is shutting down and takes no new requests (HTTP 503)."""


class EngineDeadError(Exception):
    """The engine loop is not running: it was stopped, or its process died (HTTP 503)."""


@dataclass
class Add:
    """Add a request's choices, all or none; `done` gets None or the exception."""

    request_id: str
    choices: list[Choice]
    target: Any  # handed back to the sink with each of the request's outputs
    done: concurrent.futures.Future[None]
    lora: LoRARequest | None = None  # the LoRA adapter all choices run under (None: the base)


@dataclass
class Abort:
    """End a request's unfinished choices (a client that went away); no output follows."""

    request_id: str


@dataclass
class AbortAll:
    """End every in-flight request with finish_reason "abort" (the end of a graceful shutdown)."""


Command = Add | Abort | AbortAll


class CommandSource(Protocol):
    def take(self) -> list[Command]:
        """The commands sent since the last call, without waiting."""
        ...

    def wait(self) -> None:
        """Block until a command may have arrived (or the loop should stop)."""
        ...


class OutputSink(Protocol):
    def deliver(self, target: Any, index: int, output: RequestOutput, num_new: int) -> None:
        """One choice's cumulative output; `num_new` tokens were committed since the last."""
        ...

    def flush(self) -> None:
        """The step's outputs are all delivered (a sink that batches sends them now)."""
        ...


class StepRecorder(Protocol):
    """Watches the engine on the engine thread (the lab's live view, `minivllm.lab.live`).
    `request_ids` maps the engine's seq_id to the request's id ("<request_id>/<index>")."""

    def step(self, engine: LLMEngine, request_ids: Mapping[int, str]) -> list[EngineOutput]:
        """One `engine.step()` (plan, then execute and commit), recorded."""
        ...

    def snapshot(self, engine: LLMEngine, request_ids: Mapping[int, str]) -> None:
        """Record the engine as it stands between steps (no step ran)."""
        ...


class ThreadCommands:
    """Commands from other threads of this process: a lock-guarded list and a wake-up event."""

    def __init__(self) -> None:
        self._commands: list[Command] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()

    def send(self, command: Command | None) -> None:
        """Queue a command (None only wakes the loop, to see that it should stop)."""
        with self._lock:
            if command is not None:
                self._commands.append(command)
            self._wake.set()

    def take(self) -> list[Command]:
        with self._lock:
            commands, self._commands = self._commands, []
            self._wake.clear()  # a send after this sets it again: wait() cannot miss it
        return commands

    def wait(self) -> None:
        self._wake.wait()


@dataclass
class _Sub:
    """One sequence of a request (a choice: n > 1 or several prompts make several)."""

    sub_id: str  # the engine's request_id: "<request_id>/<index>"
    request_id: str
    index: int  # the choice index
    seq_id: int
    num_tokens: int = 0  # completion tokens delivered so far


@dataclass
class _Request:
    target: Any
    sub_ids: set[str] = field(default_factory=set)  # its unfinished sub-requests


class EngineLoop:
    """Steps `engine` and applies `commands` between steps; outputs go to `sink`."""

    def __init__(
        self,
        engine: LLMEngine,
        commands: CommandSource,
        sink: OutputSink,
        max_waiting_requests: int | None = None,
        recorder: StepRecorder | None = None,
    ) -> None:
        self.engine = engine
        self.output_processor = OutputProcessor(engine)  # the engine's tokens made text
        self.commands = commands
        self.sink = sink
        self.max_waiting_requests = max_waiting_requests
        self.recorder = recorder
        self.accepting = True  # cleared by the owner when a shutdown begins
        self._requests: dict[str, _Request] = {}
        self._subs: dict[str, _Sub] = {}
        # A copy of engine.stats(), refreshed after every step, so that readers on other
        # threads never walk the scheduler's structures while they change.
        self.stats: dict[str, float] = dict(engine.stats())
        self.num_steps = 0
        self.num_loop_errors = 0
        self.stat_logger = StatLogger()  # the periodic "Running: ... reqs" line

    def run_once(self) -> None:
        """Apply the pending commands, then one engine step (or wait until a command comes);
        a step that raises ends every in-flight request with "error"."""
        try:
            self._run_once()
        except Exception as exc:  # a bug below the runner: fail what is in flight, go on
            logger.exception("engine step failed; ending all in-flight requests")
            self.num_loop_errors += 1
            self.end_all(exc)
        self.sink.flush()

    def _run_once(self) -> None:
        commands = self.commands.take()
        for command in commands:
            self._apply(command)
        if not self.engine.has_unfinished_requests():
            self.stats = dict(self.engine.stats())
            if commands and self.recorder is not None:  # an abort may have emptied the queues
                self.recorder.snapshot(self.engine, self._request_ids())
            if not commands:
                self.sink.flush()
                self.commands.wait()
            return
        if self.recorder is None:
            step_outputs = self.engine.step()
        else:
            step_outputs = self.recorder.step(self.engine, self._request_ids())
        outputs = self.output_processor.process(step_outputs)  # before the next plan
        self.num_steps += 1
        self.stats = dict(self.engine.stats())
        self.stat_logger.record(self.stats)
        for output in outputs:
            self._deliver(output)

    def num_tracked(self) -> tuple[int, int]:
        """(requests, sub-requests) the loop still tracks: both 0 once idle."""
        return len(self._requests), len(self._subs)

    def refuse_pending(self) -> None:
        """At shutdown: adds that arrived too late fail with ShuttingDownError."""
        for command in self.commands.take():
            if isinstance(command, Add) and command.done.set_running_or_notify_cancel():
                command.done.set_exception(ShuttingDownError("the server is shutting down"))

    def _request_ids(self) -> dict[int, str]:
        return {sub.seq_id: sub.sub_id for sub in self._subs.values()}

    def _apply(self, command: Command) -> None:
        if isinstance(command, AbortAll):
            self.end_all(None)
            return
        if isinstance(command, Abort):
            request = self._requests.pop(command.request_id, None)
            for sub_id in request.sub_ids if request is not None else ():
                self._abort(self._subs.pop(sub_id).seq_id)
            return
        if not command.done.set_running_or_notify_cancel():
            return  # the caller stopped waiting before the add was applied
        try:
            self._add(command)
        except Exception as exc:
            command.done.set_exception(exc)
        else:
            command.done.set_result(None)

    def _add(self, command: Add) -> None:
        if not self.accepting:  # a shutdown began while this add was on its way
            raise ShuttingDownError("the server is shutting down; retry on another instance")
        waiting = self.engine.stats()["num_requests_waiting"]
        limit = self.max_waiting_requests
        if limit is not None and waiting + len(command.choices) > limit:
            raise QueueFullError(
                f"the server is overloaded: {int(waiting)} requests are waiting "
                f"(limit {limit}); retry later"
            )
        sub_ids = [f"{command.request_id}/{i}" for i in range(len(command.choices))]
        loras = [command.lora] * len(command.choices)
        seqs = requests.add_all(self.engine, command.choices, sub_ids, loras)  # all or none
        request = _Request(command.target)
        for index, (sub_id, seq) in enumerate(zip(sub_ids, seqs)):
            self._subs[sub_id] = _Sub(sub_id, command.request_id, index, seq.seq_id)
            request.sub_ids.add(sub_id)
        self._requests[command.request_id] = request

    def _deliver(self, output: RequestOutput) -> None:
        sub = self._subs.get(output.request_id)
        if sub is None:
            return  # aborted in the meantime
        request = self._requests[sub.request_id]
        num_tokens = len(output.outputs[0].token_ids)
        self.sink.deliver(request.target, sub.index, output, num_tokens - sub.num_tokens)
        sub.num_tokens = num_tokens
        if output.finished:
            del self._subs[sub.sub_id]
            request.sub_ids.discard(sub.sub_id)
            if not request.sub_ids:
                del self._requests[sub.request_id]

    def _abort(self, seq_id: int) -> None:
        self.engine.abort_request(seq_id)
        self.output_processor.abort(seq_id)

    def end_all(self, exc: Exception | None) -> None:
        """Abort every in-flight sub-request and deliver its final output: "error" after a
        failed step (`exc`), "abort" at shutdown (`exc` None)."""
        for sub in list(self._subs.values()):
            try:
                self._abort(sub.seq_id)
            except Exception:  # the engine is already broken; the client must still hear
                logger.exception("abort of %s failed", sub.sub_id)
            self._deliver(final_output(sub.sub_id, exc))


def final_output(sub_id: str, exc: Exception | None) -> RequestOutput:
    """The last output of a choice the server ended: "abort" at shutdown, else "error"."""
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
