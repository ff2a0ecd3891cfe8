"""Chapter 05, the BlockManager and the prefix cache: a full block's KV, once committed, gets a
hash chained from its parent's; a new prompt that starts with the same blocks takes them
(ref_count grows) and counts their tokens as cached at plan time; a partial last block is
never shared; a freed hashed block stays findable until the free list hands it out again,
least recently freed first.

Each scenario's question is answered by the frames of the learner's own clicks.

Pure Python: no torch here.
"""

from __future__ import annotations

from minivllm.lab.lesson import Lesson, Observed, Run, State
from minivllm.lab.scenarios import Driver, EngineShape, Scenario
from minivllm.lab.story import Line, ids, line, why_waiting

SHARED_TEXT = "The quick brown fox jumps over the lazy dog and runs into the woods"
OTHER_TEXT = "Paged attention keeps the KV cache in blocks"
TAIL_TEXT = " at night"


def _b_at_plan(run: Run) -> tuple[State, State] | None:
    """The first plan frame and, in it, the request B (the second to arrive, or the last)."""
    plan = run.first("plan")
    if plan is None:
        return None
    return plan, plan["sequences"][-1]


def _premise(run: Run, plan: State, b: State) -> Line | None:
    """Why the prefix story may not arise under these options: B was not admitted at this
    plan, or A's prompt was not wholly prefilled (and hashed) before B came."""
    if b["status"] == "WAITING":
        return line("pre_not_admitted", b=b["seq_id"], reason=why_waiting(plan))
    a = run.start["sequences"][0]
    if a["status"] != "FINISHED" and a["num_cached_tokens"] < a["num_prompt_tokens"]:
        return line(
            "pre_a_partial",
            a=a["seq_id"],
            cached=a["num_cached_tokens"],
            prompt=a["num_prompt_tokens"],
        )
    return None


def _cached_observe(run: Run) -> Observed | None:
    """B's num_cached_tokens right after the plan admitted it, and the blocks it took."""
    found = _b_at_plan(run)
    if found is None:
        return None
    plan, b = found
    bs = plan["block_size"]
    shared = b["block_table"][: b["num_cached_tokens"] // bs]
    story = [
        line(
            "cached_took" if shared else "cached_none",
            b=b["seq_id"],
            cached=b["num_cached_tokens"],
            prompt=b["num_prompt_tokens"],
            n=len(shared),
            shared=ids(shared) or "-",
            refs=ids([Run.block(plan, i)["ref_count"] for i in shared]) or "-",
            scheduled=b["num_scheduled_tokens"],
        )
    ]
    return Observed(
        str(b["num_cached_tokens"]),
        {"cached": b["num_cached_tokens"]},
        story,
        _premise(run, plan, b),
    )


def _cached_ask(start: State) -> dict:
    a, b = start["sequences"][0], start["sequences"][-1]
    bs = start["block_size"]
    hashed = [i for i in a["block_table"] if Run.block(start, i)["hash"] is not None]
    return {
        "a": a["seq_id"],
        "b": b["seq_id"],
        "prompt": b["num_prompt_tokens"],
        "a_prompt": a["num_prompt_tokens"],
        "bs": bs,
        "hashed": len(hashed),
    }


# ---- chain: equal blocks behind a different first block are not a hit -----------------------


def _chain_setup(lab: Driver) -> None:
    """A is prefilled (3 full blocks hashed). B's blocks 2 and 3 equal A's; its first differs."""
    bs = lab.block_size
    a = lab.prompt(SHARED_TEXT, 3 * bs + 2)
    lab.add_tokens(a, max_tokens=6)
    lab.step()
    lab.add_tokens(lab.prompt(OTHER_TEXT, bs) + a[bs : 3 * bs] + lab.prompt(TAIL_TEXT, 2), 4)


# ---- reuse: a shared prefix is taken, not recomputed --------------------------------------------


def _reuse_setup(lab: Driver) -> None:
    """A is prefilled; B starts with A's first three blocks and waits."""
    bs = lab.block_size
    a = lab.prompt(SHARED_TEXT, 3 * bs + 2)
    lab.add_tokens(a, max_tokens=6)
    lab.step()
    lab.add_tokens(a[: 3 * bs] + lab.prompt(TAIL_TEXT, 3), max_tokens=4)


def _reuse_ask(start: State) -> dict:
    a = start["sequences"][0]
    first = a["block_table"][0]
    return {**_cached_ask(start), "block": first, "ref_count": Run.block(start, first)["ref_count"]}


def _reuse_observe(run: Run) -> Observed | None:
    found = _b_at_plan(run)
    if found is None:
        return None
    plan, b = found
    first = run.start["sequences"][0]["block_table"][0]
    block = Run.block(plan, first)
    story = [
        line(
            "reuse_held",
            block=first,
            holders=ids(block["seq_ids"]),
            n=len(block["seq_ids"]),
            ref=block["ref_count"],
            b=b["seq_id"],
            cached=b["num_cached_tokens"],
        )
    ]
    return Observed(
        str(block["ref_count"]), {"ref": block["ref_count"]}, story, _premise(run, plan, b)
    )


# ---- partial: the same prompt, yet its last partial block is computed again ------------------


def _partial_setup(lab: Driver) -> None:
    """A is prefilled; B is A's prompt token for token (two full blocks and two tokens)."""
    a = lab.prompt(SHARED_TEXT, 2 * lab.block_size + 2)
    lab.add_tokens(a, max_tokens=6)
    lab.step()
    lab.add_tokens(list(a), max_tokens=4)


# ---- lru: a finished request's blocks are still a hit ----------------------------------------


def _lru_setup(lab: Driver) -> None:
    """A runs and finishes (its blocks freed); C then takes three blocks of the 6-block pool;
    B starts with A's two full blocks."""
    bs = lab.block_size
    a = lab.prompt(SHARED_TEXT, 2 * bs)
    lab.add_tokens(a, max_tokens=2)
    lab.step()
    lab.step()
    lab.add_tokens(lab.prompt(OTHER_TEXT, 3 * bs - 1), max_tokens=2)
    lab.step()
    lab.add_tokens(a + lab.prompt(TAIL_TEXT, 2), max_tokens=2)


def _lru_ask(start: State) -> dict:
    a, c = start["sequences"][0], start["sequences"][1]
    cached_free = [b["block_id"] for b in start["blocks"] if b["free"] and b["hash"] is not None]
    return {
        **_cached_ask(start),
        "c": c["seq_id"],
        "c_blocks": len(c["block_table"]),
        "status": a["status"],
        "cached_free": ", ".join(map(str, cached_free)) or "-",
    }


CHAPTER_05 = [
    Scenario(
        "chain",
        EngineShape(32, 64),
        _chain_setup,
        focus=1,
        chapter="05",
        lesson=Lesson("number", _cached_ask, _cached_observe),
    ),
    Scenario(
        "reuse",
        EngineShape(32, 64),
        _reuse_setup,
        focus=1,
        chapter="05",
        lesson=Lesson("number", _reuse_ask, _reuse_observe),
    ),
    Scenario(
        "partial",
        EngineShape(32, 64),
        _partial_setup,
        focus=1,
        chapter="05",
        lesson=Lesson("number", _cached_ask, _cached_observe),
    ),
    Scenario(
        "lru",
        EngineShape(6, 64),
        _lru_setup,
        focus=2,
        chapter="05",
        lesson=Lesson("number", _lru_ask, _cached_observe),
    ),
]
