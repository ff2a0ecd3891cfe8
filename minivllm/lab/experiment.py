"""One lab experiment: a scenario on a fresh engine, its pending plan, its recorded frames.

The experiment drives the engine only through its public calls: `plan()` (Scheduler.schedule),
`execute_and_commit()` (ModelRunner.run, then Scheduler.postprocess), `step()` (both) and
`add_request()`. Every field change the page shows is a TraceEvent recorded by the engine's
own tracer; the experiment adds snapshots ("frames", see `snapshot.py`) of the whole state
after each action, and between the phases inside one action, so time travel never re-runs
the engine. For chapter 06 it also keeps, per step, the runner's inputs of the plan it has
just executed (`step_inputs.py`), and for chapters 04-06 the scenario's lesson (`lesson.py`).

No torch at import: `step_inputs` loads it only once a step runs (the runner has it already).
"""

from __future__ import annotations

import uuid
import zlib
from collections.abc import Callable
from typing import Any

from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.scheduler import ScheduledBatch
from minivllm.engine.sequence import Sequence
from minivllm.engine.tracing import Tracer
from minivllm.lab.lesson import LessonState, PredictionError
from minivllm.lab.scenarios import EngineShape, Scenario
from minivllm.lab.snapshot import Snapshotter, State
from minivllm.lab.step_inputs import step_inputs
from minivllm.sampling_params import SamplingParams

EngineFactory = Callable[[EngineShape, Tracer], LLMEngine]
"""Builds a fresh engine of the given shape that records into the given tracer."""

MAX_LEARNER_TOKENS = 64  # a learner's request: enough to watch, small enough for the pool
MAX_PROMPT_CHARS = 2000


class LabError(Exception):
    """A request the lab refuses: the HTTP status, a stable `code` the page translates (with
    `params` filled into its own words), and an English message."""

    def __init__(self, status: int, code: str, message: str, **params: Any) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.params = params

    def to_dict(self) -> dict[str, Any]:
        return {"error": self.message, "code": self.code, "params": self.params}


class PhaseTracer(Tracer):
    """A Tracer that calls `on_enter(phase)` and `on_exit(phase)` around each engine phase.

    The engine runs `with tracer.phase("plan")`, then `"execute"`, then `"commit"`, so the
    lab photographs the state in between. `on_execute(batch)` hears of each plan the runner
    has just executed.
    """

    def __init__(
        self,
        on_enter: Callable[[str], None],
        on_exit: Callable[[str], None],
        on_execute: Callable[[ScheduledBatch], None],
    ) -> None:
        super().__init__()
        self._on_enter = on_enter
        self._on_exit = on_exit
        self._on_execute = on_execute

    def record_execute(self, batch: Any, output: Any, runner: Any) -> None:
        super().record_execute(batch, output, runner)
        self._on_execute(batch)

    def on_phase_enter(self, name: str) -> None:
        self._on_enter(name)

    def on_phase_exit(self, name: str) -> None:
        self._on_exit(name)


class Experiment:
    """One scenario on one fresh engine: set up, then driven click by click."""

    def __init__(
        self, scenario: Scenario, factory: EngineFactory, shape: EngineShape | None = None
    ) -> None:
        """`shape`: the learner's engine options, else the scenario's own."""
        self.scenario = scenario
        self.id = uuid.uuid4().hex[:12]  # the page keeps a learner's predictions per experiment
        self.tracer = PhaseTracer(self._on_phase_enter, self._on_phase_exit, self._on_execute)
        self.shape = shape or scenario.shape
        self.engine = factory(self.shape, self.tracer)
        self.inputs: dict[int, State] = {}  # step -> the runner's inputs (see step_inputs.py)
        self.block_size = self.engine.config.block_size
        self.seqs: list[Sequence] = []
        self.pending: ScheduledBatch | None = None
        self.frames: list[State] = []
        self._new_frames: list[State] = []
        self._action = "setup"
        self._plan_framed = True
        self._snapshot = Snapshotter(self.engine)
        try:
            scenario.setup(self)  # its frames come first in the timeline; the last is the start
        except LabError as exc:
            raise LabError(
                400,
                "setup_refused",
                f"the scenario cannot run on these engine options: {exc.message}",
                detail=exc.message,
            ) from exc
        self._action = "reset"
        self._setup_frames = len(self.frames)
        self.lesson = (
            None
            if scenario.lesson is None
            else LessonState(scenario.chapter, scenario.lesson, self.frames[-1])
        )

    # ---- the lesson (chapters 04-06) ----------------------------------------------------------

    def predict(self, answer: str) -> None:
        """Lock the learner's prediction; refused once the engine has answered."""
        if self.lesson is None:
            raise LabError(
                409,
                "no_lesson",
                f"scenario {self.scenario.name!r} takes its prediction on the page",
                name=self.scenario.name,
            )
        try:
            self.lesson.predict(answer, self.frames[self._setup_frames :])
        except PredictionError as exc:
            status = 400 if exc.code.startswith("bad_") else 409
            raise LabError(status, exc.code, str(exc), **exc.params) from exc

    def lesson_state(self) -> State | None:
        if self.lesson is None:
            return None
        return self.lesson.to_dict(self.frames[self._setup_frames :])

    # ---- what the scenarios and the learner do ----------------------------------------------

    def prompt(self, text: str, num_tokens: int) -> list[int]:
        """Exactly `num_tokens` prompt tokens: `text` tokenized (repeated if short), or, with no
        tokenizer, deterministic stand-in ids."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            vocab = self.engine.model_runner.vocab_size
            return [2 + zlib.crc32(f"{text}|{i}".encode()) % (vocab - 2) for i in range(num_tokens)]
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        while len(ids) < num_tokens:
            ids += tokenizer.encode(" " + text, add_special_tokens=False)
        return ids[:num_tokens]

    def add_tokens(self, token_ids: list[int], max_tokens: int) -> State:
        """Queue a scenario request: greedy, EOS ignored, so its field sequence is exact."""
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return self._add(token_ids, params)

    def add_text(self, prompt: str, max_tokens: int) -> State:
        """Queue the learner's own request (greedy; stops at EOS like any request)."""
        if not prompt.strip():
            raise LabError(400, "prompt_empty", "the prompt is empty: type a few words")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise LabError(
                400,
                "prompt_too_long",
                f"the prompt is longer than {MAX_PROMPT_CHARS} characters",
                max=MAX_PROMPT_CHARS,
            )
        if not 1 <= max_tokens <= MAX_LEARNER_TOKENS:
            raise LabError(
                400,
                "max_tokens_range",
                f"max_tokens must be between 1 and {MAX_LEARNER_TOKENS}",
                max=MAX_LEARNER_TOKENS,
            )
        if self.engine.tokenizer is None:
            raise LabError(
                400,
                "no_tokenizer",
                "this lab's engine has no tokenizer: it cannot take a text prompt",
            )
        return self._add(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))

    def _add(self, prompt: str | list[int], params: SamplingParams) -> State:
        self._begin("add")
        try:
            seq = self.engine.add_request(prompt, params)
        except ValueError as exc:
            raise LabError(400, "refused", str(exc), detail=str(exc)) from exc
        self.seqs.append(seq)
        self._frame("add")
        return self._answer()

    def plan(self) -> State:
        """Scheduler.schedule only: the plan is written, nothing is executed."""
        if self.pending is not None:
            raise LabError(
                409, "plan_pending", "a plan is already pending: Commit it (execute + commit) first"
            )
        self._check_unfinished()
        self._begin("plan")
        num_events = len(self.tracer.events)
        batch = self.engine.plan()
        if batch.is_empty and len(self.tracer.events) == num_events:
            raise LabError(
                409,
                "nothing_fits",
                "the scheduler planned nothing: no waiting sequence fits the free KV blocks",
            )
        self.pending = None if batch.is_empty else batch
        self._frame("plan")
        return self._answer()

    def commit(self) -> State:
        """ModelRunner.run, then Scheduler.postprocess, on the pending plan."""
        if self.pending is None:
            raise LabError(409, "no_plan", "no plan to commit: click Plan first")
        batch, self.pending = self.pending, None
        self._begin("commit")
        self._plan_framed = True  # the plan was framed when it was made
        self.engine.execute_and_commit(batch)
        self._frame("commit")
        return self._answer()

    def step(self) -> State:
        """One whole LLMEngine.step: plan, execute, commit (what Step does)."""
        if self.pending is not None:
            raise LabError(
                409, "step_pending", "a plan is pending: Commit it first; Step runs a whole step"
            )
        self._check_unfinished()
        self._begin("step")
        self._plan_framed = False
        num_events = len(self.tracer.events)
        self.engine.step()
        if not self._new_frames:  # the plan was empty: execute never started
            if len(self.tracer.events) == num_events:
                raise LabError(
                    409,
                    "nothing_fits",
                    "the scheduler planned nothing: no waiting sequence fits the free KV blocks",
                )
            self._frame("plan")  # it preempted, and scheduled nothing
            return self._answer()
        self._frame("commit")
        return self._answer()

    def _check_unfinished(self) -> None:
        if not self.engine.has_unfinished_requests():
            raise LabError(
                409,
                "all_finished",
                "nothing left to run: every sequence is FINISHED; add a request or reset",
            )

    # ---- frames -----------------------------------------------------------------------------

    def _begin(self, action: str) -> None:
        if self._action != "setup":
            self._action = action
        self._new_frames = []

    def _on_phase_enter(self, name: str) -> None:
        if name == "execute" and not self._plan_framed:  # a whole step: the plan's frame
            self._plan_framed = True
            self._frame("plan")

    def _on_execute(self, batch: ScheduledBatch) -> None:
        self.inputs[self.tracer.step] = step_inputs(batch, self.block_size)

    def _on_phase_exit(self, name: str) -> None:
        if name == "execute":  # the KV written, nothing committed yet
            self._frame("execute")

    def state(self, stage: str) -> State:
        """The engine's state (see `snapshot.py`), with the scenario and the pending plan."""
        focus = self.seqs[self.scenario.focus] if len(self.seqs) > self.scenario.focus else None
        return {
            "experiment": self.id,
            "scenario": self.scenario.name,
            "focus_seq_id": None if focus is None else focus.seq_id,
            **self._snapshot.state(self.seqs, stage),
            "pending_plan": self.pending is not None,
            # The runner's inputs of this step, once it has run (the execute and commit frames).
            "step_inputs": (
                self.inputs.get(self.tracer.step) if stage in ("execute", "commit") else None
            ),
        }

    def _frame(self, stage: str) -> None:
        state = self.state(stage)
        state["frame"] = {"index": len(self.frames), "action": self._action, "stage": stage}
        self.frames.append(state)
        self._new_frames.append(state)

    def _answer(self) -> State:
        """The latest state, plus every frame this action recorded (the last one is it)."""
        return {**self.frames[-1], "frames": list(self._new_frames)}
