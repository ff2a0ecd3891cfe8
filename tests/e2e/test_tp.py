"""Tensor parallelism on the CPU (gloo): TP=2 gives TP=1's greedy tokens, and fails cleanly.

Each TP=2 engine starts one worker process (rank 1). The tests protect: the column/row/vocab
splits and their collectives (token parity with TP=1) for every model family, KV heads split
evenly, unevenly (SmolLM2's 3 KV heads over 2 ranks) and replicated (1 KV head), a KV group's
query heads split across its replicas (5 heads / 1 KV head at TP=2, 14 / 2 at TP=4), the
all-reduce MIN of the KV block count, and that a dead worker is a clear RuntimeError with no
process left behind.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from support.model_fixtures import (
    FAMILIES,
    build_tokenizer,
    save_tiny_checkpoint,
    tiny_config_kwargs,
)
from transformers import Qwen2Config, Qwen3Config
from transformers import Qwen2ForCausalLM as HFQwen2ForCausalLM
from transformers import Qwen3ForCausalLM as HFQwen3ForCausalLM

from minivllm import LLM, SamplingParams
from minivllm.distributed.heads import HeadShard, shard_heads
from minivllm.engine import tp_runner

PROMPTS = [[5, 17, 42, 99, 3], list(range(10, 60)), [7] * 23, list(range(10, 40)) + [300, 301]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def child_pids() -> set[int]:
    """Live (non-zombie) processes whose parent is this one, read from /proc."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == os.getpid() and state != "Z":
            pids.add(int(entry))
    return pids


def assert_gone(pids: list[int]) -> None:
    """Each pid is neither running nor a zombie: reaped, not orphaned."""
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"worker {pid} left behind"


@contextmanager
def tp_llm(model: str | None, tp_size: int = 2, **options: object) -> Iterator[LLM]:
    """A TP engine (2 ranks unless told), closed afterwards (one process group per process);
    checks its workers were reaped."""
    llm = LLM(model, tensor_parallel_size=tp_size, **options)
    pids = [p.pid for p in llm.llm_engine.model_runner._workers.procs.values()]
    try:
        yield llm
    finally:
        llm.llm_engine.close()
        assert_gone(pids)


def tokens(llm: LLM, prompts: list, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny_qwen3_one_kv_head_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3 with a single KV head: TP=2 must replicate it on both ranks."""
    kwargs = {**tiny_config_kwargs(build_tokenizer()), "num_key_value_heads": 1}
    config = Qwen3Config(**kwargs, tie_word_embeddings=False)
    config.architectures = ["Qwen3ForCausalLM"]
    out_dir = tmp_path_factory.mktemp("tiny_qwen3_1kv")
    return save_tiny_checkpoint(out_dir, HFQwen3ForCausalLM, config, 3)


@pytest.fixture(scope="module")
def odd_heads_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Qwen2 checkpoints (q/k/v biases follow the split) with 5 heads / 1 KV head and
    14 heads / 2 KV heads (Qwen2.5-0.5B's layout)."""
    dirs = {}
    for name, heads, kv_heads in [("5h1kv", 5, 1), ("14h2kv", 14, 2)]:
        kwargs = {
            **tiny_config_kwargs(build_tokenizer()),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
        }
        config = Qwen2Config(**kwargs, tie_word_embeddings=True)
        config.architectures = ["Qwen2ForCausalLM"]
        out_dir = tmp_path_factory.mktemp(f"tiny_qwen2_{name}")
        dirs[name] = save_tiny_checkpoint(out_dir, HFQwen2ForCausalLM, config, 4)
    return dirs


def test_heads_split_in_whole_kv_groups():
    """Even split, uneven split (3 KV heads over 2 ranks), replication, and the refusals."""
    assert shard_heads(4, 2, 1, 0) == HeadShard(0, 4, 0, 2)
    assert [shard_heads(4, 2, 2, r) for r in range(2)] == [
        HeadShard(0, 2, 0, 1),
        HeadShard(2, 2, 1, 1),
    ]
    assert [shard_heads(9, 3, 2, r) for r in range(2)] == [
        HeadShard(0, 3, 0, 1),
        HeadShard(3, 6, 1, 2),
    ]
    # Fewer KV heads than ranks: each rank keeps the one KV head its query heads read.
    assert [shard_heads(8, 2, 4, r) for r in range(4)] == [
        HeadShard(0, 2, 0, 1),
        HeadShard(2, 2, 0, 1),
        HeadShard(4, 2, 1, 1),
        HeadShard(6, 2, 1, 1),
    ]
    with pytest.raises(ValueError, match="cannot split 4 attention heads"):
        shard_heads(4, 2, 5, 0)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        shard_heads(6, 4, 2, 0)


def test_a_kv_groups_query_heads_split_across_its_replicas():
    """Fewer KV heads than ranks, in any layout: ranks dealt to KV heads in contiguous runs,
    each run sharing its KV head's query heads as evenly as possible."""
    assert [shard_heads(5, 1, 2, r) for r in range(2)] == [
        HeadShard(0, 2, 0, 1),
        HeadShard(2, 3, 0, 1),
    ]
    assert [shard_heads(14, 2, 4, r) for r in range(4)] == [
        HeadShard(0, 3, 0, 1),
        HeadShard(3, 4, 0, 1),
        HeadShard(7, 3, 1, 1),
        HeadShard(10, 4, 1, 1),
    ]
    assert [shard_heads(4, 2, 3, r) for r in range(3)] == [  # KV head 0 on two ranks, 1 on one
        HeadShard(0, 1, 0, 1),
        HeadShard(1, 1, 0, 1),
        HeadShard(2, 2, 1, 1),
    ]
    for heads, kv_heads in [(5, 1), (14, 2), (9, 3), (12, 4), (7, 7)]:
        for tp_size in range(1, heads + 1):
            shards = [shard_heads(heads, kv_heads, tp_size, r) for r in range(tp_size)]
            starts = [s.q_start for s in shards]
            assert starts == sorted(starts) and sum(s.num_heads for s in shards) == heads
            for s in shards:  # every query head's KV head is on its rank
                group = heads // kv_heads
                assert s.num_heads > 0
                assert s.kv_start <= s.q_start // group
                assert (s.q_start + s.num_heads - 1) // group < s.kv_start + s.num_kv_heads


def test_unsplittable_model_fails_before_any_worker_starts(tiny_llama_dir):
    """Heads split over 3 ranks, but the MLP width (128) does not; 5 ranks exceed the heads."""
    before = child_pids()
    with pytest.raises(ValueError, match="tensor_parallel_size=3: its intermediate_size"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=3, max_model_len=128)
    with pytest.raises(ValueError, match="4 attention heads over tensor_parallel_size=5"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=5, max_model_len=128)
    assert child_pids() <= before


def test_more_ranks_than_gpus_fails_before_any_worker_starts(tiny_llama_dir, monkeypatch):
    """On CUDA each rank takes a GPU: two ranks on a one-GPU machine is a clear error, not a
    worker dead of "invalid device ordinal" (torch's CUDA queries faked: CI has no GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    before = child_pids()
    with pytest.raises(ValueError, match="tensor_parallel_size=2 on CUDA needs 2 GPUs.*sees 1"):
        LLM(str(tiny_llama_dir), device="cuda", tensor_parallel_size=2, max_model_len=128)
    assert child_pids() <= before


@pytest.mark.parametrize("arch", ["tiny_qwen3_dir", "tiny_llama_dir", "tiny_qwen3_one_kv_head_dir"])
def test_tp2_greedy_tokens_equal_tp1(request, arch):
    """Chunked prefill (16-token budget) mixes prefills and decodes; the second round hits
    the prefix cache. Qwen3 is untied with q/k norms, Llama ties the LM head to the
    embedding, the third model replicates its single KV head."""
    model_dir = str(request.getfixturevalue(arch))
    options = dict(max_model_len=128, max_num_batched_tokens=16, dtype="float32")
    want = tokens(LLM(model_dir, **options), PROMPTS)
    with tp_llm(model_dir, **options) as llm:
        for _ in range(2):
            assert tokens(llm, PROMPTS) == want
        assert llm.llm_engine.scheduler.block_manager.prefix_hits > 0


def test_tp2_greedy_tokens_equal_tp1_for_every_family(tiny_family_dirs):
    """Qwen2 (biases), Mistral and Phi-3 (windows; Phi-3's fused checkpoint split per rank),
    Gemma 2 and 3 (soft-caps, sandwich norms, scaled embeddings): one TP=2 engine each, over
    chunked prefill and prefix hits."""
    options = dict(max_model_len=128, max_num_batched_tokens=16, dtype="float32")
    for family in FAMILIES:
        model_dir = str(tiny_family_dirs[family])
        want = tokens(LLM(model_dir, **options), PROMPTS + PROMPTS[1:2])
        with tp_llm(model_dir, **options) as llm:
            assert tokens(llm, PROMPTS + PROMPTS[1:2]) == want, family
            assert llm.llm_engine.scheduler.block_manager.prefix_hits > 0


@pytest.mark.parametrize("layout,tp_size", [("5h1kv", 2), ("14h2kv", 4)])
def test_odd_head_layouts_equal_tp1(odd_heads_dirs, layout, tp_size):
    """A KV group's query heads split across the ranks that replicate its KV head."""
    model_dir = str(odd_heads_dirs[layout])
    options = dict(max_model_len=128, max_num_batched_tokens=16, dtype="float32")
    want = tokens(LLM(model_dir, **options), PROMPTS)
    with tp_llm(model_dir, tp_size, **options) as llm:
        assert tokens(llm, PROMPTS) == want
        assert llm.llm_engine.model_runner._runner.num_kv_heads == 1


@pytest.mark.default_model
def test_tp2_default_model_matches_tp1_and_agrees_on_blocks(default_llm_fp32):
    """SmolLM2-135M: 9 heads / 3 KV heads split 3+6 / 1+2 over two ranks. Rank 1 holds twice
    rank 0's KV heads, so from the same memory budget it fits half the blocks: the engine
    must use rank 1's count (the all-reduce MIN), or rank 1 would index past its pool."""
    prompts = ["The capital of France is", "Once upon a time"]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = tokens(default_llm_fp32, prompts, params)
    budget_gb = 0.05
    with tp_llm(None, max_model_len=256, kv_cache_memory_gb=budget_gb, dtype="float32") as llm:
        assert tokens(llm, prompts, params) == want
        runner = llm.llm_engine.model_runner
        bytes_per_block_rank1 = 2 * 30 * runner.block_size * 2 * 64 * 4  # layers, K+V, fp32
        assert runner._runner.num_kv_heads == 1  # rank 0's own
        assert runner.num_kv_blocks == int(budget_gb * 1e9 // bytes_per_block_rank1)


def test_killed_worker_is_a_clear_error_and_nothing_is_left_behind(tiny_qwen3_dir):
    llm = LLM(str(tiny_qwen3_dir), tensor_parallel_size=2, max_model_len=128)
    worker = llm.llm_engine.model_runner._workers.procs[1]
    assert worker.pid in child_pids()
    assert len(tokens(llm, PROMPTS[:1])) == 1
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(timeout=10)
    out = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert all("worker rank 1" in o.error and "SIGKILL" in o.error for o in out), out[0].error
    assert not llm.llm_engine.has_unfinished_requests()
    again = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)  # still an error, not a hang
    assert "worker rank 1" in again[0].error
    llm.llm_engine.close()
    assert_gone([worker.pid])


def test_worker_killed_mid_generation_fails_the_step(tiny_qwen3_dir):
    """Killed while rank 0 is stepping (most likely waiting in a collective): gloo's closed
    connection, not a timeout. The kill lands a few steps in, 50 ms before the request could
    possibly end (it has ~395 steps to go), whatever the machine's speed."""
    llm = LLM(str(tiny_qwen3_dir), tensor_parallel_size=2, max_model_len=512)
    engine = llm.llm_engine
    worker = engine.model_runner._workers.procs[1]
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    engine.add_request(PROMPTS[0], long)
    for _ in range(5):
        assert not [o for o in engine.step() if o.finished]
    threading.Timer(0.05, os.kill, (worker.pid, signal.SIGKILL)).start()
    start = time.monotonic()
    finished = []
    while not finished and time.monotonic() - start < 30:
        finished = [o for o in engine.step() if o.finished]
    [out] = finished
    assert out.error is not None and "SIGKILL" in out.error
    assert len(out.outputs[0].token_ids) < 400 and time.monotonic() - start < 30
    engine.close()
    assert_gone([worker.pid])


def test_worker_that_fails_at_start_is_a_clear_error(tiny_llama_dir, monkeypatch):
    """A worker raising before the rendezvous: rank 0 reports its error at once (no waiting
    for the rendezvous timeout) and leaves no process or process group behind."""
    fail = (
        "import sys; a = sys.argv; open(a[a.index('--error-file') + 1], 'w')"
        ".write('Traceback ...\\nValueError: no shard for you'); sys.exit(3)"
    )
    monkeypatch.setattr(tp_runner, "WORKER_COMMAND", [sys.executable, "-c", fail])
    before = child_pids()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 .* exited with code 3: ValueError: no shard"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, max_model_len=128)
    assert time.monotonic() - start < 30
    assert child_pids() <= before
    import torch.distributed as dist

    assert not dist.is_initialized()
