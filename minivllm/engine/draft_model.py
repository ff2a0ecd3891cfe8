"""The draft-model proposer: a second (smaller) model with the target's vocabulary proposes each
decoding sequence's next k tokens greedily; the target verifies them as it verifies n-gram
drafts (`spec_decode.py`, `layers/rejection_sampler.py`), so the output is the target's.

The draft model runs on a `ModelRunner` of its own with a paged KV cache of its own: its own
pool, its own `BlockManager` (no prefix caching) and, per target sequence, a *shadow*
`Sequence` holding the tokens the draft has seen, its draft block table and its
`num_cached_tokens` in the draft's cache. Nothing here depends on when the target allocates.

One `propose_batch` call per step, for all proposing sequences:
1. re-sync each shadow: its cached count drops to the longest common prefix of its tokens and
   the target sequence's committed ones (the KV of drafts the target rejected is never trusted,
   only overwritten later), and at least the last token is fed again, since its logits give
   the first draft;
2. one batched catch-up step over the uncached tails (the whole prompt the first time, then
   usually the 1-2 tokens the target committed since), which samples the first draft; the
   tails share the target's token budget per step, so a long prompt's is fed in chunks over
   several steps and the sequence drafts once it has caught up;
3. k - 1 batched one-token steps, each feeding the previous draft, greedy.

Its KV for the drafts the target accepts is reused next step. A sequence whose shadow needs
more draft blocks than are free simply does not speculate this step. A shadow's blocks go
back when its sequence finishes, is aborted or is preempted (the Scheduler's `release`).

The proposer itself is pure Python over a runner (`ModelRunner`, or the tests' fake);
`load_draft_proposer` builds the real one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from minivllm.config import EngineConfig
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.runner_output import RunnerOutput
from minivllm.engine.scheduler import ScheduledBatch
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.paging import blocks_for
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DRAFT_POOL_SHARE = 0.5  # the draft's pool: this share of the target's blocks (see below)
GREEDY = SamplingParams(temperature=0.0)


class DraftRunner(Protocol):
    """What the proposer needs of the draft's runner: ModelRunner and the tests' fake."""

    num_kv_blocks: int

    def run(self, batch: ScheduledBatch, token_bitmask: Any = None) -> RunnerOutput: ...


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    return next(i for i in range(n) if a[i] != b[i])


class DraftModelProposer:
    """Greedy drafts from a draft model over its own paged KV cache (the module docstring)."""

    def __init__(
        self, runner: DraftRunner, num_speculative_tokens: int, block_size: int, token_budget: int
    ) -> None:
        self.runner = runner
        self.num_speculative_tokens = num_speculative_tokens
        self.token_budget = token_budget  # most tokens one catch-up step feeds, all sequences
        self.block_manager = BlockManager(
            runner.num_kv_blocks, block_size, enable_prefix_caching=False
        )
        self.shadows: dict[int, Sequence] = {}  # target seq_id -> the draft's view of it
        self.num_steps = 0  # draft model runs, for the cost per step
        self.seconds = 0.0  # time spent proposing, runs and bookkeeping

    def propose_batch(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to `min(num_speculative_tokens, room)` greedy drafts per (sequence, room)."""
        start = time.perf_counter()
        drafts: list[list[int]] = [[] for _ in requests]
        plan = self._plan(requests)
        try:
            first = (
                self._step([shadow for _, shadow, _ in plan], [c for _, _, c in plan])
                if plan
                else {}
            )
            # (request index, shadow, drafts wanted): those caught up, wanting more drafts
            active: list[tuple[int, Sequence, int]] = []
            for i, shadow, _ in plan:
                if shadow.seq_id in first:
                    drafts[i].append(first[shadow.seq_id])
                    active.append((i, shadow, min(self.num_speculative_tokens, requests[i][1])))
            active = [a for a in active if len(drafts[a[0]]) < a[2]]
            while active:
                tokens = self._step([shadow for _, shadow, _ in active])
                for i, shadow, _ in active:
                    drafts[i].append(tokens[shadow.seq_id])
                active = [a for a in active if len(drafts[a[0]]) < a[2]]
        except Exception:  # the target step does not need drafts: speculate less, not fail
            logger.exception("the draft model's step failed; no drafts this step")
            for seq, _ in requests:
                self.release(seq.seq_id)  # its KV may be half written: start over
            drafts = [[] for _ in requests]
        self.seconds += time.perf_counter() - start
        return drafts

    def _plan(self, requests: list[tuple[Sequence, int]]) -> list[tuple[int, Sequence, int]]:
        """(request index, shadow, tokens to feed) of the catch-up step: each synced shadow's
        uncached tail within the token budget (a longer one is fed in chunks, over steps, and
        drafts once caught up) and the draft blocks it needs; a sequence whose blocks are not
        free is left out."""
        budget = self.token_budget
        plan = []
        for i, (seq, room) in enumerate(requests):
            shadow = self._sync(seq)
            chunk = min(shadow.num_uncached_tokens, budget)
            if room < 1 or chunk < 1:
                continue
            # KV for the chunk and, once caught up, the first drafts (the last is never fed).
            n = min(self.num_speculative_tokens, room)
            need = chunk + (n - 1 if chunk == shadow.num_uncached_tokens else 0)
            if self.block_manager.can_allocate(shadow, need):
                self.block_manager.allocate(shadow, need)
                plan.append((i, shadow, chunk))
                budget -= chunk
        return plan

    def _sync(self, seq: Sequence) -> Sequence:
        """The shadow of `seq` with the target's tokens, its cached count cut to what still
        matches them and leaving at least the last token to feed."""
        shadow = self.shadows.get(seq.seq_id)
        common = 0 if shadow is None else common_prefix_len(shadow.token_ids, seq.token_ids)
        if shadow is None or common < shadow.num_prompt_tokens:  # new, or nothing to keep
            self.release(seq.seq_id)
            shadow = Sequence(seq.seq_id, seq.token_ids, GREEDY)
            shadow.status = SequenceStatus.RUNNING
            self.shadows[seq.seq_id] = shadow
            return shadow
        shadow.truncate(common)  # cached <= common
        for token in seq.token_ids[shadow.num_tokens :]:
            shadow.append_token(token)
        shadow.num_cached_tokens = min(shadow.num_cached_tokens, shadow.num_tokens - 1)
        return shadow

    def _step(self, shadows: list[Sequence], chunks: list[int] | None = None) -> dict[int, int]:
        """One draft-model run feeding `chunks` tokens of each shadow (default: one); the greedy
        next token of each shadow fed to its end, appended to it, by seq_id."""
        for shadow, chunk in zip(shadows, chunks or [1] * len(shadows), strict=True):
            shadow.num_scheduled_tokens = chunk
        batch = ScheduledBatch(shadows)
        output = self.runner.run(batch)
        self.num_steps += 1
        tokens = dict(zip([s.seq_id for s in batch.sample_seqs], output.sampled_token_ids))
        assert len(tokens) == len(batch.sample_seqs) == len(output.samples)
        for shadow in shadows:
            shadow.num_cached_tokens += shadow.num_scheduled_tokens
            shadow.num_scheduled_tokens = 0
            if shadow.seq_id in tokens:
                shadow.append_token(tokens[shadow.seq_id])
        return tokens

    def release(self, seq_id: int) -> None:
        """Free the shadow of a sequence that finished, was aborted or preempted."""
        shadow = self.shadows.pop(seq_id, None)
        if shadow is not None:
            self.block_manager.free(shadow)

    def stats(self) -> dict[str, float]:
        """The draft model's counters, beside the spec-decode ones."""
        bm = self.block_manager
        return {
            "spec_decode_draft_steps": self.num_steps,
            "spec_decode_draft_seconds": self.seconds,
            "spec_decode_draft_kv_usage_perc": bm.usage,
        }


# ---- loading ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftModel:
    """A draft model found and checked against the target, before any weight is read."""

    config: EngineConfig  # the target's options with the draft's `model`, no speculation
    model_dir: Path
    hf_config: Any


def resolve_draft(config: EngineConfig, target_hf_config: Any) -> DraftModel | None:
    """The draft of a `"draft_model"` speculative config (None for other methods), its path
    and vocabulary checked: ValueError / FileNotFoundError naming the draft."""
    from minivllm.models.config import resolve_config

    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    assert spec.model is not None  # SpeculativeConfig checked it
    draft = replace(config, model=spec.model, speculative_config=None)
    try:
        draft, model_dir, hf_config = resolve_config(draft)
    except (ValueError, FileNotFoundError, OSError) as exc:
        raise ValueError(f"speculative_config draft model {spec.model!r}: {exc}") from None
    target_vocab, draft_vocab = int(target_hf_config.vocab_size), int(hf_config.vocab_size)
    if draft_vocab != target_vocab:
        raise ValueError(
            f"speculative_config draft model {spec.model!r} has a vocabulary of {draft_vocab} "
            f"tokens, the target {target_vocab}: a draft model must share the target's "
            "tokenizer"
        )
    return DraftModel(draft, model_dir, hf_config)


def draft_pool_blocks(target_blocks: int, max_model_len: int, block_size: int) -> int:
    """The draft's KV blocks: a share of the target's (the draft's cache holds only what the
    running sequences speculate on), at least one full-length sequence, at most the target's."""
    one_sequence = blocks_for(max_model_len, block_size)
    return min(target_blocks, max(int(DRAFT_POOL_SHARE * target_blocks), one_sequence))


def load_draft_proposer(
    config: EngineConfig, draft: DraftModel, target_blocks: int
) -> DraftModelProposer:
    """Load the draft model on the target's device and dtype policy, with its own pool. The
    target's pool was sized first: on a GPU the draft fits in what `gpu_memory_utilization`
    left, else a ValueError says what to lower."""
    import torch

    from minivllm.engine.model_runner import ModelRunner

    assert config.speculative_config is not None and config.max_model_len is not None
    num_blocks = draft_pool_blocks(target_blocks, config.max_model_len, config.block_size)
    draft_config = replace(
        draft.config, max_model_len=config.max_model_len, num_kv_blocks=num_blocks
    )
    try:
        runner = ModelRunner(draft_config, draft.model_dir, draft.hf_config)
    except torch.OutOfMemoryError:
        raise ValueError(
            f"the draft model {draft_config.model!r} and its {num_blocks} KV blocks do not fit "
            "beside the target's KV pool: lower gpu_memory_utilization or set num_kv_blocks"
        ) from None
    logger.info("draft model %s: %d KV blocks", draft_config.model, num_blocks)
    k = config.speculative_config.num_speculative_tokens
    return DraftModelProposer(runner, k, config.block_size, config.max_num_batched_tokens)
