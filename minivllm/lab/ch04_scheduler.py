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
from minivllm.lab.story import ids, kind, line, plan_lines, split

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
    running = [s for s in start["sequences"] if s["status"] == "RUNNING"]
    decoding = sum(1 for s in running if kind({**s, "num_scheduled_tokens": 1}) == "decode")
    return {
        "budget": start["budget"]["max_num_batched_tokens"],
        "prompt": Run.seq(start, 2)["num_prompt_tokens"],
        "c": Run.seq(start, 2)["seq_id"],
        "running": len(running),
        "decoding": decoding,
        "prefilling": len(running) - decoding,
        "variant": "decoding" if decoding == len(running) else "mixed",
    }


def _budget_observe(run: Run) -> Observed | None:
    plan = run.first("plan")
    if plan is None:
        return None
    c = Run.seq(plan, 2)
    budget = plan["budget"]["max_num_batched_tokens"]
    first = sum(s["num_scheduled_tokens"] for s in plan["sequences"][:2])
    got = c["num_scheduled_tokens"]
    story = [
        *plan_lines(plan),
        line("budget_sum", budget=budget, used=first, left=budget - first, c=c["seq_id"], got=got),
    ]
    if 0 < got < c["num_prompt_tokens"]:
        story.append(line("budget_rest", rest=c["num_prompt_tokens"] - got))
    premise = None
    if got >= c["num_prompt_tokens"]:
        premise = line("pre_budget_fits", c=c["seq_id"], need=first + got - 1)
    return Observed(str(got), {"c": c["seq_id"], "got": got, "budget": budget}, story, premise)


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
        "p_id": Run.seq(start, 0)["seq_id"],
        "q_id": Run.seq(start, 1)["seq_id"],
    }


def _chunks_observe(run: Run) -> Observed | None:
    """The number of committed steps until Q's whole prompt is cached, and each step's split."""
    plans: list[State] = []
    for frame in run.frames:
        if frame["frame"]["stage"] == "plan":
            plans.append(frame)
        q = Run.seq(frame, 1)
        if frame["frame"]["stage"] == "commit" and q["num_cached_tokens"] >= q["num_prompt_tokens"]:
            story = [line("chunk_step", i=i + 1, split=split(p)) for i, p in enumerate(plans)]
            story.append(line("chunks_done", q=q["seq_id"], steps=len(plans)))
            premise = None
            if not any(
                kind(s) == "chunk"
                for p in plans
                for s in p["sequences"]
                if s["num_scheduled_tokens"]
            ):
                total = q["num_prompt_tokens"] + Run.seq(frame, 0)["num_prompt_tokens"]
                premise = line("pre_chunks_none", need=total - 1)
            else:
                story.append(line("chunks_rule"))
            return Observed(
                str(len(plans)), {"steps": len(plans), "q": q["seq_id"]}, story, premise
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
    budget = plan["budget"]
    left = budget["max_num_batched_tokens"] - budget["planned_tokens"]
    most = budget["max_num_seqs"]
    story = [*plan_lines(plan), line("seqs_sum", n=len(ran), ran=ids(ran) or "-", left=left)]
    waiting = len(plan["sequences"]) - len(ran)
    premise = None
    if waiting == 0:
        premise = line("pre_seqs_none", n=len(ran), most=most, need=len(ran) - 1)
    elif len(plan["running"]) < most:
        premise = line("pre_seqs_budget", most=most)
    return Observed(str(len(ran)), {"ran": ids(ran), "left": left, "most": most}, story, premise)


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
    ids_ = [s["seq_id"] for s in start["sequences"]]
    free, n = start["num_free_blocks"], len(start["blocks"])
    return {
        "a": ids_[0],
        "b": ids_[1],
        "c": ids_[2],
        "free": free,
        "held": n - free,
        "n": n,
        "variant": "full" if free == 0 else "room",
    }


def _victim_observe(run: Run) -> Observed | None:
    plan = run.first("plan")
    if plan is None:
        return None
    before = {s["seq_id"]: s for s in run.start["sequences"]}
    for e in plan["events"][len(run.start["events"]) :]:
        if e["field"] == "status" and e["before"] == "RUNNING" and e["after"] == "WAITING":
            lost = before[e["seq_id"]]
            blocks = ids(lost["block_table"])
            story = [
                line(
                    "victim_done",
                    victim=e["seq_id"],
                    lost=lost["num_cached_tokens"],
                    blocks=blocks,
                    n=len(lost["block_table"]),
                ),
                *plan_lines(plan),
            ]
            return Observed(str(e["seq_id"]), {"victim": e["seq_id"]}, story)
    free, n = run.start["num_free_blocks"], len(run.start["blocks"])
    premise = line("pre_victim_none", free=free, n=n, need=max(1, n - free))
    return Observed("none", {"victim": "none"}, plan_lines(plan), premise)


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
