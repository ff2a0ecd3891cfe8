"""Chapter 04, the Scheduler: one token budget per step (`max_num_batched_tokens`), spent on
the running sequences first (decodes, unfinished chunks), then on waiting prompts in order of
arrival, a prompt cut into chunks where the budget ends; at most `max_num_seqs` running; and,
when blocks run out, the most recently admitted sequence preempted.

Each scenario's question is answered by the frames of the learner's own clicks.

Pure Python: no torch here.
"""

from __future__ import annotations

from minivllm.lab.lesson import Lesson, Observed, Run, State
from minivllm.lab.scenarios import Driver, EngineShape, Scenario

TEXTS = (
    "Decodes come first in every step of the scheduler",
    "A waiting prompt takes what is left of the token budget",
    "Chunked prefill splits a long prompt over several steps",
    "Only so many sequences may run at once",
)


def _scheduled(frame: State) -> list[int]:
    return [s["num_scheduled_tokens"] for s in frame["sequences"]]


# ---- budget: decodes first, then a waiting prompt gets what is left --------------------------


def _budget_setup(lab: Driver) -> None:
    """A and B are prefilled and decoding; C's 10-token prompt waits."""
    lab.add_tokens(lab.prompt(TEXTS[0], 5), max_tokens=8)
    lab.add_tokens(lab.prompt(TEXTS[1], 3), max_tokens=8)
    lab.step()
    lab.add_tokens(lab.prompt(TEXTS[2], 10), max_tokens=4)


def _budget_ask(start: State) -> dict:
    return {
        "budget": start["budget"]["max_num_batched_tokens"],
        "prompt": Run.seq(start, 2)["num_prompt_tokens"],
        "running": len(start["running"]),
    }


def _budget_observe(run: Run) -> Observed | None:
    plan = run.first("plan")
    if plan is None:
        return None
    a, b, c = _scheduled(plan)
    return Observed(
        str(c), {"a": a, "b": b, "c": c, "budget": plan["budget"]["max_num_batched_tokens"]}
    )


# ---- chunks: how many steps until the second prompt is whole ---------------------------------


def _chunks_setup(lab: Driver) -> None:
    """P (10 tokens) then Q (6 tokens) wait; the budget is 12."""
    lab.add_tokens(lab.prompt(TEXTS[2], 10), max_tokens=6)
    lab.add_tokens(lab.prompt(TEXTS[1], 6), max_tokens=6)


def _chunks_ask(start: State) -> dict:
    return {
        "budget": start["budget"]["max_num_batched_tokens"],
        "p": Run.seq(start, 0)["num_prompt_tokens"],
        "q": Run.seq(start, 1)["num_prompt_tokens"],
    }


def _chunks_observe(run: Run) -> Observed | None:
    """The number of committed steps until Q's whole prompt is cached, and each step's split."""
    splits = []
    for frame in run.frames:
        if frame["frame"]["stage"] == "plan":
            splits.append(_scheduled(frame))
        q = Run.seq(frame, 1)
        if frame["frame"]["stage"] == "commit" and q["num_cached_tokens"] >= q["num_prompt_tokens"]:
            return Observed(
                str(len(splits)),
                {
                    "steps": len(splits),
                    "splits": " | ".join(f"P {p} + Q {q}" for p, q in splits),
                },
            )
    return None


# ---- max_num_seqs: budget left, yet the third request waits ----------------------------------


def _seqs_setup(lab: Driver) -> None:
    """Three short prompts wait; max_num_seqs is 2, the budget ample."""
    for text in TEXTS[:3]:
        lab.add_tokens(lab.prompt(text, 4), max_tokens=4)


def _seqs_ask(start: State) -> dict:
    return {
        "max_num_seqs": start["budget"]["max_num_seqs"],
        "budget": start["budget"]["max_num_batched_tokens"],
        "n": len(start["sequences"]),
    }


def _seqs_observe(run: Run) -> Observed | None:
    plan = run.first("plan")
    if plan is None:
        return None
    ran = [s["seq_id"] for s in plan["sequences"] if s["num_scheduled_tokens"] > 0]
    left = plan["budget"]["max_num_batched_tokens"] - plan["budget"]["planned_tokens"]
    return Observed(
        str(len(ran)),
        {
            "ran": ", ".join(map(str, ran)),
            "left": left,
            "max_num_seqs": plan["budget"]["max_num_seqs"],
        },
    )


# ---- preemption: who is sent back when a decode needs a block --------------------------------


def _victim_setup(lab: Driver) -> None:
    """A, B and C fill every block of a 6-block pool; A's next token needs a new block."""
    bs = lab.block_size
    lab.add_tokens(lab.prompt(TEXTS[0], 2 * bs), max_tokens=6)
    lab.add_tokens(lab.prompt(TEXTS[1], 2 * bs), max_tokens=6)
    lab.add_tokens(lab.prompt(TEXTS[3], 2 * bs - 1), max_tokens=6)
    lab.step()


def _victim_choices(start: State) -> list[str]:
    return [str(s["seq_id"]) for s in start["sequences"]] + ["none"]


def _victim_ask(start: State) -> dict:
    ids = [s["seq_id"] for s in start["sequences"]]
    return {"a": ids[0], "b": ids[1], "c": ids[2], "free": start["num_free_blocks"]}


def _victim_observe(run: Run) -> Observed | None:
    for frame in run.frames:
        if frame["frame"]["stage"] != "plan":
            continue
        before = {s["seq_id"]: s for s in run.start["sequences"]}
        for e in frame["events"][len(run.start["events"]) :]:
            if e["field"] == "status" and e["before"] == "RUNNING" and e["after"] == "WAITING":
                lost = before[e["seq_id"]]
                return Observed(
                    str(e["seq_id"]),
                    {
                        "victim": e["seq_id"],
                        "lost": lost["num_cached_tokens"],
                        "blocks": ", ".join(map(str, lost["block_table"])),
                        "actor": e["actor"],
                    },
                )
        return Observed("none", {"victim": "none", "lost": 0, "blocks": "", "actor": ""})
    return None


CHAPTER_04 = [
    Scenario(
        "budget",
        EngineShape(32, 8),
        _budget_setup,
        focus=2,
        chapter="04",
        lesson=Lesson("number", _budget_ask, _budget_observe),
    ),
    Scenario(
        "chunks",
        EngineShape(32, 12),
        _chunks_setup,
        focus=1,
        chapter="04",
        lesson=Lesson("number", _chunks_ask, _chunks_observe),
    ),
    Scenario(
        "max_seqs",
        EngineShape(32, 64, max_num_seqs=2),
        _seqs_setup,
        focus=2,
        chapter="04",
        lesson=Lesson("number", _seqs_ask, _seqs_observe),
    ),
    Scenario(
        "victim",
        EngineShape(6, 64),
        _victim_setup,
        focus=0,
        chapter="04",
        lesson=Lesson("choice", _victim_ask, _victim_observe, _victim_choices),
    ),
]
