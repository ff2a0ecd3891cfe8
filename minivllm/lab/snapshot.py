"""State -> JSON: a photograph of an LLMEngine's sequences, queues and KV pool, as plain dicts.

Works on any `LLMEngine`: the lab's experiment, or a running server's engine. It reads the
engine's public state (scheduler queues, block manager, sequences) and, when the engine holds
a `Tracer`, its events; it never changes anything. The page draws exactly these dicts, so the
field names are the engine's own (`num_cached_tokens`, `block_table`, ...).

A KV slot's state says how far its token has come: `reserved` (allocated, nothing planned),
`planned` (in this step's plan), `written` (the runner wrote its KV, not committed yet),
`committed` (postprocess counted it as cached), or, in a free block, `cached` (a prefix-cache
entry that can still be reused) or `free`. A speculative step's draft tokens own the slots
after the sequence's tokens (`"draft": true`); a rejected draft's slot stays `written` after the
commit, holding the draft's KV, until a later step writes over it.

Pure Python: no torch here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.sequence import Sequence
from minivllm.engine.tracing import TraceEvent, Tracer, source_of
from minivllm.lab.pieces import TokenPieces

State = dict[str, Any]

# The order in which a slot's state advances; a shared slot shows its most advanced owner.
_SLOT_ORDER = {"reserved": 0, "planned": 1, "written": 2, "committed": 3}


class Snapshotter:
    """Photographs one engine. Keeps a cache of decoded token pieces between photographs."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # seq_id -> (num_tokens, drafts) of its latest plan with drafts: the commit clears the
        # drafts, but a rejected one's KV is still in its slot.
        self._drafts: dict[int, tuple[int, list[int]]] = {}
        self._text = None if engine.tokenizer is None else TokenPieces(engine.tokenizer)
        self._code = {
            "Sequence.__init__": source_of(Sequence.__init__),
            "Scheduler.schedule": source_of(Scheduler.schedule),
            "Scheduler.postprocess": source_of(Scheduler.postprocess),
            "ModelRunner.run": source_of(type(engine.model_runner).run),
            "LLMEngine.step": source_of(LLMEngine.step),
        }

    @property
    def events(self) -> list[TraceEvent]:
        tracer = self.engine.tracer
        return tracer.events if isinstance(tracer, Tracer) else []

    def state(self, seqs: Iterable[Sequence] | None = None, stage: str = "commit") -> State:
        """The engine's state. `seqs`: the sequences to show, in order (default: waiting, then
        running; finished ones are only shown if passed). `stage` "execute" means the runner
        has run and postprocess has not: the sampled tokens are shown as not yet appended."""
        engine = self.engine
        scheduler = engine.scheduler
        bm = scheduler.block_manager
        seqs = list(scheduler.waiting) + list(scheduler.running) if seqs is None else list(seqs)
        return {
            "model": {
                "runner": type(engine.model_runner).__name__,
                "model": engine.config.model or "default",
                "tokenizer": engine.tokenizer is not None,
            },
            "step": engine.tracer.step,
            "sequences": [self.sequence(s, stage) for s in seqs],
            "waiting": [s.seq_id for s in scheduler.waiting],
            "running": [s.seq_id for s in scheduler.running],
            "block_size": bm.block_size,
            "num_blocks": bm.num_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "blocks": self.blocks(seqs),
            "budget": {
                "max_num_batched_tokens": engine.config.max_num_batched_tokens,
                "max_num_seqs": engine.config.max_num_seqs,
                "planned_tokens": sum(s.num_scheduled_tokens for s in scheduler.running),
            },
            "events": [{"index": i, **e.to_dict()} for i, e in enumerate(self.events)],
            "code": self._code,  # where the functions the page names are defined
        }

    def sequence(self, seq: Sequence, stage: str = "commit") -> State:
        """One Sequence's fields, its tokens and their text pieces."""
        sampled = None
        if stage == "execute":  # sampled by the runner, appended only by the commit
            for e in self._this_step():
                if e.seq_id == seq.seq_id and e.field == "sampled_token":
                    sampled = e.after
        ids = list(seq.token_ids)
        text = self._texts(seq)
        return {
            "seq_id": seq.seq_id,
            "status": seq.status.name,
            "num_tokens": seq.num_tokens,
            "num_prompt_tokens": seq.num_prompt_tokens,
            "num_cached_tokens": seq.num_cached_tokens,
            "num_scheduled_tokens": seq.num_scheduled_tokens,
            "spec_token_ids": list(seq.spec_token_ids),
            "block_table": list(seq.block_table),
            "token_ids": ids,
            **text,
            "pieces": None if self._text is None else self._text.pieces(ids),
            "finish_reason": seq.finish_reason,
            "max_tokens": seq.sampling_params.max_tokens,
            "num_preemptions": seq.num_preemptions,
            "sampled_token": sampled,
            "sampled_piece": (
                None
                if sampled is None or self._text is None
                else self._text.pieces(ids + [sampled])[-1]
            ),
        }

    def _texts(self, seq: Sequence) -> dict[str, str | None]:
        if self._text is None:
            return {"text": None, "prompt_text": None, "completion_text": None}
        text = self._text.text(list(seq.token_ids))
        prompt = self._text.text(list(seq.prompt_token_ids))
        if text.startswith(prompt):  # a character split between prompt and completion: whole
            completion = text[len(prompt) :]
        else:
            completion = self._text.text(list(seq.completion_token_ids))
        return {"text": text, "prompt_text": prompt, "completion_text": completion}

    def blocks(self, seqs: Iterable[Sequence]) -> list[State]:
        """Every KV block of the pool, slot by slot: who holds it and how far it has come."""
        bm = self.engine.scheduler.block_manager
        slots = self._held_slots(seqs, bm.block_size)
        out = []
        for block in bm.blocks:
            block_slots = []
            for offset in range(bm.block_size):
                n = block.block_id * bm.block_size + offset
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
            out.append(
                {
                    "block_id": block.block_id,
                    "ref_count": block.ref_count,
                    "hash": None if block.hash is None else f"{block.hash:016x}",
                    "seq_ids": owners,
                    "free": block.ref_count == 0,
                    "slots": block_slots,
                }
            )
        return out

    def _held_slots(self, seqs: Iterable[Sequence], bs: int) -> dict[int, State]:
        """slot -> {"state", "owners"} for every slot in a block table of `seqs`."""
        written = self._written()
        slots: dict[int, State] = {}
        for seq in seqs:
            if seq.spec_token_ids:
                self._drafts[seq.seq_id] = (seq.num_tokens, list(seq.spec_token_ids))
            base, drafts = self._drafts.get(seq.seq_id, (seq.num_tokens, []))
            for logical, block_id in enumerate(seq.block_table):
                for offset in range(bs):
                    pos = logical * bs + offset
                    state = slot_state(seq, pos, written.get(seq.seq_id))
                    slot = slots.setdefault(block_id * bs + offset, {"state": state, "owners": []})
                    if _SLOT_ORDER[state] > _SLOT_ORDER[slot["state"]]:
                        slot["state"] = state
                    owner = {"seq_id": seq.seq_id, "pos": pos, "token_id": None}
                    if state in ("planned", "written") and 0 <= pos - base < len(drafts):
                        owner.update(token_id=drafts[pos - base], draft=True)
                    elif pos < seq.num_tokens:
                        owner["token_id"] = seq.token_ids[pos]
                    slot["owners"].append(owner)
        return slots

    def _this_step(self) -> list[TraceEvent]:
        step = self.engine.tracer.step
        return [e for e in self.events if e.step == step]

    def _written(self) -> dict[int, tuple[int, int]]:
        """Per sequence, the positions the runner wrote in this step ([start, end))."""
        return {e.seq_id: (e.before, e.after) for e in self._this_step() if e.field == "kv_written"}


def slot_state(seq: Sequence, pos: int, written: tuple[int, int] | None) -> str:
    """How far position `pos` of `seq` has come (see the module docstring)."""
    if pos < seq.num_cached_tokens:
        return "committed"
    if pos < seq.num_cached_tokens + seq.num_scheduled_tokens:
        if written is not None and written[0] <= pos < written[1]:
            return "written"  # the runner wrote its KV; postprocess has not committed it
        return "planned"
    if written is not None and written[0] <= pos < written[1]:
        return "written"  # a rejected draft's KV: written this step, never committed
    return "reserved"
