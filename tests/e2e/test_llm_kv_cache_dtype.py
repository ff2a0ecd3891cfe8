"""A quantized KV cache (`kv_cache_dtype` int8 / fp8) end to end on a tiny fp32 model: greedy
output within vLLM's top-5 rule of the same run over the `auto` cache under every schedule
(the compiled decode step, chunked prefill, prefix reuse, preemption under a tiny pool,
speculative verification), and the KV budget holding more tokens in the same bytes."""

from __future__ import annotations

import functools

import pytest
from support.spec_checks import NGRAM

from minivllm import LLM, SamplingParams
from minivllm.layers.attention import kv_quant

PROMPTS = [
    [5, 17, 42, 99, 3] * 4,
    [7] * 23,
    list(range(10, 60)),  # longer than a 16-token budget
    list(range(10, 40)) + [300, 301],  # shares 30 tokens with the one before
    [200, 201, 202, 203, 204, 205, 206, 207, 1, 2, 3] * 2,
]
MAX_TOKENS = 12
TOP = 5
SCHEDULES = {
    # bf16 compute: the compiled decode step (fp32 with dense weights stays eager)
    "compiled-decode": dict(dtype="bfloat16"),
    "chunked-16": dict(max_num_batched_tokens=16, enforce_eager=True),
    "tiny-pool-preempts": dict(block_size=4, num_kv_blocks=24, enforce_eager=True),
    "speculative": dict(speculative_config=NGRAM, enforce_eager=True),
}


@functools.cache
def cached_llm(model_dir: str, kind: str, schedule: str) -> LLM:
    options = {"dtype": "float32", **SCHEDULES[schedule]}
    return LLM(model_dir, max_model_len=128, kv_cache_dtype=kind, **options)


def assert_within_top5(outputs, reference) -> None:
    """At the first token where the two greedy runs differ, each one's token is in the other's
    top-5 (vLLM's rule for lower-precision paths); later tokens then may differ."""
    for ours, theirs in zip(outputs, reference, strict=True):
        a, b = ours.outputs[0], theirs.outputs[0]
        assert len(a.token_ids) == len(b.token_ids) == MAX_TOKENS
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                assert y in a.logprobs[i] and x in b.logprobs[i], (i, a.token_ids, b.token_ids)
                break


# fp8's compiled step is the same graph around the same operator: one cold compile is enough.
CASES = [(k, s) for k in ("int8", "fp8") for s in SCHEDULES if (k, s) != ("fp8", "compiled-decode")]


@pytest.mark.parametrize("kind, schedule", CASES)
def test_greedy_stays_within_the_top5_rule_of_the_auto_cache(tiny_llama_dir, kind, schedule):
    """The same prompts twice (the second round reuses the first's prefix blocks)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    reference = cached_llm(str(tiny_llama_dir), "auto", schedule)
    quantized = cached_llm(str(tiny_llama_dir), kind, schedule)
    assert quantized.llm_engine.model_runner.kv_dtype == kv_quant.kv_storage_dtype(
        kind, reference.llm_engine.model_runner.dtype
    )
    want = reference.generate(PROMPTS, params, use_tqdm=False)
    for _ in range(2):
        assert_within_top5(quantized.generate(PROMPTS, params, use_tqdm=False), want)
    scheduler = quantized.llm_engine.scheduler
    stats = quantized.llm_engine.stats()
    if schedule == "tiny-pool-preempts":
        assert scheduler.num_preemptions > 0
    else:
        assert scheduler.block_manager.prefix_hits > 0
    if schedule == "compiled-decode":
        assert quantized.llm_engine.model_runner.compiled_decode is not None
    if schedule == "speculative":
        assert stats["spec_decode_num_accepted_tokens"] > 0
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_the_same_budget_holds_more_tokens(tiny_llama_dir):
    """kv_cache_memory_gb buys blocks at the stored bytes, scales included: the tiny model's
    fp32 rows are 64 bytes a head, int8's 16 + a 4-byte scale (3.2x), fp8's 16 (4x)."""
    blocks = {}
    for kind in ("auto", "int8", "fp8"):
        llm = LLM(
            str(tiny_llama_dir),
            dtype="float32",
            kv_cache_dtype=kind,
            kv_cache_memory_gb=0.001,
            max_model_len=128,
            enforce_eager=True,
        )
        report = llm.llm_engine.model_runner.memory
        per_token = 2 * kv_quant.bytes_per_token(kind, llm.llm_engine.model_runner.dtype, 2, 16)
        assert report.num_kv_blocks == int(1e6 // (16 * per_token))  # 2 layers, 16-token blocks
        assert report.kv_cache_bytes == report.num_kv_blocks * 16 * per_token <= 1e6
        assert report.gauges()["kv_cache_capacity_tokens"] == report.num_kv_blocks * 16
        blocks[kind] = report.num_kv_blocks
    assert blocks["int8"] == pytest.approx(3.2 * blocks["auto"], rel=0.02)
    assert blocks["fp8"] == pytest.approx(4 * blocks["auto"], rel=0.02)
