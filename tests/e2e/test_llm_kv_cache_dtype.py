"""A quantized or bf16 KV cache (`kv_cache_dtype` int8 / fp8 / bfloat16) end to end on a tiny
fp32 model: greedy output within vLLM's top-5 rule of the same run over the `auto` cache
under every schedule (the compiled decode step, chunked prefill, prefix reuse, preemption
under a tiny pool, speculative verification), and the KV budget holding more tokens in the
same bytes."""

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


def top_logprobs(output) -> list[float]:
    """The highest log-prob at each generated position of a greedy run."""
    return [max(lp.logprob for lp in entry.values()) for entry in output.outputs[0].logprobs]


# fp8's compiled step is the same graph around the same operator: one cold compile is enough.
CASES = [(k, s) for k in ("int8", "fp8") for s in SCHEDULES if (k, s) != ("fp8", "compiled-decode")]
# bf16 under fp32 maths (what `auto` is where the CPU has no bf16 maths and dtype is auto)
CASES += [("bfloat16", s) for s in SCHEDULES if s != "compiled-decode"]


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
    rounds = [quantized.generate(PROMPTS, params, use_tqdm=False) for _ in range(2)]
    for outputs in rounds:
        assert_within_top5(outputs, want)
    if kind == "bfloat16":  # a prefix-cache hit reads back what a lone prefill attended to
        first, again = ([x for o in outputs for x in top_logprobs(o)] for outputs in rounds)
        # float noise (threads' summation order: up to 1.03e-5 seen); the bf16 step is ~1e-3
        assert first == pytest.approx(again, abs=1e-4)
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


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_on_cuda_the_triton_kernel_reads_the_quantized_cache(tiny_llama_dir, kind):
    """On a GPU (skipped elsewhere) a quantized cache runs on our Triton kernel, read as
    stored, through chunked prefill, prefix reuse and decode steps replayed by CUDA graphs,
    within the top-5 rule of the auto cache on the same device."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("a CUDA GPU runs the compiled Triton kernel")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    runs = {}
    for cache in ("auto", kind):
        llm = LLM(
            str(tiny_llama_dir),
            device="cuda",
            dtype="float32",
            kv_cache_dtype=cache,
            max_model_len=128,
            max_num_batched_tokens=16,
        )
        runner = llm.llm_engine.model_runner
        assert "triton" in runner.attention_backends or cache == "auto"
        runs[cache] = [llm.generate(PROMPTS, params, use_tqdm=False) for _ in range(2)]
    assert runner.cuda_graphs is not None
    assert llm.llm_engine.scheduler.block_manager.prefix_hits > 0
    for outputs in runs[kind]:
        assert_within_top5(outputs, runs["auto"][0])


@pytest.fixture(scope="module")
def large_key_qwen2_dir(tmp_path_factory) -> str:
    """A tiny fp32 Qwen2 whose keys carry one huge rotary pair, as a real Qwen2.5's k_proj bias
    makes them (a 1.5B's layer 0 reaches 356 where the rest are tens): head_dim 64."""
    import torch
    from support.model_fixtures import build_tokenizer, tiny_config_kwargs
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    base = dict(tiny_config_kwargs(tokenizer), hidden_size=128, num_attention_heads=2)
    config = Qwen2Config(**dict(base, head_dim=64), tie_word_embeddings=True)
    config.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(21)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            bias = layer.self_attn.k_proj.bias.view(-1, 64)  # [KVH, D]
            bias[:, 5], bias[:, 5 + 32] = 40.0, -30.0  # one rotary pair (i, i + D/2)
    out = tmp_path_factory.mktemp("large_key_qwen2")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def test_int8_keeps_perplexity_where_a_few_key_channels_are_huge(large_key_qwen2_dir):
    """One token a step (the paged kernel over the cache) and in chunks of 16 (SDPA over the
    dequantized context), against the same fp32 engine over the `auto` cache: perplexity
    within 0.5% either way, and greedy output within the top-5 rule. With one scale per row
    and no turn of the keys (`kv_quant.key_rotation`) the huge pair sets the int8 step and
    this model's perplexity moves 1.4-1.5%, its top-1 agreement falls to 77%. (Top-1 is held
    to 90% only: a random model's near-ties flip 5-6% of it even without large keys.)"""
    import random

    from minivllm.bench.quality import compare, engine_scores

    rng = random.Random(3)
    token_ids = [rng.randrange(10, 380) for _ in range(160)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    scores, outputs = {}, {}
    for kind in ("auto", "int8"):
        llm = LLM(large_key_qwen2_dir, dtype="float32", kv_cache_dtype=kind, max_model_len=256)
        scores[kind] = {chunk: engine_scores(llm, token_ids, chunk) for chunk in (1, 16)}
        outputs[kind] = llm.generate(PROMPTS, params, use_tqdm=False)
    for chunk in (1, 16):
        r = compare(*scores["int8"][chunk], *scores["auto"][chunk])
        assert abs(r["perplexity_delta_pct"]) <= 0.5, (chunk, r)
        assert r["top1_agreement_pct"] >= 90.0, (chunk, r)
    assert_within_top5(outputs["int8"], outputs["auto"])
