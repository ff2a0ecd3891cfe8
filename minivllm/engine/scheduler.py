"""The Scheduler: writes each step's plan, and commits it once the model has run.

`schedule()` is the plan: it picks sequences, writes `num_scheduled_tokens`, and asks the
BlockManager for the blocks the plan needs. `postprocess()` is the commit: only after the
ModelRunner has executed the plan does `num_cached_tokens` advance. Scheduled is not cached.

Policy (vLLM v1): running sequences first (decodes and unfinished prefill chunks, oldest
first), then waiting ones first come first served, all within one token budget, so a long
prompt is prefilled in chunks and never stalls the decodes. When blocks run out, the most
recently admitted running sequence is preempted by recompute.

Speculative decoding (`config.speculative_config`): a decoding sequence may get draft tokens
in its plan, `num_scheduled_tokens = 1 + drafts`, from the proposer (`spec_decode.py`, or the
engine's `draft_model.py`), asked once per step for all decoding sequences; counted in the
budget and given blocks like any token, but only where they fit without preempting anyone,
and only where the cost model (`spec_policy.py`) says they pay at this batch size and
the sequence's acceptance so far. The commit appends the accepted drafts and the target's token
and advances `num_cached_tokens` by accepted + 1; a rejected draft's slot is overwritten by a
later step.

Embedding requests (`Sequence.pooling`) are prefill-only: never sampled, no cached prefix
taken, finished by the commit that brings their pooled vector.

Pure Python: no torch here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from minivllm.config import EngineConfig
from minivllm.engine.block_manager import BlockManager, HashFn, hash_block
from minivllm.engine.runner_output import RunnerOutput, SampledToken
from minivllm.engine.sequence import (
    FinishReason,
    Sequence,
    SequenceStatus,
    check_invariants,
)
from minivllm.engine.spec_decode import NgramProposer, Proposer, SpecDecodeStats
from minivllm.engine.spec_policy import SpeculationPolicy
from minivllm.logprobs import Logprob
from minivllm.paging import blocks_for


@dataclass
class ScheduledBatch:
    """One step's plan: the sequences to run, each with `num_scheduled_tokens > 0`."""

    seqs: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # The sequences whose prompt is complete after this step: they get a sampled token
    # (embedding sequences never do: they get their pooled vector instead).
    # Fixed when the plan is made, because committing changes the counters it is read from.
    sample_seqs: list[Sequence] = field(init=False)

    def __post_init__(self) -> None:
        self.sample_seqs = [
            s
            for s in self.seqs
            if s.num_cached_tokens + s.num_scheduled_tokens == s.num_tokens + len(s.spec_token_ids)
            and s.pooling is None
        ]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.seqs)

    def without_finished(self) -> ScheduledBatch:
        """The plan minus sequences aborted since it was made (their blocks are gone)."""
        if not any(s.is_finished for s in self.seqs):
            return self
        return ScheduledBatch([s for s in self.seqs if not s.is_finished], self.preempted)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


DraftFilter = Callable[[Sequence, list[int]], list[int]]


class Scheduler:
    """Owns the waiting and running queues and the BlockManager. `draft_filter` (the engine's
    grammar check) cuts a sequence's proposed drafts to those its constraint allows;
    `proposer` is the draft source (default: n-gram lookup; a draft model's is the engine's)."""

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        hash_fn: HashFn = hash_block,
        draft_filter: DraftFilter | None = None,
        proposer: Proposer | None = None,
    ):
        if config.max_model_len is None:
            raise ValueError("the scheduler needs a resolved max_model_len")
        self.config = config
        self.max_model_len: int = config.max_model_len
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching, hash_fn
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        spec = config.speculative_config
        if spec is not None and proposer is None:
            if spec.method != "ngram":
                raise ValueError(
                    f"speculative method {spec.method!r} needs its proposer (the engine builds "
                    "a draft model's in LLMEngine.from_options)"
                )
            proposer = NgramProposer(spec)
        self.proposer = proposer if spec is not None else None
        self.spec_policy = SpeculationPolicy(spec) if spec is not None else None
        self.draft_filter = draft_filter
        self.spec_stats = SpecDecodeStats(spec.num_speculative_tokens if spec else 0)

    # ---- requests -------------------------------------------------------------------

    def max_completion_tokens(self, seq: Sequence) -> int:
        if seq.pooling is not None:  # an embedding request ends with its prompt
            return 0
        max_tokens = seq.sampling_params.max_tokens
        return self.max_model_len - seq.num_prompt_tokens if max_tokens is None else max_tokens

    def add(self, seq: Sequence) -> None:
        """Queue a new request, or reject it now (ValueError) if it could never finish."""
        if seq.num_prompt_tokens == 0:
            raise ValueError("the prompt is empty: give at least one token")
        completion = self.max_completion_tokens(seq)
        total = seq.num_prompt_tokens + completion
        # A generating prompt leaves room for one token; an embedding's may fill the window.
        longest = self.max_model_len if seq.pooling is not None else self.max_model_len - 1
        if seq.num_prompt_tokens > longest or total > self.max_model_len:
            raise ValueError(
                f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({completion}) = {total} "
                f"exceeds max_model_len ({self.max_model_len})"
            )
        # The last sampled token is never fed back, so its KV never needs a slot (an embedding
        # request samples none: all of its prompt's KV is written).
        kv_tokens = total if seq.pooling is not None else total - 1
        need = blocks_for(kv_tokens, self.config.block_size)
        if need > self.block_manager.num_blocks:
            raise ValueError(
                f"request needs {need} KV blocks ({kv_tokens} tokens at block_size "
                f"{self.config.block_size}) but the pool has only "
                f"{self.block_manager.num_blocks}"
            )
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- plan -----------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Plan one step: write `num_scheduled_tokens` and allocate the blocks it needs."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[Sequence] = []
        preempted: list[Sequence] = []

        proposals = self._propose_all(budget)

        # 1. Running sequences: decodes and unfinished prefill chunks, oldest first.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            # Proposed against the budget left after the certain tokens: cut to what is left.
            drafts = proposals.get(seq.seq_id, [])[: budget - 1]
            if drafts and not self.block_manager.can_allocate(seq, 1 + len(drafts)):
                drafts = []  # speculation never preempts anyone
            num_new = 1 + len(drafts) if drafts else min(seq.num_uncached_tokens, budget)
            while not self.block_manager.can_allocate(seq, num_new):
                victim = self.running[-1]  # the most recently admitted
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break
            self.block_manager.allocate(seq, num_new)
            seq.num_scheduled_tokens = num_new
            if drafts:
                seq.spec_token_ids = drafts
            budget -= num_new
            scheduled.append(seq)
            i += 1

        # 2. Waiting sequences, first come first served, unless this step had to preempt.
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            # An embedding request takes no cached prefix: a cached block's positions would have
            # no hidden states this step to pool (its own blocks still enter the cache).
            hits = self.block_manager.match_prefix(seq) if seq.pooling is None else []
            num_new = min(seq.num_tokens - len(hits) * self.config.block_size, budget)
            if not self.block_manager.can_allocate(seq, num_new, hits):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            # On a prefix-cache hit cached grows at plan time (the only way it grows before a
            # commit; preemption resets it here): an earlier sequence committed that KV.
            self.block_manager.take_prefix(seq, hits)
            self.block_manager.allocate(seq, num_new)
            seq.num_scheduled_tokens = num_new
            budget -= num_new
            self.running.append(seq)
            scheduled.append(seq)

        return ScheduledBatch(scheduled, preempted)

    def _propose_all(self, budget: int) -> dict[int, list[int]]:
        """The pre-pass: drafts for every decoding sequence the cost model lets speculate, from
        one proposer call, each as many as the room after its one certain token allows (its
        max_tokens, max_model_len, and the budget the sequences before it leave at least)."""
        if self.proposer is None:
            return {}
        assert self.spec_policy is not None
        requests: list[tuple[Sequence, int]] = []
        for seq in self.running:
            if budget <= 0:
                break
            certain = min(seq.num_uncached_tokens, budget)
            if seq.num_uncached_tokens == 1 and self.spec_policy.should_propose(
                seq.seq_id, len(self.running)
            ):
                room = min(
                    budget - 1,
                    self.max_completion_tokens(seq) - seq.num_completion_tokens - 1,
                    self.max_model_len - seq.num_tokens - 1,
                )
                if room > 0:
                    requests.append((seq, room))
            budget -= certain
        if not requests:
            return {}
        proposals = {}
        for (seq, _), drafts in zip(requests, self.proposer.propose_batch(requests), strict=True):
            if drafts and self.draft_filter is not None:
                drafts = self.draft_filter(seq, drafts)
            if drafts:
                proposals[seq.seq_id] = drafts
        return proposals

    def _preempt(self, seq: Sequence) -> None:
        """RUNNING -> WAITING by recompute: blocks freed, progress forgotten."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_cached_tokens = 0
        seq.num_scheduled_tokens = 0
        seq.spec_token_ids = []
        seq.pooled = None  # recomputed from the first position
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        if self.proposer is not None:  # a draft model's KV of it goes too, like the target's
            self.proposer.release(seq.seq_id)

    # ---- commit -----------------------------------------------------------------------

    def postprocess(self, batch: ScheduledBatch, output: RunnerOutput) -> list[Sequence]:
        """Commit an executed plan: advance cached, append samples and prompt logprobs,
        finish what is done."""
        samples = output.samples
        if len(samples) != len(batch.sample_seqs):
            raise ValueError(
                f"expected {len(batch.sample_seqs)} samples, the runner gave {len(samples)}"
            )
        sampled = {id(seq): sample for seq, sample in zip(batch.sample_seqs, samples)}
        for seq in batch.seqs:
            if seq.is_finished:  # aborted while the plan was pending
                continue
            before = seq.num_cached_tokens
            sample = sampled.get(id(seq))
            # Drafts' KV was written but only the accepted ones' is committed.
            num_accepted = 0 if sample is None else sample.num_accepted
            drafts = seq.spec_token_ids
            if not 0 <= num_accepted <= len(drafts):
                raise ValueError(f"{num_accepted} accepted of {len(drafts)} drafts for {seq}")
            seq.num_cached_tokens += seq.num_scheduled_tokens - len(drafts) + num_accepted
            seq.num_scheduled_tokens = 0
            reason = None if sample is None else self._append(seq, sample, drafts)
            if drafts:
                seq.spec_token_ids = []
                self.spec_stats.observe(len(drafts), num_accepted)
                if self.spec_policy is not None:
                    self.spec_policy.observe(seq.seq_id, len(drafts), num_accepted)
            self.block_manager.commit(seq, before)
            if seq.seq_id in output.prompt_logprobs:
                first, entries = output.prompt_logprobs[seq.seq_id]
                # A recompute after preemption covers positions already committed: skip them.
                skip = 1 + len(seq.prompt_logprobs) - first
                seq.prompt_logprobs.extend(entries[max(skip, 0) :])
            if seq.pooling is not None:
                reason = self._commit_pooling(seq, output)
            if reason is not None:
                self.finish(seq, reason)
        return batch.seqs

    def _commit_pooling(self, seq: Sequence, output: RunnerOutput) -> FinishReason | None:
        """Take an embedding sequence's partial pool, or its vector once its prompt has run
        (then it is done: "stop")."""
        if seq.num_cached_tokens < seq.num_tokens:
            seq.pooled = output.pooled.get(seq.seq_id)
            return None
        embedding = output.embeddings.get(seq.seq_id)
        if embedding is None:
            raise ValueError(f"the runner gave no embedding for {seq}")
        seq.pooled, seq.embedding = None, embedding
        return FinishReason.STOP

    def _append(
        self, seq: Sequence, sample: SampledToken, drafts: list[int]
    ) -> FinishReason | None:
        """Append the accepted drafts, then the sampled token, each with its logprob entry, up
        to the first one that ends the sequence (an EOS among the drafts ends it there: the
        rest is dropped)."""
        run = [*drafts[: sample.num_accepted], sample.token_id]
        # One logprob entry per token appended, when the request asked for them.
        entries: list[dict[int, Logprob] | None] = [None] * sample.num_accepted
        if sample.draft_logprobs is not None:
            entries = list(sample.draft_logprobs)
        entries.append(sample.logprobs)
        wants_logprobs = seq.sampling_params.logprobs is not None
        reason = None
        for token_id, entry in zip(run, entries):
            seq.append_token(token_id)
            if wants_logprobs and entry is not None:
                seq.logprobs.append(entry)
            reason = self._stop_reason(seq, token_id)
            if reason is not None:
                # The KV of dropped drafts counts no more.
                seq.num_cached_tokens = min(seq.num_cached_tokens, seq.num_tokens)
                break
        return reason

    def discard(self, batch: ScheduledBatch, reason: FinishReason = FinishReason.ERROR) -> None:
        """Drop a plan whose execution failed: nothing advances; its sequences end."""
        for seq in batch.seqs:
            if seq.is_finished:
                continue
            seq.num_scheduled_tokens = 0
            seq.spec_token_ids = []
            self.finish(seq, reason)

    def _stop_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        sp = seq.sampling_params
        if seq.num_completion_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token_id in self.eos_token_ids:
                return FinishReason.STOP
            if token_id in (sp.stop_token_ids or ()):
                return FinishReason.STOP
        if seq.num_completion_tokens >= self.max_completion_tokens(seq):
            return FinishReason.LENGTH
        if seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End `seq` in any state and give its blocks back."""
        if seq.is_finished:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.num_scheduled_tokens = 0
        seq.spec_token_ids = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if self.spec_policy is not None:
            self.spec_policy.forget(seq.seq_id)
        if self.proposer is not None:
            self.proposer.release(seq.seq_id)

    # ---- checks -----------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if any queue, sequence or block count is inconsistent."""
        bs = self.config.block_size
        seqs = [*self.waiting, *self.running]
        assert len({s.seq_id for s in seqs}) == len(seqs), "a sequence is queued twice"
        for seq in self.waiting:
            assert seq.status == SequenceStatus.WAITING, seq
        for seq in self.running:
            assert seq.status == SequenceStatus.RUNNING, seq
        for seq in seqs:
            check_invariants(seq, bs)
        self.block_manager.check_consistency([s.block_table for s in seqs])
