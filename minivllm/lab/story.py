"""The words of a lesson's explanation, built from the frames it explains: a list of lines,
each a page word's key and the numbers it names (the page translates them, plurals
included). Nothing here is a fixed story: each line says what one frame shows (who was
scheduled and how, who waited and why), so under any engine options the text stays true.

Pure Python: no torch here.
"""

from __future__ import annotations

from typing import Any

State = dict[str, Any]
Line = dict[str, Any]  # {"key": the page's word, "params": its numbers}


def line(key: str, **params: Any) -> Line:
    return {"key": key, "params": params}


def ids(values: list[int]) -> str:
    return ", ".join(map(str, values))


def kind(seq: State) -> str:
    """What a plan gave a sequence: "decode" (its one next token, maybe with drafts),
    "chunk" (a part of its prompt) or "prefill" (the rest of its prompt)."""
    upto = seq["num_cached_tokens"] + seq["num_scheduled_tokens"]
    if seq["num_cached_tokens"] >= seq["num_prompt_tokens"]:
        return "decode"
    return "chunk" if upto < seq["num_prompt_tokens"] else "prefill"


def why_waiting(plan: State) -> str:
    """Why a plan left a sequence out: the token budget spent, max_num_seqs reached, or no
    free KV block for it (the scheduler's three reasons, in its own order)."""
    budget = plan["budget"]
    if budget["planned_tokens"] >= budget["max_num_batched_tokens"]:
        return "budget"
    if len(plan["running"]) >= budget["max_num_seqs"]:
        return "seqs"
    return "blocks"


def plan_lines(plan: State) -> list[Line]:
    """One line per unfinished sequence of a plan frame: its scheduled tokens, or why it
    got none."""
    lines = []
    for seq in plan["sequences"]:
        if seq["status"] == "FINISHED":
            continue
        n = seq["num_scheduled_tokens"]
        if n:
            lines.append(line("l_sched", seq=seq["seq_id"], n=n, kind=kind(seq)))
        else:
            lines.append(line("l_none", seq=seq["seq_id"], reason=why_waiting(plan)))
    return lines


def split(plan: State) -> str:
    """A plan's split, as the page shows it: "seq 0: 8 + seq 1: 4"."""
    parts = [
        f"seq {s['seq_id']}: {s['num_scheduled_tokens']}"
        for s in plan["sequences"]
        if s["num_scheduled_tokens"]
    ]
    return " + ".join(parts) or "-"


def seq_of(frame: State, seq_id: int) -> State:
    return next(s for s in frame["sequences"] if s["seq_id"] == seq_id)
