"""Shared fixtures. `make_engine` builds engine-core engines on the fake runner (wrapped in a
FaultyRunner that fails nothing until a test arms it) and checks, after every test, that
nothing leaked: no request left queued, every block free.

Helpers live in `tests/support/` (on pytest's pythonpath); the tiny HF checkpoints are the
session-scoped fixtures of `support.model_fixtures`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from support.engine_checks import assert_no_leaks
from support.fake_runner import FakeModelRunner
from support.faults import FaultyRunner

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.tracing import Tracer

pytest_plugins = ["support.model_fixtures"]


def pytest_configure(config: pytest.Config) -> None:
    """Every graph a test compiles goes to the Inductor cache of the CPU capability torch
    runs (the engine's own choice, `inductor_cache_dir`): torch 2.13's default cache, filled
    by the AVX-512 pass of `make test` and read by its AVX2 pass on the same machine, gave a
    graph around our qgemv operator that returned wrong values (test_qgemv.py)."""
    import os

    from minivllm.engine.compiled_decode import inductor_cache_dir

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir()


@pytest.fixture
def make_engine() -> Iterator[Callable[..., LLMEngine]]:
    engines: list[LLMEngine] = []

    def make(
        num_blocks: int = 64,
        trace: bool = False,
        vocab_size: int = 1000,
        order: int | None = None,
        **options: object,
    ) -> LLMEngine:
        options.setdefault("block_size", 4)
        options.setdefault("max_model_len", 512)
        config = EngineConfig(**options)  # type: ignore[arg-type]
        runner = FaultyRunner(FakeModelRunner(num_blocks, config.block_size, vocab_size, order))
        engine = LLMEngine(config, runner, tracer=Tracer() if trace else None)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert_no_leaks(engine)


@pytest.fixture(scope="session")
def default_llm():
    """The default model (SmolLM2-135M-Instruct) with the default options (on a CPU with
    native bf16: bf16 compute, its 4-bit weights packed int4), loaded once per session."""
    from minivllm import LLM

    return LLM(None, num_kv_blocks=1024, max_model_len=2048)


@pytest.fixture(scope="session")
def default_llm_fp32():
    """The default model on the token-exact fp32 path, for parity with HF transformers."""
    from minivllm import LLM

    return LLM(None, num_kv_blocks=1024, max_model_len=2048, dtype="float32")
