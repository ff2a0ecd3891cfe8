"""Embedding requests in the engine core, without torch: a fake runner pools token ids the way
the real one pools hidden states (a running sum the commit carries, the mean at the end).

Guards: an embedding request is prefill-only (never sampled, finished with its vector when
its prompt has run, its blocks freed), its partial pool carried across chunks and dropped on
preemption, no cached prefix taken (its positions would have nothing to pool), no draft tokens,
and the sentence-transformers pooling config read from the model directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.engine_checks import assert_no_leaks, run_to_completion
from support.fake_runner import FakeModelRunner

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.pooling_config import model_pooling, with_pooling
from minivllm.engine.runner_output import RunnerOutput
from minivllm.engine.scheduler import ScheduledBatch
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import SamplingParams


class PoolingFakeRunner(FakeModelRunner):
    """FakeModelRunner plus pooling: an embedding's vector is [the mean of its token ids]."""

    def run(self, batch: ScheduledBatch, token_bitmask: object = None) -> RunnerOutput:
        output = super().run(batch, token_bitmask)
        for seq in batch.seqs:
            if seq.pooling is None:
                continue
            start, n = seq.num_cached_tokens, seq.num_scheduled_tokens
            total = (seq.pooled or 0) + sum(seq.token_ids[start : start + n])
            if start + n < seq.num_tokens:
                output.pooled[seq.seq_id] = total
            else:
                output.embeddings[seq.seq_id] = [total / seq.num_tokens]
        return output


def engine_with(num_blocks: int = 64, **options: object) -> LLMEngine:
    config = EngineConfig(block_size=4, max_model_len=64, **options)  # type: ignore[arg-type]
    return LLMEngine(config, PoolingFakeRunner(num_blocks, 4))


def mean(ids: list[int]) -> list[float]:
    return [sum(ids) / len(ids)]


def test_embedding_is_prefill_only_chunked_and_beside_generation() -> None:
    """In chunks of a 6-token budget beside a generating request: the embedding is never
    sampled, ends "stop" with the mean over all its chunks, and frees its blocks."""
    engine = engine_with(max_num_batched_tokens=6)
    prompt = list(range(1, 30))
    engine.add_request(list(range(40, 45)), SamplingParams(max_tokens=8), request_id="gen")
    engine.add_request(prompt, PoolingParams(), request_id="emb")
    finals = run_to_completion(engine)
    emb = finals["emb"]
    assert emb.embedding == mean(prompt)
    assert emb.outputs[0].token_ids == [] and emb.outputs[0].finish_reason == "stop"
    assert len(finals["gen"].outputs[0].token_ids) == 8 and finals["gen"].embedding is None
    assert_no_leaks(engine)


def test_preempted_embedding_restarts_its_pool() -> None:
    """A pool too small for both: the embedding admitted last is preempted mid-prompt and its
    mean is still over each position once."""
    engine = engine_with(num_blocks=10, max_num_batched_tokens=4)
    engine.add_request(list(range(40, 45)), SamplingParams(max_tokens=30, ignore_eos=True))
    seq = engine.add_request(list(range(1, 30)), PoolingParams())
    finals = run_to_completion(engine)
    assert seq.num_preemptions > 0
    assert finals[str(seq.seq_id)].embedding == mean(list(range(1, 30)))
    assert_no_leaks(engine)


def test_embedding_takes_no_cached_prefix_but_leaves_its_own() -> None:
    """A prompt already cached by a generation is computed in full for an embedding (all its
    positions pooled); a generation after the embedding hits the blocks it filled."""
    engine = engine_with()
    prompt = list(range(1, 22))
    engine.add_request(prompt, SamplingParams(max_tokens=2))
    run_to_completion(engine)
    engine.add_request(prompt, PoolingParams(), request_id="emb")
    out = run_to_completion(engine)["emb"]
    assert out.num_cached_prompt_tokens == 0 and out.embedding == mean(prompt)
    other = list(range(100, 121))
    engine.add_request(other, PoolingParams())
    run_to_completion(engine)
    engine.add_request(other, SamplingParams(max_tokens=2), request_id="gen")
    assert run_to_completion(engine)["gen"].num_cached_prompt_tokens == 20


def test_embedding_lengths_and_no_drafts() -> None:
    """An embedding may fill max_model_len (nothing is generated after it) but not pass it;
    with n-gram speculation on, a one-token last chunk (5 tokens, a budget of 4) whose prompt
    repeats itself gets no drafts."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "draft_token_cost": 0}
    engine = engine_with(speculative_config=spec, max_num_batched_tokens=4)
    engine.add_request([7] * 64, PoolingParams(), request_id="full")
    engine.add_request([1, 2, 1, 2, 1], PoolingParams(), request_id="short")
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([7] * 65, PoolingParams())
    finals = run_to_completion(engine)
    assert finals["full"].embedding == [7.0] and finals["short"].embedding == [7 / 5]
    assert engine.scheduler.spec_stats.as_stats()["spec_decode_num_drafts"] == 0


def test_method_defaults_to_the_engine_option() -> None:
    """A request naming no method takes the engine's `pooling` (last when unresolved)."""
    seq = engine_with(pooling="mean").add_request([1, 2], PoolingParams())
    assert seq.pooling == PoolingParams(method="mean")
    assert engine_with().add_request([1, 2], PoolingParams()).pooling.method == "last"
    with pytest.raises(ValueError, match="pooling"):
        EngineConfig(pooling="max")


def write_st_config(model_dir: Path, **modes: bool) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    (model_dir / "modules.json").write_text(json.dumps(modules))
    (model_dir / "1_Pooling").mkdir(exist_ok=True)
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(modes))


def test_pooling_read_from_a_sentence_transformers_config(tmp_path: Path) -> None:
    """modules.json's Pooling module decides the default; the option wins; an unsupported
    mode is a clear error; no config means last."""
    assert model_pooling(tmp_path) is None
    assert with_pooling(EngineConfig(), tmp_path).pooling == "last"
    write_st_config(tmp_path, pooling_mode_mean_tokens=True, pooling_mode_cls_token=False)
    assert with_pooling(EngineConfig(), tmp_path).pooling == "mean"
    assert with_pooling(EngineConfig(pooling="cls"), tmp_path).pooling == "cls"
    write_st_config(tmp_path, pooling_mode_max_tokens=True)
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        model_pooling(tmp_path)
