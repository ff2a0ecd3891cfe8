"""One lab session: the engine of the current scenario, its pending plan, its recorded frames.

The lab drives the engine only through its public calls: `plan()` (Scheduler.schedule),
`execute_and_commit()` (ModelRunner.run, then Scheduler.postprocess), `step()` (both) and
`add_request()`. Every field change the page shows is a TraceEvent recorded by the engine's
own tracer; the lab adds snapshots ("frames") of the whole state after each action, and
between the phases inside one action, so time travel never re-runs the engine.

Pure Python: no torch here.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable
from typing import Any

from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.scheduler import ScheduledBatch
from minivllm.engine.sequence import Sequence
from minivllm.engine.tracing import Tracer
from minivllm.lab.scenarios import SCENARIOS, EngineShape, Scenario
from minivllm.sampling_params import SamplingParams

EngineFactory = Callable[[EngineShape, Tracer], LLMEngine]
"""Builds a fresh engine of the given shape that records into the given tracer."""

State = dict[str, Any]

MAX_LEARNER_TOKENS = 64  # a learner's request: enough to watch, small enough for the pool

# The order in which a slot's state advances; a shared slot shows its most advanced owner.
_SLOT_ORDER = {"reserved": 0, "planned": 1, "written": 2, "committed": 3}


class LabError(Exception):
    """A request the lab refuses, with the HTTP status to answer it with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class PhaseTracer(Tracer):
    """A Tracer that calls `on_enter(phase)` and `on_exit(phase)` around each engine phase.

    The engine runs `with tracer.phase("plan")`, then `"execute"`, then `"commit"`, so the
    lab photographs the state in between.
    """

    def __init__(self, on_enter: Callable[[str], None], on_exit: Callable[[str], None]) -> None:
        super().__init__()
        self._on_enter = on_enter
        self._on_exit = on_exit

    def on_phase_enter(self, name: str) -> None:
        self._on_enter(name)

    def on_phase_exit(self, name: str) -> None:
        self._on_exit(name)


class Experiment:
    """One scenario on one fresh engine: set up, then driven click by click."""

    def __init__(self, scenario: Scenario, factory: EngineFactory) -> None:
        self.scenario = scenario
        self.tracer = PhaseTracer(self._on_phase_enter, self._on_phase_exit)
        self.engine = factory(scenario.shape, self.tracer)
        self.block_size = self.engine.config.block_size
        self.seqs: list[Sequence] = []
        self.pending: ScheduledBatch | None = None
        self.frames: list[State] = []
        self._new_frames: list[State] = []
        self._action = "setup"
        self._plan_framed = True
        self._pieces: dict[int, str] = {}
        scenario.setup(self)  # its frames are the first of the timeline; the last is the start
        self._action = "reset"

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
        if self.engine.tokenizer is None:
            raise LabError(400, "this lab's engine has no tokenizer: it cannot take a text prompt")
        if not prompt.strip():
            raise LabError(400, "the prompt is empty: type a few words")
        if not 1 <= max_tokens <= MAX_LEARNER_TOKENS:
            raise LabError(400, f"max_tokens must be between 1 and {MAX_LEARNER_TOKENS}")
        return self._add(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))

    def _add(self, prompt: str | list[int], params: SamplingParams) -> State:
        self._begin("add")
        try:
            seq = self.engine.add_request(prompt, params)
        except ValueError as exc:
            raise LabError(400, str(exc)) from exc
        self.seqs.append(seq)
        self._frame("add")
        return self._answer()

    def plan(self) -> State:
        """Scheduler.schedule only: the plan is written, nothing is executed."""
        if self.pending is not None:
            raise LabError(409, "a plan is already pending: Commit it (execute + commit) first")
        self._begin("plan")
        num_events = len(self.tracer.events)
        batch = self.engine.plan()
        if batch.is_empty and len(self.tracer.events) == num_events:
            raise LabError(409, self._why_nothing_planned())
        self.pending = None if batch.is_empty else batch
        self._frame("plan")
        return self._answer()

    def commit(self) -> State:
        """ModelRunner.run, then Scheduler.postprocess, on the pending plan."""
        if self.pending is None:
            raise LabError(409, "no plan to commit: click Plan first")
        batch, self.pending = self.pending, None
        self._begin("commit")
        self._plan_framed = True  # the plan was framed when it was made
        self.engine.execute_and_commit(batch)
        self._frame("commit")
        return self._answer()

    def step(self) -> State:
        """One whole LLMEngine.step: plan, execute, commit (what Decode does)."""
        if self.pending is not None:
            raise LabError(409, "a plan is pending: Commit it first; Decode runs a whole step")
        if not self.engine.has_unfinished_requests():
            raise LabError(409, "nothing left to run: every sequence is FINISHED")
        self._begin("step")
        self._plan_framed = False
        num_events = len(self.tracer.events)
        self.engine.step()
        if not self._new_frames:  # the plan was empty: execute never started
            if len(self.tracer.events) == num_events:
                raise LabError(409, self._why_nothing_planned())
            self._frame("plan")  # it preempted, and scheduled nothing
            return self._answer()
        self._frame("commit")
        return self._answer()

    def _why_nothing_planned(self) -> str:
        if not self.engine.has_unfinished_requests():
            return "nothing to plan: every sequence is FINISHED; add a request or reset"
        return "the scheduler planned nothing: no waiting sequence fits the free KV blocks"

    # ---- frames -----------------------------------------------------------------------------

    def _begin(self, action: str) -> None:
        if self._action != "setup":
            self._action = action
        self._new_frames = []

    def _on_phase_enter(self, name: str) -> None:
        if name == "execute" and not self._plan_framed:  # a whole step: the plan's frame
            self._plan_framed = True
            self._frame("plan")

    def _on_phase_exit(self, name: str) -> None:
        if name == "execute":  # the KV written, nothing committed yet
            self._frame("execute")

    def _frame(self, stage: str) -> None:
        state = self.state(stage)
        state["frame"] = {"index": len(self.frames), "action": self._action, "stage": stage}
        self.frames.append(state)
        self._new_frames.append(state)

    def _answer(self) -> State:
        """The latest state, plus every frame this action recorded (the last one is it)."""
        return {**self.frames[-1], "frames": list(self._new_frames)}

    # ---- the state the page draws -------------------------------------------------------------

    def state(self, stage: str) -> State:
        engine = self.engine
        scheduler = engine.scheduler
        bm = scheduler.block_manager
        focus = self.seqs[self.scenario.focus] if len(self.seqs) > self.scenario.focus else None
        events = [{"index": i, **e.to_dict()} for i, e in enumerate(self.tracer.events)]
        return {
            "scenario": self.scenario.name,
            "focus_seq_id": None if focus is None else focus.seq_id,
            "model": {
                "runner": type(engine.model_runner).__name__,
                "model": engine.config.model or "default",
                "tokenizer": engine.tokenizer is not None,
            },
            "step": self.tracer.step,
            "sequences": [self._sequence(s, stage) for s in self.seqs],
            "waiting": [s.seq_id for s in scheduler.waiting],
            "running": [s.seq_id for s in scheduler.running],
            "block_size": bm.block_size,
            "num_blocks": bm.num_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "blocks": self._blocks(),
            "pending_plan": self.pending is not None,
            "budget": {
                "max_num_batched_tokens": engine.config.max_num_batched_tokens,
                "planned_tokens": sum(s.num_scheduled_tokens for s in scheduler.running),
            },
            "events": events,
        }

    def _sequence(self, seq: Sequence, stage: str) -> State:
        sampled = None
        if stage == "execute":  # sampled by the runner, appended only by the commit
            for e in self.tracer.events:
                if e.step == self.tracer.step and e.seq_id == seq.seq_id:
                    if e.field == "sampled_token":
                        sampled = e.after
        return {
            "seq_id": seq.seq_id,
            "status": seq.status.name,
            "num_tokens": seq.num_tokens,
            "num_prompt_tokens": seq.num_prompt_tokens,
            "num_cached_tokens": seq.num_cached_tokens,
            "num_scheduled_tokens": seq.num_scheduled_tokens,
            "block_table": list(seq.block_table),
            "token_ids": list(seq.token_ids),
            "text": self._decode(seq.token_ids),
            "prompt_text": self._decode(seq.prompt_token_ids),
            "completion_text": self._decode(seq.completion_token_ids),
            "pieces": self._pieces_of(seq.token_ids),
            "finish_reason": seq.finish_reason,
            "max_tokens": seq.sampling_params.max_tokens,
            "num_preemptions": seq.num_preemptions,
            "sampled_token": sampled,
            "sampled_piece": None if sampled is None else self._piece(sampled),
        }

    def _decode(self, token_ids: list[int]) -> str | None:
        tokenizer = self.engine.tokenizer
        return None if tokenizer is None else tokenizer.decode(token_ids)

    def _piece(self, token_id: int) -> str | None:
        if self.engine.tokenizer is None:
            return None
        if token_id not in self._pieces:
            self._pieces[token_id] = self.engine.tokenizer.decode([token_id])
        return self._pieces[token_id]

    def _pieces_of(self, token_ids: list[int]) -> list[str] | None:
        if self.engine.tokenizer is None:
            return None
        return [self._piece(t) or "" for t in token_ids]

    def _written(self) -> dict[int, tuple[int, int]]:
        """Per sequence, the positions the runner wrote in this step ([start, end))."""
        out = {}
        for e in self.tracer.events:
            if e.step == self.tracer.step and e.field == "kv_written":
                out[e.seq_id] = (e.before, e.after)
        return out

    def _blocks(self) -> list[State]:
        bm = self.engine.scheduler.block_manager
        bs = bm.block_size
        written = self._written()
        slots: dict[int, State] = {}  # slot -> what it holds
        for seq in self.seqs:
            for logical, block_id in enumerate(seq.block_table):
                for offset in range(bs):
                    pos = logical * bs + offset
                    state = _slot_state(seq, pos, written.get(seq.seq_id))
                    slot = slots.setdefault(block_id * bs + offset, {"state": state, "owners": []})
                    if _SLOT_ORDER[state] > _SLOT_ORDER[slot["state"]]:
                        slot["state"] = state
                    token = seq.token_ids[pos] if pos < seq.num_tokens else None
                    slot["owners"].append({"seq_id": seq.seq_id, "pos": pos, "token_id": token})
        blocks = []
        for block in bm.blocks:
            block_slots = []
            for offset in range(bs):
                n = block.block_id * bs + offset
                held = slots.get(n)
                if held is not None:
                    token = held["owners"][0]["token_id"]
                    entry = {"state": held["state"], "owners": held["owners"], "token_id": token}
                elif block.hash is not None:  # free, but its committed KV can still be reused
                    entry = {"state": "cached", "owners": [], "token_id": block.token_ids[offset]}
                else:
                    entry = {"state": "free", "owners": [], "token_id": None}
                block_slots.append({"slot": n, "offset": offset, **entry})
            owners = sorted({o["seq_id"] for s in block_slots for o in s["owners"]})
            blocks.append(
                {
                    "block_id": block.block_id,
                    "ref_count": block.ref_count,
                    "hash": None if block.hash is None else f"{block.hash:016x}",
                    "seq_ids": owners,
                    "free": block.ref_count == 0,
                    "slots": block_slots,
                }
            )
        return blocks


def _slot_state(seq: Sequence, pos: int, written: tuple[int, int] | None) -> str:
    if pos < seq.num_cached_tokens:
        return "committed"
    if pos < seq.num_cached_tokens + seq.num_scheduled_tokens:
        if written is not None and written[0] <= pos < written[1]:
            return "written"  # the runner wrote its KV; postprocess has not committed it
        return "planned"
    return "reserved"


class Lab:
    """The current experiment behind one lock: HTTP requests may arrive concurrently."""

    def __init__(self, factory: EngineFactory, default_scenario: str = "seq8") -> None:
        self._factory = factory
        self._default = default_scenario
        self._lock = threading.Lock()
        self._experiment: Experiment | None = None

    def _current(self) -> Experiment:
        if self._experiment is None:
            self._experiment = Experiment(SCENARIOS[self._default], self._factory)
        return self._experiment

    def reset(self, scenario: str) -> State:
        if scenario not in SCENARIOS:
            known = ", ".join(SCENARIOS)
            raise LabError(400, f"unknown scenario {scenario!r}; choose one of: {known}")
        with self._lock:
            # Built aside and swapped in only once set up: a failure keeps the old one.
            experiment = Experiment(SCENARIOS[scenario], self._factory)
            self._experiment = experiment
            return {**experiment.frames[-1], "frames": list(experiment.frames)}

    def state(self) -> State:
        with self._lock:
            return self._current().frames[-1]

    def history(self) -> list[State]:
        with self._lock:
            return list(self._current().frames)

    def plan(self) -> State:
        with self._lock:
            return self._current().plan()

    def commit(self) -> State:
        with self._lock:
            return self._current().commit()

    def step(self) -> State:
        with self._lock:
            return self._current().step()

    def add(self, prompt: str, max_tokens: int) -> State:
        with self._lock:
            return self._current().add_text(prompt, max_tokens)
