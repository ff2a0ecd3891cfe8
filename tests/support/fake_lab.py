"""The lab's engine on the fake runner (block_size 4, no tokenizer), for the lab tests."""

from __future__ import annotations

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.tracing import Tracer
from minivllm.lab.scenarios import EngineShape
from support.fake_runner import FakeModelRunner

LAB_BLOCK_SIZE = 4
FAKE_SPEC_VOCAB = 16


def fake_lab_engine(
    shape: EngineShape, tracer: Tracer, block_size: int = LAB_BLOCK_SIZE
) -> LLMEngine:
    """A lab engine of `shape` on the fake runner (block_size 4 unless told, no tokenizer)."""
    config = EngineConfig(
        block_size=block_size,
        num_kv_blocks=shape.num_kv_blocks,
        max_num_batched_tokens=shape.max_num_batched_tokens,
        max_num_seqs=shape.max_num_seqs,
        max_model_len=256,
        speculative_config=shape.speculative_config,
    )
    if shape.speculative_config is not None:  # a model that repeats itself: drafts get accepted
        runner = FakeModelRunner(shape.num_kv_blocks, block_size, FAKE_SPEC_VOCAB, order=1)
    else:
        runner = FakeModelRunner(shape.num_kv_blocks, block_size)
    return LLMEngine(config, runner, None, tracer, proposer=shape.make_proposer())
