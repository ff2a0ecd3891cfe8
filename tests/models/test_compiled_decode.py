"""The compiled decode step (minivllm/engine/compiled_decode.py).

Its attention (`decode_attention`) is checked against the eager paged SDPA in fp32, with a
sliding window and a soft-cap; the compiled step against the eager model in bf16, on tiny
Llama and Gemma 2 checkpoints (the latter with windows and soft-caps that bite), for one
sequence and, with the paged kernel, several; in fp32
with 4-bit weights through the qgemv operator (an AVX2 CPU's default path); and the runner's
choice of when to compile.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import pytest
import torch
from support.model_fixtures import allocate_kv_caches, make_attention_metadata

from minivllm.config import SPECULATION_OFF
from minivllm.engine import compiled_decode
from minivllm.engine.compiled_decode import (
    CompiledDecode,
    compiled_step_available,
    decode_metadata,
)
from minivllm.engine.weight_policy import quantize_linear_int4
from minivllm.layers.attention import Attention
from minivllm.layers.cpu_kernels import cpu_kernels_available
from minivllm.layers.quantization.methods import Int4Method
from minivllm.layers.quantization.rows import pick
from minivllm.models.loader import load_model
from tests.support.weight_methods import STORED_4BIT

BLOCK = 4
# A torch whose torch.compile lacks the step's options (a GPU image's 2.11) runs no such step.
needs_compile = pytest.mark.skipif(
    not compiled_step_available(), reason="this torch's torch.compile has no isolate_recompiles"
)


@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 2.0), (5, 2.0)])
def test_decode_attention_matches_the_eager_paged_attention(window, softcap) -> None:
    torch.manual_seed(0)
    heads, kv_heads, dim = 6, 2, 8
    attn = Attention(heads, kv_heads, dim, dim**-0.5, sliding_window=window, logit_softcap=softcap)
    tables, context = [[3, 1, 4], [0, 2], [5]], [9, 6, 2]  # three sequences, one new token each
    meta, _ = make_attention_metadata(tables, context, [1, 1, 1], BLOCK)
    caches = allocate_kv_caches(1, 6, BLOCK, kv_heads, dim)[0]
    for cache in caches:  # the context's keys and values; unused slots stay NaN
        for table, n in zip(tables, context, strict=True):
            for pos in range(n):
                cache[table[pos // BLOCK], pos % BLOCK] = torch.randn(kv_heads, dim)
    q = torch.randn(3, heads * dim)
    k, v = torch.randn(3, kv_heads * dim), torch.randn(3, kv_heads * dim)
    eager_caches = tuple(c.clone() for c in caches)
    want = attn(q, k, v, eager_caches, meta)
    got = attn(q, k, v, caches, decode_metadata(meta))  # the plain-maths path, not compiled
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[0], eager_caches[0], equal_nan=True)  # same K/V stored


def _bf16_model(family: str, tiny_llama_dir, tiny_family_dirs):
    """The tiny Llama or Gemma 2 in bf16 on the CPU: (model, config, head_dim)."""
    model_dir = tiny_llama_dir if family == "llama" else tiny_family_dirs["gemma2"]
    model, config = load_model(model_dir, torch.bfloat16, "cpu")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return model, config, head_dim


def _hidden_after_prefill(model, caches, prompt: list[int], compiled: CompiledDecode | None):
    """Prefill `prompt[:-1]` eagerly, then decode its last token eagerly or compiled."""
    n = len(prompt) - 1
    table = list(range((len(prompt) + BLOCK - 1) // BLOCK))
    meta, positions = make_attention_metadata([table], [0], [n], BLOCK)
    model(torch.tensor(prompt[:n]), positions, caches, meta)
    meta, positions = make_attention_metadata([table], [n], [1], BLOCK)
    step = compiled if compiled is not None else model
    return step(torch.tensor(prompt[n:]), positions, caches, meta)  # [1, hidden]


@needs_compile
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_the_compiled_step_matches_the_eager_one(family, tiny_llama_dir, tiny_family_dirs) -> None:
    model, config, head_dim = _bf16_model(family, tiny_llama_dir, tiny_family_dirs)

    def caches():
        return allocate_kv_caches(
            config.num_hidden_layers, 8, BLOCK, config.num_key_value_heads, head_dim
        )

    compiled = CompiledDecode(model)
    with torch.inference_mode():
        for length in (3, 14):  # two context lengths through one graph; 14 outgrows the window
            prompt = [(7 * i + 3) % config.vocab_size for i in range(length)]
            want = _hidden_after_prefill(model, caches(), prompt, None).float()
            got = _hidden_after_prefill(model, caches(), prompt, compiled).float()
            # bf16 activations: fused kernels round in other places than the eager ops
            assert (got - want).norm() / want.norm() < 2e-2, length


def _hidden_after_prefills(model, caches, prompts: list[list[int]], compiled, tails=None):
    """Prefill each prompt but its last `tails[s]` tokens (default 1) eagerly (sequence s in
    blocks 4s..4s+3), then run those tokens in one step, eagerly or compiled."""
    tails = tails or [1] * len(prompts)
    tables = [list(range(4 * s, 4 * s + 4)) for s in range(len(prompts))]
    for table, prompt, tail in zip(tables, prompts, tails, strict=True):
        meta, positions = make_attention_metadata([table], [0], [len(prompt) - tail], BLOCK)
        model(torch.tensor(prompt[:-tail]), positions, caches, meta)
    meta, positions = make_attention_metadata(
        tables, [len(p) - t for p, t in zip(prompts, tails, strict=True)], tails, BLOCK
    )
    step = compiled if compiled is not None else model
    ids = torch.tensor([t for p, n in zip(prompts, tails, strict=True) for t in p[-n:]])
    return step(ids, positions, caches, meta)  # [num_tokens, hidden]


@needs_compile
@pytest.mark.skipif(not cpu_kernels_available(), reason="the paged kernel is for x86 CPUs")
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_a_verifying_step_runs_compiled_as_one_row_a_token(
    family, tiny_llama_dir, tiny_family_dirs
) -> None:
    """A speculative step brings 1 + k tokens a sequence over its cached context: with the
    paged kernel it runs compiled, each token a row reading its sequence's blocks up to its own
    position (causal, and Gemma 2's windows per token), with the eager step's hidden states.
    A prefill (no cached context) or a run longer than MAX_QUERY stays eager."""
    model, config, head_dim = _bf16_model(family, tiny_llama_dir, tiny_family_dirs)
    compiled = CompiledDecode(model, paged=True, stored_blocks=True)
    for context, new, runs_compiled in (
        ([3, 6], [5, 3], True),
        ([0], [4], False),
        ([2], [9], False),
    ):
        meta, _ = make_attention_metadata([[0, 1, 2, 3]] * len(new), context, new, BLOCK)
        assert compiled.applies(meta) == runs_compiled
    prompts = [[(7 * i + 3 * s) % config.vocab_size for i in range(8 + 5 * s)] for s in range(2)]
    with torch.inference_mode():
        want, got = (
            _hidden_after_prefills(
                model,
                allocate_kv_caches(
                    config.num_hidden_layers, 8, BLOCK, config.num_key_value_heads, head_dim
                ),
                prompts,
                step,
                tails=[5, 3],
            ).float()
            for step in (None, compiled)
        )
    assert got.shape == want.shape == (8, config.hidden_size)
    assert (got - want).norm() / want.norm() < 2e-2


@needs_compile
@pytest.mark.skipif(not cpu_kernels_available(), reason="the paged kernel is for x86 CPUs")
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_the_compiled_step_of_several_sequences_matches_the_eager_one(
    family, tiny_llama_dir, tiny_family_dirs
) -> None:
    """With the paged kernel, steps of a few sequences run compiled too (their attention
    through the block tables): 2 and 4 sequences of different context lengths (Gemma 2's
    windows bite on the longest) match the eager step, and so does one sequence on its own
    graph afterwards; 5 sequences (past the int4 rows) stay eager, unless the layers run on
    GGUF blocks (the same operator at every step size)."""
    model, config, head_dim = _bf16_model(family, tiny_llama_dir, tiny_family_dirs)
    assert quantize_linear_int4(model, STORED_4BIT) > 0
    compiled = CompiledDecode(model, paged=True)
    with torch.inference_mode():
        for num_seqs, runs_compiled in ((4, True), (5, False)):
            meta, _ = make_attention_metadata(
                [[s] for s in range(num_seqs)], [1] * num_seqs, [1] * num_seqs, BLOCK
            )
            assert compiled.applies(meta) == runs_compiled
            assert CompiledDecode(model, paged=True, stored_blocks=True).applies(meta)
        for num_seqs in (2, 4, 1):
            prompts = [
                [(7 * i + 3 * s) % config.vocab_size for i in range(3 + 2 * s)]
                for s in range(num_seqs)
            ]
            want, got = (
                _hidden_after_prefills(
                    model,
                    allocate_kv_caches(
                        config.num_hidden_layers,
                        4 * num_seqs,
                        BLOCK,
                        config.num_key_value_heads,
                        head_dim,
                    ),
                    prompts,
                    step,
                ).float()
                for step in (None, compiled)
            )
            assert (got - want).norm() / want.norm() < 2e-2, num_seqs


@needs_compile
@pytest.mark.skipif(not cpu_kernels_available(), reason="the qgemv kernel is for x86 CPUs (AVX2)")
def test_the_compiled_fp32_step_with_qgemv_weights_matches_the_eager_one(tiny_llama_dir):
    """fp32 activations, every linear layer's 4-bit weights through `minivllm::qgemv` inside
    the Inductor graph: the same hidden states as the eager step, to float rounding."""
    model, config = load_model(tiny_llama_dir, torch.float32, "cpu")
    assert quantize_linear_int4(model, STORED_4BIT) > 0
    assert "QGemvWeight" in model.model.layers[0].mlp.down_proj.method.name

    def caches():
        return allocate_kv_caches(
            config.num_hidden_layers, 8, BLOCK, config.num_key_value_heads, config.head_dim
        )

    compiled = CompiledDecode(model)
    with torch.inference_mode():
        for length in (3, 14):
            prompt = [(5 * i + 1) % config.vocab_size for i in range(length)]
            want = _hidden_after_prefill(model, caches(), prompt, None)
            got = _hidden_after_prefill(model, caches(), prompt, compiled)
            # Fused kernels round ~1e-7 apart from the eager ops; where that moves an
            # activation across a 16-bit rounding step the kernel's input changes by that
            # step: 1.1-1.8e-4 here (dense fp32 weights: 2-4e-7). A wrong graph is O(1) off.
            assert (got - want).norm() / want.norm() < 1e-3, length


@pytest.mark.parametrize(
    "options, compiled",
    [
        ({"dtype": "bfloat16"}, True),
        ({"dtype": "bfloat16", "enforce_eager": True}, False),
        ({"dtype": "float32"}, False),  # the token-exact path stays eager
        ({"dtype": "float32", "quantization": "int4"}, cpu_kernels_available()),  # fp32 + qgemv
    ],
)
def test_the_runner_compiles_bf16_and_qgemv_decode_steps_only(options, compiled, tiny_llama_dir):
    from minivllm import LLM, SamplingParams

    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64, **options)
    runner = llm.llm_engine.model_runner
    assert (runner.compiled_decode is not None) == (compiled and compiled_step_available())
    out = llm.generate(
        [[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 6


@needs_compile
def test_compiled_steps_write_the_pool_in_place_not_a_copy_of_it(tiny_llama_dir):
    """The pool's pages become resident only where a step writes (kv_quant._zeros), so a
    compiled step that copied the whole pool instead of writing its new slots in place (it
    did, while the pool was a view at an offset into its storage) leaves every page of it
    resident after the start-up's warm-up steps; in place, the few blocks they used."""
    from minivllm import LLM, SamplingParams

    if platform.system() != "Linux":
        pytest.skip("asks Linux's mincore which pages are resident")
    llm = LLM(
        str(tiny_llama_dir),
        device="cpu",
        dtype="bfloat16",
        num_kv_blocks=1 << 14,
        max_model_len=64,
        speculative_config=SPECULATION_OFF,
    )
    runner = llm.llm_engine.model_runner
    assert runner.compiled_decode is not None
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([[5, 6, 7, 8]] * 2, params, use_tqdm=False)
    for layer in runner.kv_caches:
        for pool in layer:
            assert _resident_share(pool) < 0.05


def _resident_share(t: torch.Tensor) -> float:
    """The share of `t`'s memory pages that are resident (Linux's mincore)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    begin = t.data_ptr() // page * page
    length = t.data_ptr() + t.nbytes - begin
    vec = (ctypes.c_ubyte * ((length + page - 1) // page))()
    assert libc.mincore(ctypes.c_void_p(begin), ctypes.c_size_t(length), vec) == 0
    return sum(v & 1 for v in vec) / len(vec)


def test_one_sequence_steps_run_on_the_servers_thread_share(tiny_llama_dir):
    """`small_step_threads` (set by the in-process runtime on the CPU): one-token steps run on
    that many torch threads, larger steps on torch's own count, which every step restores."""
    from minivllm import LLM, SamplingParams
    from minivllm.engine.runtime.cpu_share import share_the_cpu_with_http

    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64, dtype="float32")
    runner = llm.llm_engine.model_runner
    interval = sys.getswitchinterval()
    share_the_cpu_with_http(llm.llm_engine)
    assert sys.getswitchinterval() == 0.0005
    sys.setswitchinterval(interval)
    assert runner.small_step_threads == max(1, torch.get_num_threads() - 1)
    runner.small_step_threads = 1
    seen: list[tuple[int, int]] = []  # (tokens in the step, torch threads during it)
    run = runner._run

    def spy(inputs, *rest):
        seen.append((inputs.meta.num_tokens, torch.get_num_threads()))
        return run(inputs, *rest)

    runner._run = spy
    before = torch.get_num_threads()
    llm.generate(
        [[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    assert torch.get_num_threads() == before
    assert seen[0] == (4, before) and all(s == (1, 1) for s in seen[1:]), seen


def test_an_older_torch_steps_aside_with_one_log_line(monkeypatch, caplog) -> None:
    """A torch.compile without `isolate_recompiles` (torch 2.11) turns the compiled step off,
    said once in the log, instead of failing at start-up."""

    def old_compile(model=None, *, fullgraph=False, dynamic=None, backend="inductor", options=None):
        return model

    monkeypatch.setattr(torch, "compile", old_compile)
    compiled_step_available.cache_clear()
    try:
        with caplog.at_level("INFO", logger=compiled_decode.__name__):
            for _ in range(2):
                assert not compiled_decode.compile_decode_step(
                    False, torch.device("cpu"), torch.bfloat16, 1
                )
    finally:
        compiled_step_available.cache_clear()
    assert caplog.text.count("compiled decode step is off") == 1


def test_inductor_cache_is_per_cpu_kind_and_row_table_unless_the_user_chose_one(
    monkeypatch, tmp_path
):
    """Graphs traced under other kernels or other row-table thresholds are never read back:
    the cache is one folder per CPU capability and row table; a user's own folder wins."""
    from dataclasses import replace

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from minivllm.engine import compiled_decode
    from minivllm.engine.compiled_decode import inductor_cache_dir

    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    capability = torch.backends.cpu.get_cpu_capability()
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    ours = inductor_cache_dir()
    assert Path(ours).parent == tmp_path / "cache" / "inductor"
    assert Path(ours).name.startswith(f"{capability}-")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # torch's, not a choice
    assert inductor_cache_dir() == ours
    moved = replace(compiled_decode.kernel_rows(), ggml_q8x8=5)
    monkeypatch.setattr(compiled_decode, "kernel_rows", lambda: moved)
    assert inductor_cache_dir() != ours
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert inductor_cache_dir() == str(tmp_path / "mine")


@needs_compile
@pytest.mark.parametrize("family, kinds", [("llama", 1), ("gemma2", 2)])
def test_each_step_goes_through_dynamo_once_per_layer_kind(
    family, kinds, tiny_llama_dir, tiny_family_dirs
) -> None:
    """Dynamo's guard check runs on the first layer of each kind (Gemma 2 alternates sliding
    and full attention: two); the other layers call that graph directly, with the answer the
    all-Dynamo step gives."""
    model, config, head_dim = _bf16_model(family, tiny_llama_dir, tiny_family_dirs)
    compiled = CompiledDecode(model)
    prompt = [(5 * i + 1) % config.vocab_size for i in range(11)]

    def decode(direct: bool) -> tuple[torch.Tensor, int]:
        caches = allocate_kv_caches(
            config.num_hidden_layers, 8, BLOCK, config.num_key_value_heads, head_dim
        )
        if not direct:
            compiled._kind.clear()  # every layer is new again: each goes through Dynamo
        calls = []
        through_dynamo = compiled._run_layer
        compiled._run_layer = lambda *a: calls.append(1) or through_dynamo(*a)
        try:
            with torch.inference_mode():
                hidden = _hidden_after_prefill(model, caches, prompt, compiled)
        finally:
            compiled._run_layer = through_dynamo
        return hidden, len(calls)

    decode(direct=False)  # compiles, and learns each layer's kind
    want, all_calls = decode(direct=False)
    got, calls = decode(direct=True)
    assert all_calls == config.num_hidden_layers
    assert calls == kinds
    assert torch.equal(got, want)


def test_many_engines_in_one_process_each_keep_their_compiled_step(
    tiny_llama_dir, tiny_family_dirs
) -> None:
    """Every engine compiles its own graphs on the same function: past Dynamo's limit of 8
    recompiles shared by all of them, later engines ran the layers eagerly (caught by the
    full suite: the once-per-kind check saw every layer go through Dynamo)."""
    for _ in range(10):
        test_each_step_goes_through_dynamo_once_per_layer_kind(
            "llama", 1, tiny_llama_dir, tiny_family_dirs
        )


@needs_compile
@pytest.mark.skipif(not cpu_kernels_available(), reason="the paged kernel is for x86 CPUs")
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_warm_up_traces_one_graph_for_every_layer(
    family, tiny_llama_dir, tiny_family_dirs, monkeypatch
) -> None:
    """With the paged kernel the warm-up traces one graph: its two-sequence step finds the
    one-sequence step's (a view of the split-off q once made Inductor guard on one token, and
    every start traced each layer kind twice), and Gemma's sliding and full layers share it
    (the window reaches the kernel as data, `Attention.window`). Where the layers' row tables
    run another kernel at two rows than at one (an AVX-512 VNNI CPU: qgemv at one row, torch's
    int4 at more), that step is a graph of its own, and only then."""
    model, config, head_dim = _bf16_model(family, tiny_llama_dir, tiny_family_dirs)
    assert quantize_linear_int4(model, STORED_4BIT) > 0
    methods = [getattr(m, "method", None) for m in model.modules()]
    tables = [method.table for method in methods if isinstance(method, Int4Method)]
    kernels = {tuple(pick(table, torch.empty(rows, 1)) for table in tables) for rows in (1, 2)}
    backend_calls = []
    compile_graph = CompiledDecode._compile_graph
    monkeypatch.setattr(
        CompiledDecode,
        "_compile_graph",
        lambda self, *a: backend_calls.append(1) or compile_graph(self, *a),
    )
    compiled = CompiledDecode(model, paged=True)
    caches = allocate_kv_caches(
        config.num_hidden_layers, 8, BLOCK, config.num_key_value_heads, head_dim
    )
    compiled.warm_up(caches, BLOCK)
    assert len(backend_calls) == len(kernels)
