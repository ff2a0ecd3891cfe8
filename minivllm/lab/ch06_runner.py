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

DECODE_TEXT = "The runner flattens every sequence of the plan"
PROMPT_TEXT = "Slots are computed from the block table and the position of each token"


def _mixed_setup(lab: Driver) -> None:
    """A (5-token prompt) is prefilled and decoding; B's 7-token prompt waits."""
    lab.add_tokens(lab.prompt(DECODE_TEXT, 5), max_tokens=6)
    lab.step()
    lab.add_tokens(lab.prompt(PROMPT_TEXT, 7), max_tokens=4)


def _inputs(run: Run) -> tuple[State, dict] | None:
    """The first executed step's frame and its runner inputs."""
    frame = run.first("execute")
    if frame is None or frame["step_inputs"] is None:
        return None
    return frame, frame["step_inputs"]


def _row(inputs: dict, seq_id: int) -> int:
    return inputs["seq_ids"].index(seq_id)


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


def _slot_observe(run: Run) -> Observed | None:
    found = _inputs(run)
    if found is None:
        return None
    frame, inputs = found
    b = run.start["sequences"][1]["seq_id"]
    pos = run.start["sequences"][1]["num_prompt_tokens"] - 1
    table = inputs["block_tables"][_row(inputs, b)]
    start = sum(inputs["query_lens"][: _row(inputs, b)])
    rows = inputs["positions"][start : start + inputs["query_lens"][_row(inputs, b)]]
    slot = inputs["slot_mapping"][start + rows.index(pos)]
    bs = frame["block_size"]
    return Observed(
        str(slot),
        {
            "slot": slot,
            "pos": pos,
            "bs": bs,
            "block": table[pos // bs],
            "offset": pos % bs,
            "index": pos // bs,
            "table": ", ".join(map(str, table)),
            "row": start + rows.index(pos),
            "rows": len(inputs["input_ids"]),
        },
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
    found = _inputs(run)
    if found is None:
        return None
    _, inputs = found
    a = run.start["sequences"][0]["seq_id"]
    slots = inputs["read_slots"][_row(inputs, a)]
    return Observed(
        str(len(slots)),
        {
            "n": len(slots),
            "slots": ", ".join(map(str, slots)),
            "seq_len": inputs["seq_lens"][_row(inputs, a)],
            "query_len": inputs["query_lens"][_row(inputs, a)],
        },
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
    found = _inputs(run)
    if found is None:
        return None
    _, inputs = found
    sampled = inputs["sample_seq_ids"]
    return Observed(
        str(len(sampled)),
        {
            "n": len(sampled),
            "sampled": ", ".join(map(str, sampled)) or "-",
            "rows": len(inputs["input_ids"]),
            "query_lens": " + ".join(map(str, inputs["query_lens"])),
            "logits_rows": ", ".join(map(str, inputs["logits_indices"])) or "-",
        },
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
