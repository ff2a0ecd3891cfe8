"""Checks shared by the engine tests: the leak check and a step-to-completion driver."""

from __future__ import annotations

from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.runtime.output_processor import OutputProcessor


def assert_no_leaks(engine: LLMEngine) -> None:
    """The leak check: nothing queued, every block back in the pool with ref_count 0."""
    scheduler = engine.scheduler
    assert not scheduler.waiting and not scheduler.running, "requests left in the queues"
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks not returned"
    assert all(b.ref_count == 0 for b in bm.blocks), "ref counts not back to 0"
    scheduler.check_invariants()


def run_to_completion(engine: LLMEngine, check: bool = True, max_steps: int = 10_000) -> dict:
    """Step until idle; return {request_id: final RequestOutput}, through an OutputProcessor
    as `LLM` reads them (text, stop strings). Checks invariants each step."""
    finals = {}
    processor = OutputProcessor(engine)
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finals
        for out in processor.process(engine.step()):
            if out.finished:
                assert out.request_id not in finals, "a request finished twice"
                finals[out.request_id] = out
        if check:
            engine.scheduler.check_invariants()
    raise AssertionError("engine did not finish: a hang")
