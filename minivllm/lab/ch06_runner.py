"""Chapter 06, the ModelRunner: a mixed batch (decodes and prefill chunks) becomes one flat
forward pass. Each token gets a row of `input_ids` and `positions` and a KV slot,
`block_table[pos // block_size] * block_size + pos % block_size`; each sequence's attention
reads the slots of its positions 0 .. seq_len - 1 through its block table; only a sequence
whose prompt is complete after this step gets logits for its last token, and a sample.

Every answer comes from the runner's inputs of the step the learner ran (`step_inputs.py`).

Pure Python: no torch here.
"""

from __future__ import annotations

from minivllm.lab.lesson import Lesson, Observed, Run, State
from minivllm.lab.scenarios import Driver, EngineShape, Scenario
from minivllm.lab.story import Line, ids, line, why_waiting

DECODE_TEXT = "The runner flattens every sequence of the plan"
PROMPT_TEXT = "Slots are computed from the block table and the position of each token"


def _mixed_setup(lab: Driver) -> None:
    """A (5-token prompt) is prefilled and decoding; B's 7-token prompt waits."""
    lab.add_tokens(lab.prompt(DECODE_TEXT, 5), max_tokens=6)
    lab.step()
    lab.add_tokens(lab.prompt(PROMPT_TEXT, 7), max_tokens=4)


def _executed(run: Run, seq_id: int) -> tuple[State, dict, int] | None:
    """The first executed step that ran `seq_id`: its frame, runner inputs and the sequence's
    row in them. Under small budgets or max_num_seqs a sequence may wait a step or more."""
    for frame in run.frames:
        inputs = frame["step_inputs"]
        if frame["frame"]["stage"] == "execute" and inputs and seq_id in inputs["seq_ids"]:
            return frame, inputs, inputs["seq_ids"].index(seq_id)
    return None


def _token_rows(inputs: dict, row: int) -> range:
    """The flat rows of the batch that belong to the sequence at `row`."""
    start = sum(inputs["query_lens"][:row])
    return range(start, start + inputs["query_lens"][row])


# ---- slot: where one token's KV is written --------------------------------------------------


def _slot_ask(start: State) -> dict:
    a, b = start["sequences"]
    return {
        "a": a["seq_id"],
        "b": b["seq_id"],
        "pos": b["num_prompt_tokens"] - 1,
        "bs": start["block_size"],
        "a_table": ", ".join(map(str, a["block_table"])),
    }


def _writes(run: Run, seq_id: int, pos: int) -> tuple[State, dict, int, int] | None:
    """The executed step that wrote `seq_id`'s KV at `pos`: frame, inputs, the sequence's row
    of the batch and the flat row of that token."""
    for frame in run.frames:
        inputs = frame["step_inputs"]
        if frame["frame"]["stage"] != "execute" or not inputs or seq_id not in inputs["seq_ids"]:
            continue
        row = inputs["seq_ids"].index(seq_id)
        for flat in _token_rows(inputs, row):
            if inputs["positions"][flat] == pos:
                return frame, inputs, row, flat
    return None


def _first_plan_wait(run: Run, seq_id: int) -> Line | None:
    """Why the first plan gave `seq_id` nothing, or only part of its prompt (None if all)."""
    plan = run.first("plan")
    if plan is None:
        return None
    seq = next(s for s in plan["sequences"] if s["seq_id"] == seq_id)
    if seq["num_scheduled_tokens"] == 0:
        return line("pre_not_first", seq=seq_id, reason=why_waiting(plan))
    if seq["num_cached_tokens"] + seq["num_scheduled_tokens"] < seq["num_prompt_tokens"]:
        return line("pre_chunked", seq=seq_id, n=seq["num_scheduled_tokens"])
    return None


def _slot_observe(run: Run) -> Observed | None:
    b = run.start["sequences"][1]["seq_id"]
    pos = run.start["sequences"][1]["num_prompt_tokens"] - 1
    found = _writes(run, b, pos)
    if found is None:
        return None
    frame, inputs, row, flat = found
    table = inputs["block_tables"][row]
    slot = inputs["slot_mapping"][flat]
    bs = frame["block_size"]
    used = -(-inputs["seq_lens"][row] // bs)  # the rest of the row is padding
    story = [
        line(
            "slot_formula",
            b=b,
            pos=pos,
            bs=bs,
            block=table[pos // bs],
            offset=pos % bs,
            slot=slot,
            table=ids(table[:used]),
        ),
        line("slot_row", row=flat, rows=len(inputs["input_ids"]), step=frame["step"]),
    ]
    return Observed(
        str(slot), {"slot": slot, "step": frame["step"]}, story, _first_plan_wait(run, b), inputs
    )


# ---- read: which slots a decode's attention reads ---------------------------------------------


def _read_ask(start: State) -> dict:
    a = start["sequences"][0]
    return {
        "a": a["seq_id"],
        "pos": a["num_tokens"] - 1,
        "bs": start["block_size"],
        "a_table": ", ".join(map(str, a["block_table"])),
    }


def _read_observe(run: Run) -> Observed | None:
    a = run.start["sequences"][0]["seq_id"]
    found = _executed(run, a)
    if found is None:
        return None
    frame, inputs, row = found
    slots = inputs["read_slots"][row]
    query = inputs["query_lens"][row]
    story = [
        line(
            "read_slots",
            n=len(slots),
            slots=ids(slots),
            seq_len=inputs["seq_lens"][row],
            last=inputs["seq_lens"][row] - 1,
            query=query,
            step=frame["step"],
        )
    ]
    seq = next(s for s in frame["sequences"] if s["seq_id"] == a)
    decoding = seq["num_cached_tokens"] >= seq["num_prompt_tokens"]
    premise = None if decoding else line("pre_read_prefill", a=a, query=query)
    return Observed(
        str(len(slots)), {"n": len(slots), "step": frame["step"]}, story, premise, inputs
    )


# ---- logits: a chunk that does not end the prompt samples nothing ------------------------------


def _logits_setup(lab: Driver) -> None:
    """A is decoding; B's 12-token prompt waits, and the budget is 8: B gets a chunk."""
    lab.add_tokens(lab.prompt(DECODE_TEXT, 3), max_tokens=8)
    lab.step()
    lab.add_tokens(lab.prompt(PROMPT_TEXT, 12), max_tokens=4)


def _logits_ask(start: State) -> dict:
    a, b = start["sequences"]
    return {
        "a": a["seq_id"],
        "b": b["seq_id"],
        "prompt": b["num_prompt_tokens"],
        "budget": start["budget"]["max_num_batched_tokens"],
    }


def _logits_observe(run: Run) -> Observed | None:
    a, b = (s["seq_id"] for s in run.start["sequences"])
    found = _executed(run, a) or _executed(run, b)
    if found is None:
        return None
    frame, inputs, _ = found
    sampled = inputs["sample_seq_ids"]
    story = [
        line(
            "logits_rows",
            n=len(sampled),
            sampled=ids(sampled) or "-",
            rows=len(inputs["input_ids"]),
            split=" + ".join(map(str, inputs["query_lens"])),
            logits=ids(inputs["logits_indices"]) or "-",
            nl=len(inputs["logits_indices"]),
            step=frame["step"],
        )
    ]
    premise = None
    if b in sampled:
        premise = line("pre_logits_whole", b=b, need=run.start["sequences"][1]["num_prompt_tokens"])
    elif b not in inputs["seq_ids"]:
        premise = _first_plan_wait(run, b)
    else:
        story.append(line("logits_chunk", b=b))
    return Observed(
        str(len(sampled)), {"n": len(sampled), "step": frame["step"]}, story, premise, inputs
    )


CHAPTER_06 = [
    Scenario(
        "slot",
        EngineShape(32, 64),
        _mixed_setup,
        focus=1,
        chapter="06",
        lesson=Lesson("number", _slot_ask, _slot_observe),
    ),
    Scenario(
        "read",
        EngineShape(32, 64),
        _mixed_setup,
        focus=0,
        chapter="06",
        lesson=Lesson("number", _read_ask, _read_observe),
    ),
    Scenario(
        "logits",
        EngineShape(32, 8),
        _logits_setup,
        focus=1,
        chapter="06",
        lesson=Lesson("number", _logits_ask, _logits_observe),
    ),
]
