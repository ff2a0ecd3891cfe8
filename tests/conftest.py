"""Shared fixtures. `make_engine` builds engine-core engines on the fake runner and checks,
after every test, that nothing leaked: no request left queued, every block free."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))

pytest_plugins = ["model_fixtures"]

from fake_runner import FakeModelRunner  # noqa: E402

from minivllm.config import EngineConfig  # noqa: E402
from minivllm.engine.llm_engine import LLMEngine  # noqa: E402
from minivllm.engine.tracing import Tracer  # noqa: E402


def assert_no_leaks(engine: LLMEngine) -> None:
    """The leak check: nothing queued, every block back in the pool with ref_count 0."""
    scheduler = engine.scheduler
    assert not scheduler.waiting and not scheduler.running, "requests left in the queues"
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks not returned"
    assert all(b.ref_count == 0 for b in bm.blocks), "ref counts not back to 0"
    scheduler.check_invariants()


@pytest.fixture
def make_engine() -> Iterator[Callable[..., LLMEngine]]:
    engines: list[LLMEngine] = []

    def make(num_blocks: int = 64, trace: bool = False, vocab_size: int = 1000,
             **options: object) -> LLMEngine:
        options.setdefault("block_size", 4)
        options.setdefault("max_model_len", 512)
        config = EngineConfig(**options)  # type: ignore[arg-type]
        runner = FakeModelRunner(num_blocks, config.block_size, vocab_size)
        engine = LLMEngine(config, runner, tracer=Tracer() if trace else None)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert_no_leaks(engine)


@pytest.fixture(scope="session")
def default_llm():
    """The default model (SmolLM2-135M-Instruct), loaded once per test session."""
    from minivllm import LLM

    return LLM(None, num_kv_blocks=1024, max_model_len=2048)


def run_to_completion(engine: LLMEngine, check: bool = True, max_steps: int = 10_000) -> dict:
    """Step until idle; return {request_id: final RequestOutput}. Checks invariants each step."""
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finals
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals, "a request finished twice"
                finals[out.request_id] = out
        if check:
            engine.scheduler.check_invariants()
    raise AssertionError("engine did not finish: a hang")
