"""Engines for the lab on a real model: the weights are loaded once, each scenario gets a
fresh engine (new scheduler, new block manager, new tracer) on the same model runner.

A scenario asks for a small pool (4 blocks, to force a preemption) or a small step budget
(to force chunked prefill). The runner's physical KV cache is allocated once, big enough for
every scenario; each engine's scheduler is told the scenario's smaller block count, so it only
ever hands out blocks 0 .. num_kv_blocks - 1 of it.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from functools import lru_cache

from minivllm.config import SPECULATION_OFF
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.tracing import Tracer
from minivllm.lab.scenarios import MAX_BATCHED_TOKENS, MAX_KV_BLOCKS, EngineShape

LAB_MAX_MODEL_LEN = 512  # scenarios and the learner's requests stay far below this


class SharedModelEngines:
    """An EngineFactory over one loaded model."""

    def __init__(self, model: str | None, block_size: int) -> None:
        # As big as any scenario or learner may ask for (see ResetRequest).
        pool, budget = MAX_KV_BLOCKS, MAX_BATCHED_TOKENS
        self.base = LLMEngine.from_options(
            model=model,
            block_size=block_size,
            num_kv_blocks=pool,
            max_num_batched_tokens=budget,
            max_model_len=LAB_MAX_MODEL_LEN,
            # Each scenario's engine sets its own (chapter 07's speculates); the base engine
            # only lends them its runner, so it measures no default speculation at start-up.
            speculative_config=SPECULATION_OFF,
        )

    def __call__(self, shape: EngineShape, tracer: Tracer) -> LLMEngine:
        runner = self.base.model_runner
        if shape.num_kv_blocks > runner.num_kv_blocks:
            raise ValueError(
                f"scenario needs {shape.num_kv_blocks} KV blocks, the runner has "
                f"{runner.num_kv_blocks}"
            )
        # A shallow copy shares the weights and the KV tensors; only the count it reports to
        # the scheduler is smaller. It stays a ModelRunner, so traces name ModelRunner.run.
        view = copy.copy(runner)
        view.num_kv_blocks = shape.num_kv_blocks
        config = replace(
            self.base.config,
            num_kv_blocks=shape.num_kv_blocks,
            max_num_batched_tokens=shape.max_num_batched_tokens,
            max_num_seqs=shape.max_num_seqs,
            speculative_config=shape.speculative_config,
        )
        return LLMEngine(config, view, self.base.tokenizer, tracer, proposer=shape.make_proposer())


@lru_cache(maxsize=4)
def default_engines(model: str | None = None, block_size: int = 4) -> SharedModelEngines:
    """The shared factory for (model, block_size), loaded once per process."""
    return SharedModelEngines(model, block_size)
