"""The bookkeeping around the decode step's CUDA graphs (minivllm/engine/cuda_graphs.py), on
the CPU: the ladder of batch sizes, padding a step up to its graph, the static buffers, and a
replayed step against the eager one, with a stand-in graph that replays by calling.

Guards: a step run by a graph too small for it, padding rows left holding a previous step's
sequences (they would write into real KV blocks), the padding's K/V written anywhere but the
dummy block, a capture's metadata reused with index tensors of an earlier run, and graphs
taken where they must not be (enforce_eager, the CPU, tensor parallelism, prefill steps).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.model_fixtures import allocate_kv_caches, make_attention_metadata

from minivllm.config import EngineConfig
from minivllm.engine.cuda_graphs import (
    CudaGraphDecode,
    DecodeGraphInputs,
    capture_decode_graphs,
    graph_batch_sizes,
    padded_batch_size,
    use_cuda_graphs,
)
from minivllm.engine.device import staged
from minivllm.models.loader import load_model

BLOCK = 4


def test_ladder_and_padding() -> None:
    """Powers of two up to max_num_seqs (itself the top rung), capped at 256; a step takes the
    smallest rung that holds it, none past the top."""
    assert graph_batch_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert graph_batch_sizes(1000) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert graph_batch_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert graph_batch_sizes(1) == [1]
    sizes = graph_batch_sizes(100)
    assert [padded_batch_size(n, sizes) for n in (1, 3, 64, 65, 100)] == [1, 4, 64, 100, 100]
    assert padded_batch_size(101, sizes) is None


def test_graphs_only_on_one_cuda_process_without_enforce_eager() -> None:
    cuda = torch.device("cuda")
    assert use_cuda_graphs(False, cuda, 1)
    assert not use_cuda_graphs(True, cuda, 1)
    assert not use_cuda_graphs(False, torch.device("cpu"), 1)
    assert not use_cuda_graphs(False, cuda, 2)


def test_fill_pads_and_resets_rows_a_larger_step_left() -> None:
    """Rows past the step are padding again after a larger step: token 0 at position 0 of the
    dummy block, length 1; prefills and steps wider than the buffers are not held."""
    inputs = DecodeGraphInputs(8, 4, BLOCK, dummy_block=9, device="cpu")
    big, big_pos = make_attention_metadata([[s] for s in range(6)], [2] * 6, [1] * 6, BLOCK)
    inputs.fill(torch.arange(1, 7), big_pos, big, 8)
    small, small_pos = make_attention_metadata([[5, 6], [7]], [5, 1], [1, 1], BLOCK)
    inputs.fill(torch.tensor([11, 12]), small_pos, small, 4)
    assert inputs.input_ids[:4].tolist() == [11, 12, 0, 0]
    assert inputs.positions[:4].tolist() == [5, 1, 0, 0]
    assert inputs.slot_mapping[:4].tolist() == [6 * BLOCK + 1, 7 * BLOCK + 1, 36, 36]
    assert inputs.seq_lens[:4].tolist() == [6, 2, 1, 1]
    assert inputs.block_tables[:4, :2].tolist() == [[5, 6], [7, 0], [9, 9], [9, 9]]
    assert inputs.holds(small)
    prefill, _ = make_attention_metadata([[0]], [0], [3], BLOCK)
    assert not inputs.holds(prefill)
    wide, _ = make_attention_metadata([list(range(5))], [17], [1], BLOCK)
    assert not inputs.holds(wide)
    meta = inputs.metadata(4)
    assert meta.seq_lens_cpu == [16] * 4 and meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]


class Replay:
    """A stand-in for a CUDA graph: replaying reruns the forward into the captured output."""

    def __init__(self, run: Callable[[], torch.Tensor], out: torch.Tensor) -> None:
        self.run, self.out = run, out

    def replay(self) -> None:
        self.out.copy_(self.run())


def fake_capture(run: Callable[[], torch.Tensor], pool: Any) -> tuple[Replay, torch.Tensor]:
    out = run().clone()
    return Replay(run, out), out


def _prefill(model, caches, tables, prompts) -> None:
    for table, prompt in zip(tables, prompts, strict=True):
        meta, positions = make_attention_metadata([table], [0], [len(prompt) - 1], BLOCK)
        model(torch.tensor(prompt[:-1]), positions, caches, meta)


def test_a_replayed_step_matches_the_eager_one(tiny_llama_dir) -> None:
    """Six sequences then three (padded to 4, over rows the six left) through the graphs
    match the eager steps on a copy of the cache, and every KV block but the dummy one ends
    the same: the padding wrote nowhere else."""
    model, config = load_model(tiny_llama_dir, torch.float32, "cpu")
    head_dim = config.hidden_size // config.num_attention_heads
    num_blocks = 24  # 6 sequences of 4 blocks; block 24 is the dummy
    eager = allocate_kv_caches(
        config.num_hidden_layers, num_blocks + 1, BLOCK, config.num_key_value_heads, head_dim
    )
    tables = [list(range(4 * s, 4 * s + 4)) for s in range(6)]
    prompts = [[(5 * i + 3 * s) % config.vocab_size for i in range(3 + 2 * s)] for s in range(6)]
    inputs = DecodeGraphInputs(8, 4, BLOCK, dummy_block=num_blocks, device="cpu")
    with torch.inference_mode():
        _prefill(model, eager, tables, prompts)
        graphed = [(k.clone(), v.clone()) for k, v in eager]
        graphs = CudaGraphDecode(model, graphed, inputs)
        graphs.capture(fake_capture)
        assert sorted(graphs.graphs) == [1, 2, 4, 8]
        for seqs in (range(6), range(3)):
            meta, positions = make_attention_metadata(
                [tables[s] for s in seqs], [len(prompts[s]) - 1 for s in seqs], [1] * len(seqs), 4
            )
            ids = torch.tensor([prompts[s][-1] for s in seqs])
            assert graphs.applies(meta)
            want = model(ids, positions, eager, meta)
            got = graphs(ids, positions, graphed, meta)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for (k, v), (gk, gv) in zip(eager, graphed, strict=True):
        torch.testing.assert_close(gk[:num_blocks], k[:num_blocks], equal_nan=True)
        torch.testing.assert_close(gv[:num_blocks], v[:num_blocks], equal_nan=True)


def test_sdpa_attention_gets_no_graphs() -> None:
    """SDPA sizes its gathers from the metadata's Python lengths, fixed at capture: no graphs."""
    config = EngineConfig(model="x", max_num_seqs=4)
    assert capture_decode_graphs(lambda *a: a[0], [], config, 8, {"sdpa"}) is None


@pytest.mark.parametrize("backends", [{"triton"}, {"flash"}])
def test_a_capture_that_fails_leaves_eager_steps(backends, monkeypatch, caplog) -> None:
    """An op that cannot be captured (a host sync, say) is logged, and decode runs eagerly."""
    import minivllm.engine.cuda_graphs as cuda_graphs

    def failing(run, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs, "capture_cuda_graph", failing)
    config = EngineConfig(model="x", max_num_seqs=4, max_model_len=16, block_size=BLOCK)
    caches = allocate_kv_caches(1, 5, BLOCK, 1, 8)
    assert capture_decode_graphs(lambda *a: a[0], caches, config, 4, backends) is None
    assert "decode steps run eagerly" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_graphs_give_the_eager_engines_tokens_on_cuda(tiny_llama_dir) -> None:
    """On CUDA the decode steps replay captured graphs (padded batches of 3, then 2 and 1 as
    requests finish) and sample the tokens the eager engine samples, greedy, in fp32."""
    from minivllm import LLM, SamplingParams

    prompts = [[5, 6, 7, 8], [9] * 30, [3, 4]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 8, 4)]
    tokens = {}
    for eager in (True, False):
        llm = LLM(
            str(tiny_llama_dir),
            device="cuda",
            dtype="float32",
            max_model_len=64,
            max_num_seqs=8,
            enforce_eager=eager,
        )
        assert (llm.llm_engine.model_runner.cuda_graphs is None) == eager
        out = llm.generate(prompts, params, use_tqdm=False)
        tokens[eager] = [o.outputs[0].token_ids for o in out]
    assert tokens[True] == tokens[False]


def test_step_inputs_are_staged_for_their_device() -> None:
    """The runner's step tensors: int64 with the values given, on the CPU as before (no pinned
    memory, which a CPU-only torch cannot allocate); on CUDA copied from pinned host memory."""
    got = staged([[1, 2], [3, 4]], torch.device("cpu"))
    assert got.dtype == torch.int64 and got.tolist() == [[1, 2], [3, 4]]
    if torch.cuda.is_available():
        on_gpu = staged([5, 6, 7], torch.device("cuda"))
        assert on_gpu.is_cuda and on_gpu.tolist() == [5, 6, 7]
