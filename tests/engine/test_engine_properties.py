"""Property tests: random workloads keep every invariant after every step.

Random arrivals, aborts, token budgets, pool sizes, block sizes, shared prefixes and
speculative decoding (n-gram drafts, on a fake model that repeats itself so drafts are
accepted, or a fake draft model, the target's own or another, with a small pool of its own).
After every step: the sequence invariants hold and each block's ref_count equals the number
of block tables holding it. In the end every request ends exactly once, each non-aborted one
with exactly the tokens the fake model gives it alone, and no block leaks, the draft's
included.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.engine_checks import assert_no_leaks
from support.fake_runner import FakeModelRunner, reference_completion

from minivllm.config import EngineConfig
from minivllm.engine.draft_model import DraftModelProposer
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import SamplingParams

PREFIXES = [list(range(1, 13)), list(range(20, 29)), []]

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(0, len(PREFIXES) - 1),
            st.lists(st.integers(0, 999), min_size=0, max_size=12),
            st.integers(1, 24),
        ),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 30)),
    ),
    min_size=4,
    max_size=60,
).filter(lambda script: sum(op[0] == "add" for op in script) >= 3)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.integers(1, 8),
    pool_tokens=st.integers(24, 160),
    budget=st.integers(1, 48),
    max_num_seqs=st.integers(1, 6),
    prefix_caching=st.booleans(),
    speculative_tokens=st.sampled_from([0, 1, 3]),
    draft=st.sampled_from([None, "self", "other"]),
    draft_pool_tokens=st.integers(8, 96),
    script=ops,
)
def test_random_workloads_keep_the_invariants(
    block_size,
    pool_tokens,
    budget,
    max_num_seqs,
    prefix_caching,
    speculative_tokens,
    draft,
    draft_pool_tokens,
    script,
):
    num_blocks = max(2, pool_tokens // block_size)  # small pools, to force preemption
    config = EngineConfig(
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=48,
        enable_prefix_caching=prefix_caching,
        speculative_config=(
            {"model": "fake", "num_speculative_tokens": speculative_tokens}
            if draft
            else {"method": "ngram", "num_speculative_tokens": speculative_tokens}
        )
        | {"prompt_lookup_min": 1}
        if speculative_tokens
        else None,
    )
    # With speculation, a model of the last token over 12 ids: outputs cycle, drafts hit.
    vocab, order = (12, 1) if speculative_tokens else (1000, None)
    proposer = None
    if speculative_tokens and draft:
        draft_runner = FakeModelRunner(
            max(2, draft_pool_tokens // block_size),
            block_size,
            vocab,
            order if draft == "self" else 2,
        )
        proposer = DraftModelProposer(draft_runner, speculative_tokens, block_size, budget)
    engine = LLMEngine(
        config, FakeModelRunner(num_blocks, block_size, vocab, order), proposer=proposer
    )
    added: dict[str, tuple[list[int], int]] = {}
    aborted: set[str] = set()
    finished: dict[str, object] = {}

    def record(outputs):
        for out in outputs:
            if out.finished:
                assert out.request_id not in finished, "a request ended twice"
                finished[out.request_id] = out

    seqs = []
    for op in script:
        if op[0] == "add":
            prompt = [t % vocab for t in PREFIXES[op[1]] + op[2]]
            params = SamplingParams(temperature=0.0, max_tokens=op[3])
            try:
                seq = engine.add_request(prompt, params)
            except ValueError:
                # Only requests that could never run are refused.
                total = len(prompt) + op[3]
                assert not prompt or total > 48 or -(-(total - 1) // block_size) > num_blocks
                continue
            seqs.append(seq)
            added[str(seq.seq_id)] = (prompt, op[3])
        elif op[0] == "step":
            record(engine.step())
        elif seqs:
            seq = seqs[op[1] % len(seqs)]
            if engine.abort_request(seq.seq_id):
                aborted.add(str(seq.seq_id))
        engine.scheduler.check_invariants()

    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        record(engine.step())
        engine.scheduler.check_invariants()
    assert not engine.has_unfinished_requests(), "the engine hung"

    assert set(finished) | aborted == set(added)
    assert not set(finished) & aborted
    for request_id, out in finished.items():
        prompt, max_tokens = added[request_id]
        assert out.outputs[0].token_ids == reference_completion(prompt, max_tokens, vocab, order)
    assert_no_leaks(engine)
    if proposer is not None:
        assert proposer.shadows == {}
        assert proposer.block_manager.num_free_blocks == proposer.block_manager.num_blocks
