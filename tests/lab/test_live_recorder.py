"""The live lab's recorder on the fake runner (no model, milliseconds): what each step planned,
read before the commit consumes it; preemptions; the ring's bound; and the JSON shapes."""

from __future__ import annotations

from minivllm import SamplingParams
from minivllm.lab.live import REQUEST_FIELDS, TIMELINE_FIELDS, LiveRecorder


def _recorder(engine, history: int = 300) -> LiveRecorder:
    return LiveRecorder.for_engine(engine, history)


def _names(engine) -> dict[int, str]:
    queued = [*engine.scheduler.waiting, *engine.scheduler.running]
    return {s.seq_id: f"r{s.seq_id}" for s in queued}


def test_plan_counts_chunks_and_decodes(make_engine) -> None:
    """A 10-token prompt under an 8-token budget is an 8-token chunk, then 2 prefill tokens
    (the chunk's rest), then decodes; num_scheduled_tokens is 0 between steps."""
    engine = make_engine(num_blocks=16, max_num_batched_tokens=8)
    recorder = _recorder(engine)
    engine.add_request(list(range(1, 11)), SamplingParams(max_tokens=3, ignore_eos=True))
    names = _names(engine)
    while engine.has_unfinished_requests():
        recorder.step(engine, names)
    timeline = [f.record for f in recorder.frames()]
    assert [(r.num_prefill_tokens, r.num_decode_tokens) for r in timeline] == [
        (8, 0),
        (2, 0),
        (0, 1),
        (0, 1),
    ]
    assert [r.scheduled for r in timeline] == [
        (("r0", 8),),
        (("r0", 2),),
        (("r0", 1),),
        (("r0", 1),),
    ]
    assert [r.step for r in timeline] == [1, 2, 3, 4]
    assert all(r.num_seqs == 1 and r.seconds >= 0 for r in timeline)
    first = recorder.frames()[0].requests_json()
    assert first == [
        {
            "request_id": "r0",
            "status": "RUNNING",
            "num_tokens": 10,
            "num_prompt_tokens": 10,
            "num_cached_tokens": 8,
            "num_scheduled_tokens": 0,
            "block_table": [0, 1],
        }
    ]
    assert recorder.frames()[-1].requests == ()  # finished: out of the queues


def test_preemption_is_recorded(make_engine) -> None:
    """Two sequences on a pool too small for both: the plan that preempts names the victim,
    the frame shows it WAITING with nothing cached, and the count goes up."""
    engine = make_engine(num_blocks=4, max_model_len=64)
    recorder = _recorder(engine)
    for _ in range(2):
        engine.add_request(list(range(1, 7)), SamplingParams(max_tokens=8, ignore_eos=True))
    names = _names(engine)
    while engine.has_unfinished_requests():
        recorder.step(engine, names)
    frames = recorder.frames()
    hit = next(f for f in frames if f.record.preempted)
    assert hit.record.preempted == ("r1",)
    victim = next(r for r in hit.requests_json() if r["request_id"] == "r1")
    assert victim["status"] == "WAITING" and victim["num_cached_tokens"] == 0
    assert victim["block_table"] == []
    assert hit.num_preemptions >= 1
    assert frames[-1].num_preemptions == engine.scheduler.num_preemptions


def test_history_is_bounded_and_live_has_the_issue_shape(make_engine) -> None:
    """The ring keeps the last `history` frames; /lab/api/live's JSON has exactly the issue's
    keys; the page's frames carry the hashed blocks only when they change."""
    engine = make_engine(num_blocks=32)
    recorder = _recorder(engine, history=5)
    engine.add_request(list(range(1, 9)), SamplingParams(max_tokens=12, ignore_eos=True))
    names = _names(engine)
    for _ in range(8):
        recorder.step(engine, names)
    frames = recorder.frames()
    assert [f.step for f in frames] == [4, 5, 6, 7, 8]
    live = recorder.live()
    assert set(live) == {"step", "requests", "kv_cache", "num_preemptions", "timeline"}
    assert live["step"] == 8 and live["num_preemptions"] == 0
    assert set(live["kv_cache"]) == {"num_blocks", "num_free_blocks"}
    assert live["kv_cache"] == {"num_blocks": 32, "num_free_blocks": 32 - 4}
    assert [tuple(r) for r in live["requests"]] == [REQUEST_FIELDS]
    assert [tuple(e) for e in live["timeline"]] == [TIMELINE_FIELDS] * 5
    page = recorder.frames_after(frames[1].index)
    assert [f["step"] for f in page["frames"]] == [6, 7, 8]
    hashed = [f["hashed_blocks"] for f in recorder.frames_after(-1)["frames"]]
    full = [list(f.hashed_blocks) for f in frames]
    assert hashed[0] == full[0] and page["frames"][0]["hashed_blocks"] == full[2]
    for i in range(1, 5):
        assert hashed[i] == (None if full[i] == full[i - 1] else full[i])
    engine.abort_request(0)
    recorder.snapshot(engine, names)
    assert recorder.live()["requests"] == [] and recorder.frames()[-1].record is None
