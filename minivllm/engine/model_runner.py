"""ModelRunner: executes a plan on the model over a paged KV cache, and samples.

From the plan (`ScheduledBatch`) it builds the flat step inputs: `input_ids`, `positions`,
`slot_mapping` (`slot = block_table[pos // block_size] * block_size + pos % block_size`),
query and context lengths and the block-tables tensor, all passed to the model in an explicit
`AttentionMetadata`. It computes logits only for the sequences that sample this step. It
never changes a Sequence: committing the step is the Scheduler's job.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minivllm.config import EngineConfig
from minivllm.distributed import parallel_state
from minivllm.distributed.heads import shard_heads
from minivllm.engine import gpu_memory, memory, weight_policy
from minivllm.engine.compiled_decode import CompiledDecode, compile_decode_step
from minivllm.engine.cuda_graphs import CudaGraphDecode, capture_decode_graphs, use_cuda_graphs
from minivllm.engine.device import resolve_device, resolve_dtype, staged
from minivllm.engine.logits import compute_logits_in_slices, joined_logits, score_prompt_rows
from minivllm.engine.lora_manager import lora_manager
from minivllm.engine.pooler import pool_batch
from minivllm.engine.runner_output import RunnerOutput, SampledToken
from minivllm.engine.scheduler import ScheduledBatch
from minivllm.engine.sequence import Sequence
from minivllm.layers.attention import AttentionMetadata, kv_quant
from minivllm.layers.attention.backends import AttentionSpec
from minivllm.layers.attention.layer import bind_attention_backends
from minivllm.layers.attention.paged_decode import paged_decode_supported
from minivllm.layers.quantization.policy import WeightPolicy
from minivllm.layers.rejection_sampler import verify
from minivllm.layers.sampler import Sampler, SamplingBatch
from minivllm.models.gguf import iter_state, warn_dense_fallback
from minivllm.models.gguf_blocks import attach_blocks
from minivllm.models.gguf_file import GGUFFile
from minivllm.models.loader import load_model
from minivllm.models.paths import gguf_source

logger = logging.getLogger(__name__)


def slot_mapping_for(block_table: list[int], start: int, length: int, block_size: int) -> list[int]:
    """KV slots of positions start .. start+length-1 (the tutorial chapter's formula)."""
    return [
        block_table[pos // block_size] * block_size + pos % block_size
        for pos in range(start, start + length)
    ]


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    # [num_samples + num_prompt_rows] int64: the last token of each sampling sequence (and
    # each of its draft tokens, with speculation), then the tokens whose logits give prompt
    # logprobs
    logits_indices: torch.Tensor
    sampling: SamplingBatch
    # (sequence, first prompt position scored, how many): one run of rows after the samples'
    prompt_logprob_runs: list[tuple[Sequence, int, int]]


def prepare_inputs(
    batch: ScheduledBatch,
    block_size: int,
    device: torch.device,
    token_bitmask: np.ndarray | None = None,
) -> StepInputs:
    """Flatten a plan into the model's step inputs (pure bookkeeping, one pass over seqs);
    `token_bitmask`: the allowed tokens of each `sample_seqs` row (structured outputs)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    for seq in batch.seqs:
        start, n = seq.num_cached_tokens, seq.num_scheduled_tokens
        input_ids.extend(seq.planned_token_ids[start : start + n])
        positions.extend(range(start, start + n))
        slots.extend(slot_mapping_for(seq.block_table, start, n, block_size))
        query_lens.append(n)
        seq_lens.append(start + n)
    max_blocks = max(len(s.block_table) for s in batch.seqs)
    tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in batch.seqs]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    sampling_set = {id(s) for s in batch.sample_seqs}
    logits_indices = [  # a sequence with k drafts samples from its last k + 1 tokens
        row
        for i, s in enumerate(batch.seqs)
        if id(s) in sampling_set
        for row in range(starts[i + 1] - 1 - len(s.spec_token_ids), starts[i + 1])
    ]
    prompt_runs = _prompt_logprob_runs(batch, starts, logits_indices)

    def tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
        return staged(values, device)

    meta = AttentionMetadata(
        slot_mapping=tensor(slots),
        query_start_loc=tensor(starts),
        seq_lens=tensor(seq_lens),
        block_tables=tensor(tables),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        block_size=block_size,
    )
    return StepInputs(
        tensor(input_ids),
        tensor(positions),
        meta,
        tensor(logits_indices),
        sampling_batch(batch, token_bitmask),
        prompt_runs,
    )


def _prompt_logprob_runs(
    batch: ScheduledBatch, starts: list[int], logits_indices: list[int]
) -> list[tuple[Sequence, int, int]]:
    """(seq, first prompt position, count) of each sequence scoring its prompt this step; the
    rows whose logits do so are appended to `logits_indices` (the logits at position p score
    the prompt token at p + 1)."""
    runs = []
    for i, seq in enumerate(batch.seqs):
        if seq.sampling_params.prompt_logprobs is None:
            continue
        start = seq.num_cached_tokens
        first, last = start + 1, min(start + seq.num_scheduled_tokens, seq.num_prompt_tokens - 1)
        if first <= last:
            runs.append((seq, first, last - first + 1))
            logits_indices.extend(range(starts[i], starts[i] + last - first + 1))
    return runs


def sampling_batch(batch: ScheduledBatch, bitmask: np.ndarray | None = None) -> SamplingBatch:
    """The sampler's rows: one per sampling sequence, or with draft tokens one per draft plus
    one, row j seeing the drafts before it as the sequence's tokens. `bitmask`: int32
    [len(sample_seqs), ceil(vocab / 32)], the tokens each sampling sequence may take."""
    seqs = batch.sample_seqs
    if not any(s.spec_token_ids for s in seqs):
        return SamplingBatch(
            params=[s.sampling_params for s in seqs],
            positions=[s.num_tokens for s in seqs],
            token_ids=[s.token_ids for s in seqs],
            num_prompt_tokens=[s.num_prompt_tokens for s in seqs],
            token_bitmask=None if bitmask is None else torch.from_numpy(bitmask),  # [rows, W]
        )
    rows = [len(s.spec_token_ids) + 1 for s in seqs]  # the bitmask has sum(rows) rows too
    return SamplingBatch(
        params=[s.sampling_params for s, n in zip(seqs, rows) for _ in range(n)],
        positions=[s.num_tokens + j for s, n in zip(seqs, rows) for j in range(n)],
        # Copies only where penalties read them.
        token_ids=[
            s.token_ids + s.spec_token_ids[:j]
            if j and s.sampling_params.has_penalties
            else s.token_ids
            for s, n in zip(seqs, rows)
            for j in range(n)
        ],
        num_prompt_tokens=[s.num_prompt_tokens for s, n in zip(seqs, rows) for _ in range(n)],
        token_bitmask=None if bitmask is None else torch.from_numpy(bitmask),
        draft_token_ids=[list(s.spec_token_ids) for s in seqs],
    )


class ModelRunner:
    """Owns the model weights, the KV cache and the sampler of one engine."""

    def __init__(
        self,
        config: EngineConfig,
        model_dir: Path,
        hf_config: Any,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        """With `tp_size > 1` this is rank `tp_rank`'s shard (see minivllm.distributed)."""
        self.config = config
        self.model_dir = model_dir
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, self.device)
        kv_option = (config.kv_cache_dtype, config.dtype, self.dtype, self.device)
        self.kv_cache_dtype = kv_quant.resolve_kv_cache_dtype(*kv_option)  # K/V: kv_quant.py
        self.kv_dtype = kv_quant.kv_storage_dtype(self.kv_cache_dtype, self.dtype)
        self.block_size = config.block_size
        torch.manual_seed(config.seed)
        # Start-up, one named step each: load, quantize and pack, LoRA slots, attention backends,
        # KV cache sized and allocated, decode step compiled (CPU) or captured (CUDA), memory.
        self.model, self.hf_config = self._load_model(model_dir, tp_rank, tp_size)
        # the kernel of the weights kept as stored: "int4", "qgemv", "blocks" or None (dense)
        self.weight_kernel = self._quantize()
        self.mapped = self.gguf.addresses() if self.gguf else range(0)  # the file's own pages
        self.lora = lora_manager(config, self.model, self.dtype)
        self._read_model_shape(tp_rank, tp_size)
        self.attention_backends = self._bind_attention()  # before sizing: its peak counts
        self.num_kv_blocks = self._size_kv_cache(tp_size)
        # CUDA graphs' padding rows write to one more block, past the block manager's pool.
        self.graphs_on = use_cuda_graphs(config.eager, self.device, tp_size)
        self.kv_caches = self._allocate_kv_cache()
        self.sampler = Sampler(config.seed, self.device, config.eos_token_ids)
        memory.hold_step_blocks(self.device)
        # one-sequence decode steps' torch threads (None: torch's; engine/runtime/cpu_share.py)
        self.small_step_threads: int | None = None
        self.compiled_decode = self._warm_up_compiled_decode(tp_size)
        self.cuda_graphs: CudaGraphDecode | None = None
        if self.graphs_on:
            self.cuda_graphs = capture_decode_graphs(
                self.model, self.kv_caches, self.config, self.num_kv_blocks, self.attention_backends
            )
        self.memory = self._measure_memory()

    def _read_model_shape(self, tp_rank: int, tp_size: int) -> None:
        """The sizes the cache and the sampler need, from the model's config."""
        self.vocab_size: int = int(self.hf_config.vocab_size)
        self.num_layers = int(self.hf_config.num_hidden_layers)
        num_heads = int(self.hf_config.num_attention_heads)
        # This rank's KV heads: all of them unless tensor-parallel.
        self.num_kv_heads = shard_heads(
            num_heads,
            int(getattr(self.hf_config, "num_key_value_heads", None) or num_heads),
            tp_size,
            tp_rank,
        ).num_kv_heads
        self.head_dim = int(
            getattr(self.hf_config, "head_dim", None)
            or self.hf_config.hidden_size // self.hf_config.num_attention_heads
        )

    def _size_kv_cache(self, tp_size: int) -> int:
        """The number of KV blocks: `config.num_kv_blocks`, else what the memory budget holds."""
        num_blocks = self.config.num_kv_blocks or self._blocks_from_memory_budget()
        if tp_size > 1:  # every rank sized its own pool: keep the smallest, valid everywhere
            num_blocks = parallel_state.all_reduce_min(num_blocks, self.device)
        return num_blocks

    def _allocate_kv_cache(self) -> list[kv_quant.KVCache]:
        """One (K, V) pair per layer, `[num_kv_blocks, block_size, num_kv_heads, head_dim]`
        (an int8 one with its scales beside it); one spare block for the decode graphs'
        padded rows when they are on."""
        blocks = self.num_kv_blocks + int(self.graphs_on)
        shape = (blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return [
            kv_quant.allocate_kv_cache(shape, self.kv_cache_dtype, self.dtype, self.device)
            for _ in range(self.num_layers)
        ]

    def _bind_attention(self) -> set[str]:
        """Each attention layer's backend, chosen once for this device, dtypes and cache."""
        spec = AttentionSpec(self.device, self.dtype, self.kv_dtype, self.head_dim, self.block_size)
        backends = bind_attention_backends(self.model, spec)
        logger.info("attention: %s", ", ".join(sorted(backends)))
        return backends

    def _warm_up_compiled_decode(self, tp_size: int) -> CompiledDecode | None:
        """The compiled decode step, its graphs built now (None: eager steps only)."""
        if not compile_decode_step(
            self.config.eager, self.device, self.dtype, tp_size, self.weight_kernel
        ):
            return None
        # Decode steps of several sequences compile too where the paged kernel attends: the
        # layers' backend, and GGUF block models' fp32 steps (their eager steps keep SDPA).
        paged = paged_decode_supported(
            self.device,
            self.dtype,
            self.kv_dtype,
            self.head_dim,
            quantized=self.weight_kernel == "blocks",
        )
        compiled = CompiledDecode(
            self.model, paged=paged, stored_blocks=self.weight_kernel == "blocks"
        )
        compiled.warm_up(self.kv_caches, self.block_size)
        return compiled

    def _measure_memory(self) -> memory.MemoryReport:
        """The weights' and the KV pool's bytes and the peak resident memory, logged once."""
        report = memory.measure(
            self.model,
            self.kv_caches,
            self.num_kv_blocks,
            self.mapped,
            self.block_size,
        )
        logger.info(report.log_line(self.block_size, self.kv_dtype, self.device))
        return report

    def _load_model(self, model_dir: Path, tp_rank: int, tp_size: int) -> tuple[Any, Any]:
        """Build the model and load its weights, how each runs decided first, once (`WeightPolicy`).
        A GGUF is read in place (memory-mapped; `model_dir` then holds its config and
        tokenizer), its quantized weights kept as stored blocks where the policy says so."""
        source = gguf_source(self.config.model)
        self.gguf = GGUFFile(source) if source else None
        warn_dense_fallback(self.gguf, self.dtype)
        self.weight_policy = WeightPolicy.decide(
            self.config, self.device, self.dtype, tp_size, gguf=self.gguf is not None
        )
        # checkpoint names of the weights kept as the GGUF's blocks, filled before loading
        self.block_weights: set[str] = set()
        model, hf_config = load_model(
            model_dir,
            self.dtype,
            self.device,
            tp_rank=tp_rank,
            tp_size=tp_size,
            weights=iter_state(self.gguf, skip=self.block_weights.__contains__)
            if self.gguf
            else None,
            attach=self._attach_blocks if self.weight_policy.keep_blocks else None,
        )
        if self.gguf is not None:
            self.gguf.release_pages()
        if self.block_weights:
            weight_policy.log_block_weights(model, len(self.block_weights))
        return model, hf_config

    def _attach_blocks(self, model: torch.nn.Module) -> set[str]:
        assert self.gguf is not None
        self.block_weights.update(attach_blocks(model, self.gguf, self.weight_policy))
        return self.block_weights

    def _quantize(self) -> str | None:
        """Give the loaded layers the methods the weight policy chose; returns the kernel of
        the weights kept as stored ("int4", "qgemv", "blocks"; None: none are)."""
        return weight_policy.apply_weight_policy(
            self.model, self.weight_policy, self.gguf, self.block_weights
        )

    def _bytes_per_block(self) -> int:
        """One block's K and V over all layers, scales included."""
        per_token = kv_quant.bytes_per_token(
            self.kv_cache_dtype, self.dtype, self.num_kv_heads, self.head_dim
        )
        return self.num_layers * self.block_size * per_token

    def _blocks_from_memory_budget(self) -> int:
        if self.device.type == "cuda":  # what is left after a profiled peak (gpu_memory.py)
            shape = (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim)
            return gpu_memory.kv_blocks_after_profiled_peak(
                self.model, self.config, shape, self.kv_dtype, self.device, self._bytes_per_block()
            )
        in_file = memory.weight_bytes(self.model, self.mapped)[1]
        budget = memory.kv_cache_budget(self.config, self.device, in_file)
        return memory.kv_blocks_for_budget(self.config, budget, self._bytes_per_block())

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, token_bitmask: np.ndarray | None = None) -> RunnerOutput:
        """Execute the plan: write the new tokens' KV, and sample for the finished prompts
        (within `token_bitmask`'s allowed tokens, one row per `sample_seqs`, if given)."""
        inputs = prepare_inputs(batch, self.block_size, self.device, token_bitmask)
        if self.small_step_threads is None or inputs.meta.num_tokens != 1:
            return self._run(inputs, batch)
        threads = torch.get_num_threads()
        torch.set_num_threads(self.small_step_threads)
        try:
            return self._run(inputs, batch)
        finally:
            torch.set_num_threads(threads)

    def _run(self, inputs: StepInputs, batch: ScheduledBatch) -> RunnerOutput:
        forward = self.model
        self.lora.set_batch(batch.seqs, self.device)  # each row's adapter (a no-op: LoRA off)
        if self.compiled_decode is not None and self.compiled_decode.applies(inputs.meta):
            forward = self.compiled_decode
        elif self.cuda_graphs is not None and self.cuda_graphs.applies(inputs.meta):
            forward = self.cuda_graphs
        hidden = forward(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        num_samples = len(inputs.sampling.params)  # rows: drafts add one each
        slices = compute_logits_in_slices(self.model, hidden, inputs.logits_indices)
        output = RunnerOutput()
        output.pooled, output.embeddings = pool_batch(batch, hidden)  # embedding requests'
        if inputs.prompt_logprob_runs:
            logits = score_prompt_rows(
                slices, inputs.prompt_logprob_runs, num_samples, output.prompt_logprobs
            )
        else:
            logits = joined_logits(slices) if num_samples else None
        if logits is None:
            return output
        if inputs.sampling.draft_token_ids is None:
            out = self.sampler(logits, inputs.sampling)  # logits: [num_samples, V]
        else:
            out = verify(self.sampler, logits, inputs.sampling)  # logits: [draft rows, V]
        logprobs = out.logprobs or [None] * len(out.token_ids)
        accepted = out.num_accepted or [0] * len(out.token_ids)
        drafted = out.draft_logprobs or [None] * len(out.token_ids)
        output.samples = [
            SampledToken(t, lp, n, dl)
            for t, lp, n, dl in zip(out.token_ids, logprobs, accepted, drafted, strict=True)
        ]
        return output
