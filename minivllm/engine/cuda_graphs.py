"""CUDA graphs for decode steps: the model's forward captured once per batch size at load,
replayed at each decode step, so a step costs one launch instead of hundreds of kernel
launches from Python.

A graph replays the exact kernels it captured on the exact memory it captured, so:

- batch sizes come from a ladder (`graph_batch_sizes`: 1, 2, 4, 8, ... capped by
  `max_num_seqs`), and a step runs the smallest graph that holds it (`padded_batch_size`);
- the step's inputs are copied into static buffers (`DecodeGraphInputs`): input ids,
  positions, slot mapping, block tables, sequence lengths; the rows past the step's
  sequences are padding, which decodes token 0 at position 0 of a dummy KV block (one block
  the runner allocates past the block manager's pool), so it reads and writes nothing real;
- the captured attention sees every sequence as up to `max_blocks` blocks long (the
  metadata's Python lengths are those of the capture): the kernels read the true lengths
  from the buffers at replay.

Steps with several tokens a sequence (prefills, verify steps), larger batches, and
`enforce_eager` run eagerly. Only the capture (`CudaGraphDecode.capture`) needs a GPU; the
ladder, the padding and the buffers are plain code, tested on the CPU
(tests/engine/test_cuda_graphs.py) with a stand-in for the graph that replays by calling.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from minivllm.config import EngineConfig
from minivllm.layers.attention import AttentionMetadata
from minivllm.paging import blocks_for
from minivllm.startup import phase

logger = logging.getLogger(__name__)

# The largest batch captured: above, a step's matmuls dwarf its launch overhead.
MAX_GRAPH_BATCH = 256

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
Forward = Callable[[torch.Tensor, torch.Tensor, KVCaches, AttentionMetadata], torch.Tensor]


def graph_batch_sizes(max_num_seqs: int, cap: int = MAX_GRAPH_BATCH) -> list[int]:
    """The batch sizes captured: powers of two below `min(max_num_seqs, cap)`, then that."""
    top = min(max_num_seqs, cap)
    sizes = [1 << i for i in range(top.bit_length()) if 1 << i < top]
    return [*sizes, top]


def padded_batch_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `num_seqs` sequences (None: past the ladder)."""
    return next((size for size in sizes if size >= num_seqs), None)


def use_cuda_graphs(enforce_eager: bool, device: torch.device, tp_size: int) -> bool:
    """Decode steps replay graphs on CUDA, one process, unless `enforce_eager` (vLLM's name)."""
    return not enforce_eager and device.type == "cuda" and tp_size == 1


class DecodeGraphInputs:
    """The static input buffers every graph reads, sized for the ladder's largest batch.

    `fill` copies a decode step's inputs into the first rows and pads the rest up to the
    graph's size; `metadata(size)` is the `AttentionMetadata` a graph of `size` is captured
    with, its tensors views of the buffers.
    """

    def __init__(
        self, max_batch: int, max_blocks: int, block_size: int, dummy_block: int, device: Any
    ) -> None:
        """`dummy_block`: a KV block no sequence owns, where the padding rows' K/V go."""
        self.max_batch, self.max_blocks, self.block_size = max_batch, max_blocks, block_size
        self.dummy_block = dummy_block
        self.dummy_slot = dummy_block * block_size
        options = {"dtype": torch.int64, "device": device}
        self.input_ids = torch.zeros(max_batch, **options)
        self.positions = torch.zeros(max_batch, **options)
        self.slot_mapping = torch.full((max_batch,), self.dummy_slot, **options)
        self.seq_lens = torch.ones(max_batch, **options)
        self.block_tables = torch.full((max_batch, max_blocks), dummy_block, **options)
        self.query_start_loc = torch.arange(max_batch + 1, **options)  # one token a sequence

    def holds(self, meta: AttentionMetadata) -> bool:
        """Whether a step fits: decode-only, no more sequences or blocks than the buffers."""
        return (
            meta.is_decode_only
            and meta.num_seqs <= self.max_batch
            and meta.block_tables.shape[1] <= self.max_blocks
        )

    def metadata(self, size: int) -> AttentionMetadata:
        """A fresh metadata over the first `size` rows (fresh: its cached index tensors are
        computed inside the capture, from the buffers, not kept from an earlier run)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[self.max_blocks * self.block_size] * size,
            block_size=self.block_size,
        )

    def fill(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, size: int
    ) -> None:
        """Copy a decode step of `meta.num_seqs` sequences into rows `0..n-1` and make rows
        `n..size-1` padding again (a larger step may have left real rows there)."""
        n, width = meta.num_seqs, meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        # Columns past `width` keep stale blocks: only blocks below a sequence's length are read.
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slot_mapping[n:size].fill_(self.dummy_slot)
        self.seq_lens[n:size].fill_(1)
        self.block_tables[n:size].fill_(self.dummy_block)


class Graph(Protocol):
    """A captured forward: `replay()` reruns it on the buffers, writing the same output."""

    def replay(self) -> None: ...


def capture_cuda_graph(run: Callable[[], torch.Tensor], pool: Any) -> tuple[Graph, torch.Tensor]:
    """`run` captured into a CUDA graph (after one eager run, which compiles its Triton
    kernels and settles the allocator), and the output tensor its replays write."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


class CudaGraphDecode:
    """Decode steps through captured graphs: `applies(meta)`, then call it as the model."""

    def __init__(self, model: Forward, kv_caches: KVCaches, inputs: DecodeGraphInputs) -> None:
        self.model, self.kv_caches, self.inputs = model, kv_caches, inputs
        self.sizes = graph_batch_sizes(inputs.max_batch, inputs.max_batch)
        self.graphs: dict[int, tuple[Graph, torch.Tensor]] = {}

    def capture(
        self, capture: Callable[[Callable[[], torch.Tensor], Any], tuple[Graph, torch.Tensor]]
    ) -> None:
        """One graph per ladder size, the largest first (the smaller ones reuse its memory
        pool); `capture(run, pool)` makes one (`capture_cuda_graph` on CUDA)."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None
        for size in reversed(self.sizes):
            ids, positions = self.inputs.input_ids[:size], self.inputs.positions[:size]

            def run(size: int = size, ids: torch.Tensor = ids, pos: torch.Tensor = positions):
                return self.model(ids, pos, self.kv_caches, self.inputs.metadata(size))

            self.graphs[size] = capture(run, pool)
        logger.info(
            "captured CUDA graphs of the decode step for %d batch sizes (1-%d) in %.1f s "
            "(enforce_eager=True skips them)",
            len(self.sizes),
            self.sizes[-1],
            time.perf_counter() - start,
        )

    def applies(self, meta: AttentionMetadata) -> bool:
        """Whether a step replays a graph: a decode step the buffers hold."""
        return bool(self.graphs) and self.inputs.holds(meta)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The step's last hidden states `[num_seqs, hidden]`: a view of the graph's output,
        valid until the next replay."""
        size = padded_batch_size(meta.num_seqs, self.sizes)
        assert size is not None, "applies() admits only steps the ladder holds"
        self.inputs.fill(input_ids, positions, meta, size)
        graph, out = self.graphs[size]
        graph.replay()
        return out[: meta.num_seqs]


def capture_decode_graphs(
    model: Forward,
    kv_caches: KVCaches,
    config: EngineConfig,
    num_kv_blocks: int,
    attention_backends: set[str],
) -> CudaGraphDecode | None:
    """The decode graphs of a model on CUDA, captured now; the KV pool holds
    `num_kv_blocks + 1` blocks, the last the padding rows' dummy block. None where its
    attention reads Python-side lengths (SDPA's gathers: only flash-attn and our Triton kernel
    read the lengths from the buffers), or the capture failed (logged; steps run eagerly)."""
    if not attention_backends <= {"flash", "triton"}:
        logger.info("no CUDA graphs: attention %s is not graph-safe", attention_backends)
        return None
    block_size = config.block_size
    max_blocks = num_kv_blocks
    if config.max_model_len is not None:
        max_blocks = min(max_blocks, blocks_for(config.max_model_len, block_size))
    device = kv_caches[0][0].device
    batch = min(config.max_num_seqs, MAX_GRAPH_BATCH)
    inputs = DecodeGraphInputs(batch, max_blocks, block_size, num_kv_blocks, device)
    graphs = CudaGraphDecode(model, kv_caches, inputs)
    try:
        with torch.inference_mode(), phase("capturing the decode step's CUDA graphs"):
            graphs.capture(capture_cuda_graph)
    except RuntimeError as error:  # an op that syncs with the host cannot be captured
        logger.warning("CUDA graph capture failed, decode steps run eagerly: %s", error)
        return None
    return graphs
