"""The draft-model proposer on fake runners: its shadow sequences, its own paged KV cache and
its re-sync after rejections, with no torch model.

The fake draft model reads its context back through the draft's block tables and fails loudly
on a slot never written, so a shadow that trusted a rejected draft's KV, or a block table that
went wrong, fails here. With `order=None` the fake's next token hashes the whole context: a
draft identical to the target then drafts right only if it saw exactly the target's tokens,
so an acceptance of 100% proves the re-sync; a different draft model accepts little, and the
output stays the target's either way.
"""

from __future__ import annotations

import pytest
from support.engine_checks import assert_no_leaks, run_to_completion
from support.fake_runner import FakeModelRunner, reference_completion
from support.faults import FaultyRunner

from minivllm.config import EngineConfig
from minivllm.engine.draft_model import (
    DraftModelProposer,
    common_prefix_len,
    draft_pool_blocks,
)
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.sequence import Sequence
from minivllm.sampling_params import SamplingParams

VOCAB = 50
K = 3
DRAFT = {
    "model": "draft-model-path",  # the fakes stand in for it: nothing is loaded here
    "num_speculative_tokens": K,
    "disable_by_batch_size": None,
    "draft_token_cost": 0.0,
}
PROMPTS = [[1, 2, 3], [5] * 9, [7, 1], list(range(16)) * 2]


def greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def draft_engine(
    num_blocks: int = 64,
    draft_blocks: int = 64,
    draft_order: int | None = None,
    draft_fails_on: tuple[int, ...] = (),
    **options: object,
) -> tuple[LLMEngine, DraftModelProposer]:
    """A target fake (whole-context model) with a fake draft of `draft_order` (None: the
    target's own model)."""
    options.setdefault("block_size", 4)
    config = EngineConfig(max_model_len=256, speculative_config=DRAFT, **options)  # type: ignore[arg-type]
    draft_runner = FaultyRunner(
        FakeModelRunner(draft_blocks, config.block_size, VOCAB, draft_order),
        fail_on_calls=draft_fails_on,
    )
    proposer = DraftModelProposer(draft_runner, K, config.block_size, config.max_num_batched_tokens)
    target = FakeModelRunner(num_blocks, config.block_size, VOCAB)
    return LLMEngine(config, target, proposer=proposer), proposer


def assert_draft_pool_empty(proposer: DraftModelProposer) -> None:
    bm = proposer.block_manager
    assert proposer.shadows == {}
    assert bm.num_free_blocks == bm.num_blocks, "draft blocks not returned"
    bm.check_consistency([])


def run_all(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    seqs = [engine.add_request(p, greedy(max_tokens)) for p in prompts]
    finals = run_to_completion(engine)
    return [finals[str(s.seq_id)].outputs[0].token_ids for s in seqs]


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    return reference_completion(prompt, max_tokens, VOCAB)


def acceptance(engine: LLMEngine) -> float:
    stats = engine.stats()
    return stats["spec_decode_num_accepted_tokens"] / stats["spec_decode_num_draft_tokens"]


def test_the_target_as_its_own_draft_accepts_every_draft_in_a_mixed_batch():
    """A small budget mixes prefill chunks, speculating decodes and drafts cut by the budget;
    every draft is the target's token, so the re-sync after each step is exact."""
    engine, proposer = draft_engine(max_num_batched_tokens=7)
    assert run_all(engine, PROMPTS, 30) == [reference(p, 30) for p in PROMPTS]
    assert acceptance(engine) == 1.0
    stats = engine.stats()
    assert stats["spec_decode_num_drafts"] > 10
    assert stats["spec_decode_draft_steps"] == proposer.num_steps > 0
    assert_no_leaks(engine)
    assert_draft_pool_empty(proposer)


def test_a_different_draft_model_accepts_little_and_changes_nothing():
    engine, proposer = draft_engine(draft_order=1)
    assert run_all(engine, PROMPTS, 30) == [reference(p, 30) for p in PROMPTS]
    assert acceptance(engine) < 0.5
    assert engine.stats()["spec_decode_num_draft_tokens"] > 0
    assert_no_leaks(engine)
    assert_draft_pool_empty(proposer)


def test_preemption_drops_the_shadow_and_the_tokens_stay_the_targets():
    engine, proposer = draft_engine(num_blocks=14)
    prompts = [[i, i + 1, i + 2] for i in range(5)]
    assert run_all(engine, prompts, 20) == [reference(p, 20) for p in prompts]
    assert engine.scheduler.num_preemptions > 0
    assert acceptance(engine) == 1.0
    assert_draft_pool_empty(proposer)


def test_a_full_draft_pool_only_stops_speculation():
    """Two blocks hold one short sequence's shadow at most: the others do not speculate."""
    engine, proposer = draft_engine(draft_blocks=3)
    prompts = [list(range(10)), [3, 4], [9, 8, 7]]
    assert run_all(engine, prompts, 12) == [reference(p, 12) for p in prompts]
    assert engine.stats()["spec_decode_num_drafts"] > 0
    assert_draft_pool_empty(proposer)


def test_abort_frees_the_draft_blocks():
    engine, proposer = draft_engine()
    seq = engine.add_request([1, 2, 3], greedy(30))
    other = engine.add_request([4, 5], greedy(30))
    while seq.seq_id not in proposer.shadows or not proposer.shadows[seq.seq_id].block_table:
        engine.step()
    assert engine.abort_request(seq.seq_id)
    assert seq.seq_id not in proposer.shadows
    finals = run_to_completion(engine)
    assert finals[str(other.seq_id)].outputs[0].token_ids == reference([4, 5], 30)
    assert_draft_pool_empty(proposer)


def test_a_failed_draft_step_costs_drafts_not_requests():
    engine, proposer = draft_engine(draft_fails_on=(2, 5))
    assert run_all(engine, PROMPTS[:2], 20) == [reference(p, 20) for p in PROMPTS[:2]]
    assert engine.stats()["spec_decode_num_accepted_tokens"] > 0
    assert_draft_pool_empty(proposer)


def test_the_shadow_resyncs_to_the_committed_tokens():
    """After a rejection the draft's cached count falls to the common prefix, and the last
    token is always fed again."""
    runner = FakeModelRunner(16, 4, VOCAB, order=1)
    proposer = DraftModelProposer(runner, K, 4, token_budget=64)
    seq = Sequence(0, [1, 2, 3, 4, 5])
    [drafts] = proposer.propose_batch([(seq, 10)])
    shadow = proposer.shadows[0]
    assert len(drafts) == K and shadow.token_ids == [1, 2, 3, 4, 5, *drafts]
    assert shadow.num_cached_tokens == 5 + K - 1  # the last draft is never fed
    for token in [drafts[0], (drafts[1] + 1) % VOCAB]:  # one accepted, then a correction
        seq.append_token(token)
    [again] = proposer.propose_batch([(seq, 1)])
    # Cut back to the 6 common tokens, the correction fed, the one new draft not.
    assert shadow.token_ids == [*seq.token_ids, *again] and len(again) == 1
    assert shadow.num_cached_tokens == 7
    proposer.release(0)
    assert_draft_pool_empty(proposer)


def test_helpers():
    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_len([1, 2, 3], [1, 5, 3]) == 1
    assert common_prefix_len([], [1]) == 0
    assert draft_pool_blocks(1000, 256, 16) == 500  # a share of the target's pool
    assert draft_pool_blocks(20, 256, 16) == 16  # at least one full-length sequence
    assert draft_pool_blocks(10, 256, 16) == 10  # never more than the target's


def test_a_draft_method_without_its_proposer_is_refused():
    config = EngineConfig(max_model_len=64, speculative_config=DRAFT)
    with pytest.raises(ValueError, match="needs its proposer"):
        LLMEngine(config, FakeModelRunner(8, 16, VOCAB))


def test_a_long_catch_up_is_fed_in_chunks_of_the_token_budget():
    """A 10-token prompt at a budget of 4: two steps feed it without drafting, the third
    finishes it and drafts."""
    proposer = DraftModelProposer(FakeModelRunner(16, 4, VOCAB), K, 4, token_budget=4)
    seq = Sequence(0, list(range(10)))
    assert proposer.propose_batch([(seq, 5)]) == [[]]
    assert proposer.propose_batch([(seq, 5)]) == [[]]
    assert proposer.shadows[0].num_cached_tokens == 8
    [drafts] = proposer.propose_batch([(seq, 5)])
    assert drafts == reference(list(range(10)), K)


def test_a_shadow_whose_prompt_no_longer_matches_starts_over():
    """Defensive: target tokens that diverge inside the shadow's prompt (never expected: a
    running sequence only grows) drop the shadow's KV instead of trusting it."""
    proposer = DraftModelProposer(FakeModelRunner(16, 4, VOCAB), K, 4, token_budget=64)
    proposer.propose_batch([(Sequence(0, [1, 2, 3, 4]), 5)])
    [drafts] = proposer.propose_batch([(Sequence(0, [1, 2, 9, 4, 5]), 5)])
    assert drafts == reference([1, 2, 9, 4, 5], K)
    assert proposer.shadows[0].num_prompt_tokens == 5
