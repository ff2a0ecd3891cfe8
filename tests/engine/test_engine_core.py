"""The request state machine, on the fake runner: plan, execute, commit, field by field."""

from __future__ import annotations

import pytest
from support.engine_checks import run_to_completion
from support.fake_runner import FakeModelRunner, reference_completion

from minivllm.config import EngineConfig
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.sequence import Sequence, SequenceStatus, check_invariants
from minivllm.sampling_params import SamplingParams

RUNNING, WAITING, FINISHED = SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.FINISHED


def greedy(max_tokens: int = 8, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def fields(seq: Sequence) -> tuple:
    return (seq.status, seq.num_tokens, seq.num_cached_tokens, seq.num_scheduled_tokens)


def test_seed_experiment_plan_commit_decode(make_engine):
    """The chapter's 8-token experiment: scheduled grows at plan, cached only at commit."""
    engine = make_engine(trace=True)
    seq = engine.add_request(list(range(1, 9)), greedy(max_tokens=4))
    assert fields(seq) == (WAITING, 8, 0, 0) and seq.block_table == []

    batch = engine.plan()  # Plan Prefill
    assert fields(seq) == (RUNNING, 8, 0, 8)  # RUNNING, scheduled 8, cached still 0
    assert seq.num_prompt_tokens == 8 and len(seq.block_table) == 2

    engine.execute_and_commit(batch)  # Commit cache
    assert fields(seq) == (RUNNING, 9, 8, 0)
    assert seq.num_completion_tokens == 1

    engine.step()  # Decode
    assert fields(seq) == (RUNNING, 10, 9, 0)
    assert seq.num_prompt_tokens == 8

    # The tracer saw each field change in the phase that owns it.
    owners = {(e.field, e.phase) for e in engine.tracer.events if e.seq_id == seq.seq_id}
    assert ("num_scheduled_tokens", "plan") in owners
    assert ("num_cached_tokens", "commit") in owners
    assert ("num_cached_tokens", "plan") not in owners
    assert ("num_tokens", "commit") in owners
    events = [e for e in engine.tracer.events if e.field == "num_cached_tokens"]
    assert events[0].actor == "Scheduler.postprocess"
    assert events[0].source.startswith("minivllm/engine/scheduler.py:")
    engine.abort_request(seq.seq_id)


def test_append_token_changes_only_the_token_record():
    seq = Sequence(0, [5, 6, 7])
    seq.num_cached_tokens, seq.num_scheduled_tokens = 3, 0
    seq.append_token(9)
    assert (seq.num_tokens, seq.token_ids, seq.last_token) == (4, [5, 6, 7, 9], 9)
    assert (seq.num_cached_tokens, seq.num_scheduled_tokens) == (3, 0)
    assert seq.prompt_token_ids == [5, 6, 7] and seq.completion_token_ids == [9]
    assert seq.num_completion_tokens == 1 and seq.num_blocks(2) == 2


def test_chunked_prefill_takes_four_steps_and_stays_running(make_engine):
    """A 50-token prompt on a 16-token budget: cached 0 -> 16 -> 32 -> 48 -> 50, RUNNING."""
    engine = make_engine(max_num_batched_tokens=16)
    seq = engine.add_request(list(range(100, 150)), greedy(max_tokens=2))
    cached = [seq.num_cached_tokens]
    for _ in range(4):
        engine.step()
        cached.append(seq.num_cached_tokens)
        assert seq.status == RUNNING
    assert cached == [0, 16, 32, 48, 50]
    assert seq.num_completion_tokens == 1  # only the last chunk samples
    run_to_completion(engine)


def test_chunked_prefill_shares_steps_with_decodes(make_engine):
    """Decodes are scheduled first; the rest of the budget (16 of 17) goes to the chunk."""
    engine = make_engine(max_num_batched_tokens=17)
    decoder = engine.add_request([1, 2, 3], greedy(max_tokens=10))
    engine.step()  # decoder's prefill
    long = engine.add_request(list(range(100, 150)), greedy(max_tokens=2))
    cached, decoded = [], []
    for _ in range(4):
        batch = engine.plan()
        assert batch.seqs[0] is decoder and decoder.num_scheduled_tokens == 1
        engine.execute_and_commit(batch)
        cached.append(long.num_cached_tokens)
        decoded.append(decoder.num_completion_tokens)
    assert cached == [16, 32, 48, 50]
    assert decoded == [2, 3, 4, 5]  # the decode never stalled behind the long prompt
    finals = run_to_completion(engine)
    assert finals[str(decoder.seq_id)].outputs[0].token_ids == reference_completion([1, 2, 3], 10)


def test_prefix_cache_hit_reuses_blocks_and_counts_cached_at_plan(make_engine):
    engine = make_engine(trace=True)
    shared = list(range(10, 18))  # two full blocks of 4
    first = engine.add_request(shared + [1, 2, 3], greedy(max_tokens=20))
    engine.step()  # first's prompt committed: its two full blocks are hashed
    second = engine.add_request(shared + [7, 7], greedy(max_tokens=3))
    batch = engine.plan()
    assert second.num_cached_tokens == 2 * 4  # moved at plan time, from the cache
    assert second.num_scheduled_tokens == 2
    assert second.block_table[:2] == first.block_table[:2]
    bm = engine.scheduler.block_manager
    assert [bm.blocks[b].ref_count for b in second.block_table[:2]] == [2, 2]
    engine.execute_and_commit(batch)
    finals = run_to_completion(engine)
    assert finals[str(second.seq_id)].outputs[0].token_ids == reference_completion(
        shared + [7, 7], 3
    )
    assert finals[str(second.seq_id)].num_cached_prompt_tokens == 8
    assert bm.prefix_hits == 8


def test_fully_cached_prompt_still_computes_its_last_token(make_engine):
    engine = make_engine()
    prompt = list(range(20, 28))  # exactly two blocks
    engine.add_request(prompt, greedy(max_tokens=1))
    run_to_completion(engine)
    again = engine.add_request(prompt, greedy(max_tokens=2))
    batch = engine.plan()
    # Block 2 holds the last token, which must be computed: only block 1 is a hit.
    assert again.num_cached_tokens == 4 and again.num_scheduled_tokens == 4
    engine.execute_and_commit(batch)
    finals = run_to_completion(engine)
    assert finals[str(again.seq_id)].outputs[0].token_ids == reference_completion(prompt, 2)


def test_freed_hashed_blocks_are_evicted_least_recently_freed_first(make_engine):
    engine = make_engine(num_blocks=4)
    a = list(range(30, 34)) + [0]  # one full block each (+1 token to compute)
    b = list(range(40, 44)) + [0]
    engine.add_request(a, greedy(max_tokens=1))
    run_to_completion(engine)
    engine.add_request(b, greedy(max_tokens=1))
    run_to_completion(engine)
    bm = engine.scheduler.block_manager
    assert len(bm.cached_blocks) == 2
    # A new 2-block request takes the two unhashed free blocks first, then one more: the
    # block freed longest ago (a's) is evicted, b's survives.
    engine.add_request(list(range(50, 59)), greedy(max_tokens=1))
    batch = engine.plan()
    survivors = {bm.blocks[i].token_ids for i in bm.cached_blocks.values()}
    assert survivors == {tuple(range(40, 44))}
    engine.execute_and_commit(batch)
    run_to_completion(engine)


def drive(scheduler: Scheduler, runner: FakeModelRunner) -> None:
    for _ in range(1000):
        if not scheduler.has_unfinished():
            return
        batch = scheduler.schedule()
        scheduler.postprocess(batch, runner.run(batch))
        scheduler.check_invariants()
    raise AssertionError("hang")


def test_forged_hash_collision_never_reuses_the_wrong_block():
    """Every block hashes to 0: a hit must still check the tokens, never trust the hash."""
    config = EngineConfig(block_size=4, max_model_len=64)
    scheduler = Scheduler(config, 16, hash_fn=lambda parent, tokens: 0)
    runner = FakeModelRunner(16, 4)
    one = Sequence(0, list(range(1, 10)), greedy(max_tokens=3))
    two = Sequence(1, list(range(11, 20)), greedy(max_tokens=3))
    scheduler.add(one)
    drive(scheduler, runner)
    scheduler.add(two)
    drive(scheduler, runner)
    assert two.num_preemptions == 0
    assert two.completion_token_ids == reference_completion(list(range(11, 20)), 3)
    assert scheduler.block_manager.prefix_hits == 0


def test_preemption_under_a_tiny_pool_gives_the_same_tokens(make_engine):
    prompts = [list(range(i * 10, i * 10 + 7)) for i in range(1, 5)]
    big = make_engine(num_blocks=64)
    small = make_engine(num_blocks=8, trace=True)
    for engine in (big, small):
        for p in prompts:
            engine.add_request(p, greedy(max_tokens=12))
    want = {k: v.outputs[0].token_ids for k, v in run_to_completion(big).items()}
    got = {k: v.outputs[0].token_ids for k, v in run_to_completion(small).items()}
    assert got == want == {str(i): reference_completion(p, 12) for i, p in enumerate(prompts)}
    assert small.scheduler.num_preemptions > 0
    # A preempted sequence went RUNNING -> WAITING with cached reset to 0 in the same plan.
    back = [e for e in small.tracer.events if e.field == "status" and e.after == "WAITING"]
    assert back and all(e.phase == "plan" for e in back)
    resets = [e for e in small.tracer.events if e.field == "num_cached_tokens" and e.after == 0]
    assert {e.seq_id for e in resets} >= {e.seq_id for e in back}


@pytest.mark.parametrize("when", ["waiting", "planned", "mid_prefill", "decoding"])
def test_abort_in_every_state_frees_everything(make_engine, when):
    engine = make_engine(max_num_batched_tokens=8)
    other = engine.add_request([9, 9, 9], greedy(max_tokens=20))
    seq = engine.add_request(list(range(1, 21)), greedy(max_tokens=5))
    batch = None
    if when == "planned":
        batch = engine.plan()
    elif when == "mid_prefill":
        engine.step()
        engine.step()
        assert 0 < seq.num_cached_tokens < seq.num_prompt_tokens
    elif when == "decoding":
        for _ in range(5):
            engine.step()
        assert seq.num_completion_tokens > 0
    assert engine.abort_request(seq.seq_id)
    assert seq.status == FINISHED and seq.finish_reason == "abort" and seq.block_table == []
    assert not engine.abort_request(seq.seq_id)  # once only
    if batch is not None:
        engine.execute_and_commit(batch)  # the pending plan commits only the others
        assert seq.num_scheduled_tokens == 0
    finals = run_to_completion(engine)
    assert finals[str(other.seq_id)].outputs[0].token_ids == reference_completion([9, 9, 9], 20)


def test_a_failing_run_commits_nothing_and_the_engine_stays_usable(make_engine):
    engine = make_engine()
    seq = engine.add_request(list(range(1, 9)), greedy(max_tokens=4))
    engine.step()
    engine.model_runner.fail_on_calls = {2}
    outs = engine.step()
    assert seq.num_cached_tokens == 8 and seq.num_tokens == 9  # the failed decode committed nothing
    assert seq.status == FINISHED and seq.finish_reason == "error" and seq.block_table == []
    assert outs[0].outputs[0].finish_reason == "error" and "injected fault" in outs[0].error
    later = engine.add_request([4, 5, 6], greedy(max_tokens=3))
    finals = run_to_completion(engine)
    assert finals[str(later.seq_id)].outputs[0].token_ids == reference_completion([4, 5, 6], 3)


def test_stop_conditions(make_engine):
    engine = make_engine(eos_token_ids=tuple(reference_completion([1, 2], 3)[1:2]))
    eos = engine.config.eos_token_ids[0]
    stops = engine.add_request([1, 2], greedy(max_tokens=5))
    ignores = engine.add_request([1, 2], greedy(max_tokens=5, ignore_eos=True))
    stop_id = engine.add_request(
        [1, 2],
        greedy(max_tokens=5, stop_token_ids=[reference_completion([1, 2], 3)[2]], ignore_eos=True),
    )
    finals = run_to_completion(engine)
    assert finals[str(stops.seq_id)].outputs[0].token_ids[-1] == eos
    assert finals[str(stops.seq_id)].outputs[0].finish_reason == "stop"
    assert len(finals[str(ignores.seq_id)].outputs[0].token_ids) == 5
    assert finals[str(ignores.seq_id)].outputs[0].finish_reason == "length"
    assert len(finals[str(stop_id.seq_id)].outputs[0].token_ids) == 3


def test_min_tokens_holds_off_eos(make_engine):
    first = reference_completion([3, 4], 1)[0]
    engine = make_engine(eos_token_ids=(first,))
    seq = engine.add_request([3, 4], greedy(max_tokens=4, min_tokens=2))
    run_to_completion(engine)
    assert seq.num_completion_tokens >= 2


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], greedy(), "empty"),
        (list(range(500)), greedy(max_tokens=20), "exceeds max_model_len (512)"),
        (list(range(10)), greedy(max_tokens=600), "exceeds max_model_len"),
        ([1, 2, 1000], greedy(), "outside the vocabulary"),
        ([1, -1], greedy(), "outside the vocabulary"),
    ],
)
def test_requests_that_can_never_run_are_rejected_at_once(make_engine, prompt, params, message):
    engine = make_engine()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished_requests()


def test_a_request_larger_than_the_pool_is_rejected_with_numbers(make_engine):
    engine = make_engine(num_blocks=4)
    with pytest.raises(ValueError, match=r"needs 5 KV blocks .* only 4"):
        engine.add_request(list(range(10)), greedy(max_tokens=10))


def test_invariant_checker_catches_a_broken_sequence():
    seq = Sequence(0, [1, 2, 3])
    seq.num_cached_tokens = 2
    seq.num_scheduled_tokens = 2
    with pytest.raises(AssertionError):
        check_invariants(seq, 4)


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1.0),
        dict(temperature=float("nan")),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-2),
        dict(n=0),
        dict(max_tokens=0),
        dict(max_tokens=-3),
        dict(min_p=2.0),
        dict(min_tokens=5, max_tokens=2),
        dict(stop=[1]),
        dict(logprobs=-1),
    ],
)
def test_invalid_sampling_params_raise_value_error(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_engine_config_is_frozen_and_validated():
    config = EngineConfig(block_size=4)
    with pytest.raises(AttributeError):
        config.block_size = 8  # type: ignore[misc]
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(TypeError, match="unknown engine option"):
        EngineConfig.from_options(blok_size=4)
