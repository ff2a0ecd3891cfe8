"""The decode step compiled with torch.compile (Inductor) on the CPU.

At batch 1 a decode step of the default model spends more time dispatching small ops (norms,
rotary, casts, residual adds, attention's gathers: dozens a layer) than in its matmuls.
Compiled, they become a few fused C++ loops per layer around the matmuls.

What is compiled: one decoder layer's forward, for decode-only steps, with attention as our
paged kernel's operator where it runs (bf16 models: `paged_decode_supported`), else as plain
tensor maths for one sequence (`minivllm.layers.attention.decode`); at one sequence the
kernel's step is the faster of the two (docs/benchmarks.md).
The layers of a model share their code, so one graph serves all of them (their weights are
the graph's inputs): compiling a layer costs a thirtieth of compiling the model.
Steps of up to as many sequences as the int4 kernel takes rows (4) are compiled, in one
graph (the number of sequences is a symbol), at start-up; larger steps stay eager, where the dense
bf16 matmuls run oneDNN-prepacked (opaque to Inductor, which would call aten::mm: slower).
The embedding, the LM head and the sampler stay eager. Without the paged kernel, steps of
several sequences stay eager: Inductor's own batched attention lost to SDPA
(docs/benchmarks.md).

Each step calls Dynamo (its guards, its gathering of a layer's weights) for the first layer of
each kind only; the other layers call that layer's Inductor graph directly (`LayerGraph`).

The context length is a dynamic dimension: one graph serves every length. `warm_up`
compiles it at start-up, with a progress bar; Inductor's on-disk caches live under the
minivllm cache (`<cache>/inductor/<CPU capability>`), so a second start-up reuses the
compiled code.

Where: CPU, one process, `enforce_eager=False` (see `compile_decode_step`), in bf16 compute,
or in fp32 when the weights run as stored through our qgemv kernel (AVX2-only CPUs' default).
fp32 with dense weights stays eager: it is the token-exact path, held to HF transformers.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from minivllm.cache import cache_dir
from minivllm.engine.dynamo_marks import (
    keep_guards_on_values,
    mark_cache_sizes_static,
    mark_weights_static,
)
from minivllm.layers.attention import AttentionMetadata
from minivllm.layers.attention.decode import DecodeMetadata, decode_metadata
from minivllm.layers.attention.kv_quant import KVCache
from minivllm.layers.cpu_kernels import cpu_caps
from minivllm.layers.quantization.methods import GgmlBlockMethod
from minivllm.layers.quantization.rows import compiled_steps_max_seqs, kernel_rows
from minivllm.startup import phase

logger = logging.getLogger(__name__)

KVCaches = list[KVCache]
# Most new tokens a sequence brings to a compiled step (1 + k drafts, k up to 7); a longer
# run is a prefill chunk, which SDPA over the gathered context computes faster.
MAX_QUERY = 8


def compile_decode_step(
    enforce_eager: bool,
    device: torch.device,
    dtype: torch.dtype,
    tp_size: int,
    weight_kernel: str | None = None,
) -> bool:
    """Whether the decode step is compiled: on the CPU, single-process, in bf16 or in fp32
    with the weights run as stored by our qgemv or GGUF-block kernels (an AVX2 CPU's
    default), unless `enforce_eager` (vLLM's name) asks for eager steps. fp32 with dense
    weights is the token-exact path and stays eager."""
    stored = weight_kernel in ("qgemv", "blocks")
    precision = dtype == torch.bfloat16 or (dtype == torch.float32 and stored)
    wanted = not enforce_eager and device.type == "cpu" and tp_size == 1 and precision
    return wanted and compiled_step_available()


@functools.cache
def compiled_step_available() -> bool:
    """Whether this torch's `torch.compile` takes the options the step is compiled with
    (`isolate_recompiles`: torch 2.13 has it, 2.11, a GPU image's, has not); where it does
    not, the step steps aside with one log line and decode runs eagerly."""
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
        return True
    logger.info(
        "the compiled decode step is off: torch %s's torch.compile has no isolate_recompiles "
        "(torch 2.13 has); decode steps run eagerly",
        torch.__version__,
    )
    return False


def inductor_cache_dir() -> str:
    """Where Inductor keeps its compiled code: `<minivllm cache>/inductor/<CPU capability>-<row
    table>`, unless the user chose a `TORCHINDUCTOR_CACHE_DIR` (torch sets that variable to
    its own default the first time anything compiles, so that value does not count as a
    choice).

    One cache per kernel kind: torch 2.13's Inductor caches, filled under the AVX-512 kernels
    and read with `ATEN_CPU_CAPABILITY=avx2`, gave a graph that skipped its in-place KV write
    (tests/models/test_compiled_decode.py caught it). And one per row table: a layer's graph
    holds up to the rows where its weight switches kernel, and a cached graph keeps the range
    it was traced with, so after a threshold moved each larger step missed it and compiled
    again inside requests (Gemma 3, c=16 with drafts: ITL p99 8.4 s; 1.5 s with a fresh
    cache)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return chosen
    table = hashlib.sha256(repr(kernel_rows()).encode()).hexdigest()[:8]
    return str(cache_dir() / "inductor" / f"{cpu_caps().capability}-{table}")


def kernel_switch_rows(layers: torch.nn.ModuleList) -> float:
    """The fewest rows (tokens in a step) above which some linear layer of `layers` runs
    another kernel: the first entry of its stored-block weight's row table (one below a row:
    that weight runs one kernel at every count)."""
    limits = [
        module.method.weight.table[0][0]
        for module in layers.modules()
        if isinstance(getattr(module, "method", None), GgmlBlockMethod)
    ]
    return min((limit for limit in limits if limit >= 1), default=float("inf"))


def _run_layer(layer: torch.nn.Module, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return layer(*args)


class LayerGraph:
    """One compiled graph of a decoder layer, callable without Dynamo.

    Dynamo lifts everything the layer reads into graph inputs and names where each came
    from, as a Python expression over the frame's locals `L` (`L['layer']...` for a layer's
    weights, norms' eps and their sizes; `L['args'][i]...` for the step's tensors). The
    layer's inputs are read once per layer; the step's, at each call. A graph with an input
    from anywhere else, or whose outputs are not the layer's two, is not `callable_directly`
    (its layers keep going through Dynamo).
    """

    def __init__(self, compiled: Callable[..., Any], graph: torch.fx.GraphModule) -> None:
        self.compiled = compiled
        self.layer_inputs: list[tuple[int, Callable, torch.dtype | None]] = []
        self.step_inputs: list[tuple[int, Callable, torch.dtype | None]] = []
        placeholders = [node for node in graph.graph.nodes if node.op == "placeholder"]
        self.num_inputs = len(placeholders)
        self._bound: dict[int, list[Any]] = {}  # id(layer) -> its inputs, step slots empty
        (outputs,) = graph.graph.output_node().args
        self.callable_directly = isinstance(outputs, tuple | list) and len(outputs) == 2
        for i, node in enumerate(placeholders):
            arg = node.meta.get("grapharg")
            source = arg.source.name if arg is not None else ""  # "L['layer']._modules[...]..."
            if not source.startswith(("L['layer']", "L['args']")):
                self.callable_directly = False
                return
            read = eval(f"lambda L: {source}")  # noqa: S307 - Dynamo's own source expression
            # Python floats (a norm's eps, say) reach the graph as 0-d tensors.
            as_tensor = arg.example.dtype if arg.pass_arg_as_tensor else None
            group = self.layer_inputs if source.startswith("L['layer']") else self.step_inputs
            group.append((i, read, as_tensor))

    @staticmethod
    def _value(read: Callable, frame: dict[str, Any], as_tensor: torch.dtype | None) -> Any:
        value = read(frame)
        return value if as_tensor is None else torch.tensor(value, dtype=as_tensor)

    def __call__(self, layer: torch.nn.Module, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        bound = self._bound.get(id(layer))
        if bound is None:
            bound = [None] * self.num_inputs
            for i, read, as_tensor in self.layer_inputs:
                bound[i] = self._value(read, {"layer": layer}, as_tensor)
            self._bound[id(layer)] = bound
        inputs = bound.copy()
        frame = {"args": args}
        for i, read, as_tensor in self.step_inputs:
            inputs[i] = self._value(read, frame, as_tensor)
        hidden, residual = self.compiled(*inputs)
        return hidden, residual


class CompiledDecode:
    """`model`'s forward with compiled layers for one-sequence decode steps (`applies`);
    `__call__` takes the eager step's inputs and returns the last hidden states.

    Dynamo checks its guards and gathers a layer's weights on every call of a compiled
    function, which at 30 layers cost more than the layers' fused kernels. So in each step
    only the first layer of each kind goes through Dynamo (which checks that step's inputs
    and names the graph it ran); the other layers of that kind call the same graph directly
    (`LayerGraph`). Layers are of a kind when Dynamo ran them with the same graph the first
    time it saw them: their guarded values are the same (Gemma's sliding-window and full layers
    are two kinds on the gathered path, whose window is a constant; one with the paged kernel,
    which reads it as data: `Attention.window`)."""

    def __init__(self, model: Any, paged: bool = False, stored_blocks: bool = False) -> None:
        """`paged`: our paged decode kernel runs here (`paged_decode_supported`), so steps of
        up to `max_seqs` sequences are compiled too, their attention read through the block
        tables. `stored_blocks`: the linear layers run on GGUF blocks, the same kernel at
        every step size."""
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir()
        self.paged = paged
        # The row table's answer (docs/benchmarks.md, "The thresholds the code uses"); with
        # blocks every step is compiled: the eager one's gathered SDPA and unfused element-wise
        # ops cost more (docs/performance.md, "The compiled decode step").
        self.max_seqs: float = compiled_steps_max_seqs(stored_blocks) if paged else 1
        # Steps of more tokens than this run eagerly: past it some layer's row table switches
        # kernel, and a graph traced below it would recompile (seconds) inside a request.
        self.max_tokens = kernel_switch_rows(model.model.layers)
        # Without this, a context length that happens to equal a model dim (head_dim / 2 at
        # warm-up, say) is traced as that dim, and the graph holds for that length only.
        torch.fx.experimental._config.use_duck_shape = False
        # And without this a step of one sequence is traced with its batch size as the
        # constant 1 (0/1 specialisation): the warm-up's graphs then missed the first real
        # steps of one and two sequences, which recompiled inside the first requests.
        torch.fx.experimental._config.backed_size_oblivious = True
        self.decoder = model.model  # the LlamaModel: embedding, layers, final norm
        for layer in self.decoder.layers:
            mark_weights_static(layer)
        # isolate_recompiles: this engine's graphs count against its own recompile limit, not
        # against every engine's in the process (past 8 in all, Dynamo ran them eagerly).
        self._run_layer = torch.compile(
            _run_layer,
            dynamic=True,
            backend=self._compile_graph,
            isolate_recompiles=True,
            options={"guard_filter_fn": keep_guards_on_values},
        )
        self._ran: LayerGraph | None = None  # the graph Dynamo's last call ran
        self._kind: dict[int, LayerGraph] = {}  # id(layer) -> the graph it first ran
        self._this_step: dict[LayerGraph, LayerGraph] = {}  # kind -> graph checked this step
        self._static_caches: KVCaches | None = None  # the caches `mark_cache_sizes_static` saw

    def _compile_graph(
        self, graph: torch.fx.GraphModule, example_inputs: list[Any]
    ) -> Callable[..., Any]:
        """The Dynamo backend: Inductor's, noting which graph each call runs."""
        from torch._inductor.compile_fx import compile_fx

        # No size asserts: the graph's Python wrapper checked every input's sizes and strides
        # on every call (30 a layer, 900 a step); the first layer of each step goes through
        # Dynamo's guards, and the others are called with the same step's tensors.
        # vec_isa_ok: trust the CPU's flags for its vector ISA; else Inductor confirms each one
        # by building and loading a test library, in a new Python process at every start.
        patches = {"size_asserts": False, "cpp.vec_isa_ok": True}
        compiled = compile_fx(graph, example_inputs, config_patches=patches)
        layer_graph = LayerGraph(compiled, graph)

        def run(*inputs: Any) -> Any:
            self._ran = layer_graph
            return layer_graph.compiled(*inputs)

        return run

    def applies(self, meta: AttentionMetadata) -> bool:
        """Whether a step runs compiled: up to `max_seqs` sequences decoding one token each,
        or with the paged kernel up to `max_seqs` tokens, at most `MAX_QUERY` a sequence, over
        cached context (a speculative step verifying its drafts: `decode_metadata`); never
        more than `max_tokens` tokens."""
        if meta.num_tokens > self.max_tokens:
            return False
        if meta.is_decode_only:
            return meta.num_seqs <= self.max_seqs
        return (
            self.paged
            and meta.max_query_len <= MAX_QUERY
            and meta.num_tokens <= self.max_seqs
            and all(s > q for s, q in zip(meta.seq_lens_cpu, meta.query_lens_cpu, strict=True))
        )

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata | DecodeMetadata,
    ) -> torch.Tensor:
        if isinstance(meta, AttentionMetadata):
            meta = decode_metadata(meta, paged=self.paged)
        if kv_caches is not self._static_caches:
            mark_cache_sizes_static(kv_caches)
            self._static_caches = kv_caches
        self._this_step.clear()
        return self.decoder(input_ids, positions, kv_caches, meta, run_layer=self.run_layer)

    def run_layer(
        self,
        layer: torch.nn.Module,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        *args: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # the first layer: a zero residual (x + 0 == x) shares its graph
            residual = torch.zeros_like(hidden)
        kind = self._kind.get(id(layer))
        checked = self._this_step.get(kind) if kind is not None else None
        if checked is not None:
            return checked(layer, hidden, residual, *args)
        self._ran = None
        # A layer's Python floats (norms' eps, attention's scale) traced as constants: under
        # dynamic=True they became symbols, and the scale, passed to the paged kernel's op,
        # specialised only once the graph reached the backend, which threw the trace away and
        # traced the layer again (half a warm start's compile).
        with torch._dynamo.config.patch(specialize_float=True):
            out = self._run_layer(layer, hidden, residual, *args)
        if self._ran is not None and self._ran.callable_directly:  # None: Dynamo ran it eagerly
            kind = self._kind.setdefault(id(layer), self._ran)
            self._this_step[kind] = self._ran
        return out

    @torch.inference_mode()  # as the steps run: a different grad mode is another graph
    def warm_up(self, kv_caches: KVCaches, block_size: int) -> None:
        """Compile the step's graphs on dummy steps over the first KV blocks (free at
        start-up: nothing has been scheduled yet): one sequence, and with the paged kernel
        also two, which must find the same graph. A pool too small for that compiles on the
        first real step."""
        num_blocks = kv_caches[0][0].shape[0]
        context = min(2 * block_size, num_blocks * block_size)
        if context < 2:  # a context of one would be traced as a constant
            return
        sizes = [1, 2] if self.max_seqs >= 2 and num_blocks >= 4 else [1]
        what = (
            f"compiling the decode step ({'/'.join(map(str, sizes))} sequences; Inductor "
            f"cache: {os.environ['TORCHINDUCTOR_CACHE_DIR']}; enforce_eager=True skips it)"
        )
        with phase(what):  # its seconds end the phase's second line
            for num_seqs in sizes:
                self(*self._dummy_step(kv_caches, block_size, context, num_seqs))

    def _dummy_step(
        self, kv_caches: KVCaches, block_size: int, context: int, num_seqs: int
    ) -> tuple:
        """`num_seqs` sequences decoding their token at position `context - 1`: with the paged
        kernel, sequence s over blocks 2s and 2s + 1; else one, over slots 0..context-1."""
        device = kv_caches[0][0].device
        if self.paged:
            tables = torch.arange(2 * num_seqs, device=device).view(num_seqs, 2)  # [S, 2]
            seq_lens = torch.full((num_seqs,), context, device=device)
            meta = DecodeMetadata(
                slot_mapping=tables[:, (context - 1) // block_size] * block_size
                + (context - 1) % block_size,
                kv_index=None,
                kv_valid=None,
                key_positions=None,
                query_positions=seq_lens - 1,
                block_tables=tables,
                seq_lens=seq_lens,
            )
            ids = torch.zeros(num_seqs, dtype=torch.int64, device=device)
            return ids, seq_lens - 1, kv_caches, meta
        key_positions = torch.arange(context, device=device)  # slot j holds position j
        last = torch.tensor([context - 1], device=device)
        meta = DecodeMetadata(
            slot_mapping=last,
            kv_index=key_positions[None, :].clone(),  # [1, context]
            kv_valid=torch.ones(1, context, dtype=torch.bool, device=device),
            key_positions=key_positions,
            query_positions=last,
        )
        return torch.zeros(1, dtype=torch.int64, device=device), last, kv_caches, meta
