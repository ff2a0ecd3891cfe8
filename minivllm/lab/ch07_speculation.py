"""Chapter 07, speculative decoding: the chapter's rule, scheduled is not cached, at its sharpest.
A decoding sequence whose last tokens occurred earlier gets up to k draft tokens (prompt
lookup); the plan schedules k + 1 tokens, the runner writes k + 1 KV slots in one step, and the
commit advances `num_cached_tokens` by accepted + 1 only: the rejected drafts' slots were
written but never committed, and a later step overwrites them.

Every number comes from the frames the learner's clicks recorded: the plan's
`num_scheduled_tokens` and drafts, the runner's inputs of that step, the commit's counters.

Pure Python: no torch here.
"""

from __future__ import annotations

from minivllm.config import SpeculativeConfig
from minivllm.lab.lesson import Lesson, Observed, Run, State
from minivllm.lab.scenarios import Driver, EngineShape, Scenario

PHRASE_TEXT = " one two three four"
K = 3  # num_speculative_tokens of the chapter's engine
# Every decoding sequence with a match proposes (the cost model would too, at one sequence).
SPECULATIVE = SpeculativeConfig(
    num_speculative_tokens=K, prompt_lookup_min=1, prompt_lookup_max=3, draft_token_cost=0.0
)


def _spec_setup(lab: Driver) -> None:
    """A's prompt is a 4-token phrase said four times, less its last token; the prefill samples
    the first token, and the next plans look the last tokens up in the prompt."""
    phrase = lab.prompt(PHRASE_TEXT, 4)
    lab.add_tokens((phrase * 4)[:15], max_tokens=12)
    lab.step()


def _spec_ask(start: State) -> dict:
    a = start["sequences"][0]
    return {"a": a["seq_id"], "k": K, "cached": a["num_cached_tokens"], "tokens": a["num_tokens"]}


def _first_speculative_step(run: Run) -> tuple[State, State, State] | None:
    """The plan, execute and commit frames of the first step that gave A drafts."""
    a = run.start["sequences"][0]["seq_id"]
    for i, frame in enumerate(run.frames):
        if frame["frame"]["stage"] != "plan":
            continue
        seq = next(s for s in frame["sequences"] if s["seq_id"] == a)
        if not seq["spec_token_ids"]:
            continue
        later = run.frames[i + 1 :]
        execute = next((f for f in later if f["frame"]["stage"] == "execute"), None)
        commit = next((f for f in later if f["frame"]["stage"] == "commit"), None)
        return None if execute is None or commit is None else (frame, execute, commit)
    return None


def _spec_observe(run: Run) -> Observed | None:
    found = _first_speculative_step(run)
    if found is None:
        return None
    plan, execute, commit = found
    a = run.start["sequences"][0]["seq_id"]
    before = next(s for s in plan["sequences"] if s["seq_id"] == a)
    after = next(s for s in commit["sequences"] if s["seq_id"] == a)
    inputs = execute["step_inputs"] or {}
    row = inputs.get("seq_ids", [a]).index(a)
    start = sum(inputs.get("query_lens", [])[:row])
    written = inputs.get("query_lens", [before["num_scheduled_tokens"]])[row]
    slots = inputs.get("slot_mapping", [])[start : start + written]
    grew = after["num_cached_tokens"] - before["num_cached_tokens"]
    drafts = before["spec_token_ids"]
    return Observed(
        str(grew),
        {
            "scheduled": before["num_scheduled_tokens"],
            "drafts": len(drafts),
            "draft_ids": ", ".join(map(str, drafts)),
            "written": written,
            "slots": ", ".join(map(str, slots)),
            "grew": grew,
            "accepted": grew - 1,
            "rejected": len(drafts) - (grew - 1),
            "cached_before": before["num_cached_tokens"],
            "cached_after": after["num_cached_tokens"],
            "appended": after["num_tokens"] - before["num_tokens"],
        },
    )


CHAPTER_07 = [
    Scenario(
        "spec",
        EngineShape(32, 64, speculative_config=SPECULATIVE),
        _spec_setup,
        focus=0,
        chapter="07",
        lesson=Lesson("number", _spec_ask, _spec_observe, depends_on_model=True),
    ),
]
