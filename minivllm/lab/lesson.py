"""A scenario's lesson, graded on the server: a question asked of the state after the setup,
the learner's prediction (locked once made), and the engine's answer read from the frames the
learner's clicks recorded.

The lesson never runs the engine and never guesses: `observe` reads what the real scheduler,
block manager and runner did (their fields, block ref counts and hashes, the runner's step
inputs), and answers None until the learner has run far enough for the answer to exist. The
question and the explanation are words of the page; the lesson gives their numbers.

Pure Python: no torch here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from minivllm.lab.story import Line

State = dict[str, Any]
MAX_NUMBER = 1_000_000  # a numeric prediction above this is a typo, not a guess


@dataclass(frozen=True)
class Run:
    """What a lesson reads: the state the learner started from and the frames recorded since
    (in order, each a snapshot; `sequences` in order of arrival)."""

    start: State
    frames: list[State]

    def first(self, stage: str) -> State | None:
        """The first frame the learner's clicks recorded at `stage` ("plan", "execute", ...)."""
        return next((f for f in self.frames if f["frame"]["stage"] == stage), None)

    @staticmethod
    def seq(frame: State, index: int) -> State:
        """The `index`-th request of the scenario (in order of arrival) in `frame`."""
        return frame["sequences"][index]

    @staticmethod
    def block(frame: State, block_id: int) -> State:
        return frame["blocks"][block_id]


@dataclass(frozen=True)
class Observed:
    """The engine's answer (compared with the prediction as text), its numbers, and the
    explanation built from the frames: `story` (lines, see `story.py`), `premise` (a line
    saying the lesson's situation did not arise under these options, and which options make
    it arise; None when it did), `inputs` (the runner's inputs of the step it describes)."""

    answer: str
    params: dict[str, Any]
    story: list[Line] = field(default_factory=list)
    premise: Line | None = None
    inputs: dict[str, Any] | None = None


@dataclass(frozen=True)
class Lesson:
    """One question: `kind` "number" (an integer typed in) or "choice" (one of `choices`)."""

    kind: str
    ask: Callable[[State], dict[str, Any]]  # the question's numbers, from the start state
    observe: Callable[[Run], Observed | None]
    choices: Callable[[State], list[str]] | None = None
    # The answer depends on the model's tokens (how many drafts it accepts), not on the
    # engine's rules alone: another model may answer otherwise.
    depends_on_model: bool = False


class PredictionError(ValueError):
    """A prediction the lesson cannot take: `code` is the page's key for the message."""

    def __init__(self, code: str, message: str, **params: Any) -> None:
        super().__init__(message)
        self.code = code
        self.params = params


class LessonState:
    """A lesson played once: the prediction is taken before the answer exists, then locked."""

    def __init__(self, chapter: str, lesson: Lesson, start: State) -> None:
        self.chapter = chapter
        self.lesson = lesson
        self.start = start
        self.question = lesson.ask(start)
        self.choices = None if lesson.choices is None else lesson.choices(start)
        self.prediction: str | None = None

    def predict(self, answer: str, frames: list[State]) -> None:
        if self.prediction is not None:
            raise PredictionError(
                "prediction_locked",
                f"the prediction is locked: {self.prediction!r}; reset to try again",
                answer=self.prediction,
            )
        if self.lesson.observe(Run(self.start, frames)) is not None:
            raise PredictionError(
                "too_late",
                "the engine has already answered this question: "
                "reset the scenario to predict first",
            )
        self.prediction = self._normalize(answer)

    def _normalize(self, answer: str) -> str:
        text = answer.strip()
        if self.lesson.kind == "choice":
            assert self.choices is not None
            if text not in self.choices:
                raise PredictionError(
                    "bad_choice",
                    f"choose one of: {', '.join(self.choices)}",
                    choices=", ".join(self.choices),
                )
            return text
        if not text.lstrip("-").isdigit() or not 0 <= int(text) <= MAX_NUMBER:
            raise PredictionError(
                "bad_number", f"type a whole number from 0 to {MAX_NUMBER}", max=MAX_NUMBER
            )
        return str(int(text))

    def to_dict(self, frames: list[State]) -> State:
        observed = self.lesson.observe(Run(self.start, frames))
        result = None
        if observed is not None:
            correct = None if self.prediction is None else self.prediction == observed.answer
            result = {
                "answer": observed.answer,
                "correct": correct,
                "params": observed.params,
                "story": observed.story,
                "premise": observed.premise,
                "inputs": observed.inputs,
            }
        return {
            "chapter": self.chapter,
            "kind": self.lesson.kind,
            "question": self.question,
            "choices": self.choices,
            "prediction": self.prediction,
            "result": result,
        }
