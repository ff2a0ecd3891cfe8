"""Chapter 07, speculative decoding: the chapter's rule, scheduled is not cached, at its sharpest.
A decoding sequence whose last tokens occurred earlier gets up to k draft tokens (prompt
lookup); the plan schedules k + 1 tokens, the runner writes k + 1 KV slots in one step, and the
commit advances `num_cached_tokens` by accepted + 1 only: the rejected drafts' slots were
written but never committed, and a later step overwrites them.

The chapter's draft source is the engine's prompt lookup with its last draft swapped for
another token of the sequence (`SwappedLastDraft`): a stand-in for a draft model that guesses
wrong now and then, so that a step shows a rejected draft on any model.

Every number comes from the frames the learner's clicks recorded: the plan's
`num_scheduled_tokens` and drafts, the runner's inputs of that step, the commit's counters.

Pure Python: no torch here.
"""

from __future__ import annotations

from minivllm.config import SpeculativeConfig
from minivllm.engine.sequence import Sequence
from minivllm.engine.spec_decode import NgramProposer
from minivllm.lab.lesson import Lesson, Observed, Run, State
from minivllm.lab.scenarios import Driver, EngineShape, Scenario
from minivllm.lab.story import ids, line, seq_of

PHRASE_TEXT = " one two three four"
K = 3  # num_speculative_tokens of the chapter's engine
# Every decoding sequence with a match proposes (the cost model would too, at one sequence).
SPECULATIVE = SpeculativeConfig(
    num_speculative_tokens=K, prompt_lookup_min=1, prompt_lookup_max=3, draft_token_cost=0.0
)


class SwappedLastDraft(NgramProposer):
    """Prompt lookup whose last draft (of two or more) is replaced by the first token of the
    sequence that differs from it: the model will most likely reject it, and its KV slot is
    written by execute and never committed."""

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        drafts = super().propose(token_ids, max_tokens)
        if len(drafts) < 2:
            return drafts
        other = next((t for t in token_ids if t != drafts[-1]), drafts[-1])
        return [*drafts[:-1], other]

    def propose_batch(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        return [self.propose(seq.token_ids, max_tokens) for seq, max_tokens in requests]


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
    before, after = seq_of(plan, a), seq_of(commit, a)
    inputs = execute["step_inputs"]
    row = inputs["seq_ids"].index(a)
    start = sum(inputs["query_lens"][:row])
    written = inputs["query_lens"][row]
    slots = inputs["slot_mapping"][start : start + written]
    grew = after["num_cached_tokens"] - before["num_cached_tokens"]
    drafts = before["spec_token_ids"]
    accepted = grew - 1
    rejected = len(drafts) - accepted
    story = [
        line(
            "spec_plan",
            a=a,
            scheduled=before["num_scheduled_tokens"],
            drafts=len(drafts),
            draft_ids=ids(drafts),
        ),
        line("spec_written", written=written, slots=ids(slots), step=execute["step"]),
        line(
            "spec_verdict",
            accepted=accepted,
            rejected=rejected,
            appended=after["num_tokens"] - before["num_tokens"],
            tokens_before=before["num_tokens"],
            tokens_after=after["num_tokens"],
            cached_before=before["num_cached_tokens"],
            cached_after=after["num_cached_tokens"],
        ),
    ]
    premise = None
    if rejected:
        story.append(line("spec_rejected", rejected=rejected, slots=ids(slots[1 + accepted :])))
    else:
        premise = line("pre_spec_all", drafts=len(drafts))
    return Observed(str(grew), {"grew": grew, "step": execute["step"]}, story, premise, inputs)


CHAPTER_07 = [
    Scenario(
        "spec",
        EngineShape(32, 64, speculative_config=SPECULATIVE, proposer=SwappedLastDraft),
        _spec_setup,
        focus=0,
        chapter="07",
        lesson=Lesson("number", _spec_ask, _spec_observe, depends_on_model=True),
    ),
]
