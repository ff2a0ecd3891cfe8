"""A GGUF's quantized linear weights kept as stored blocks (what a Q4_K_M file holds, and Q4_0 /
Q4_1 moved into tiles of 8 rows): no dense copy of them is made, and the model computes what
the dequantized weights compute, up to the 8-bit rounding of the activations, in
prefill-sized and decode-sized steps alike."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from support.gguf_files import gguf_writer
from support.hf_reference import hf_prompt_logprobs
from support.spec_checks import OFF

from minivllm import LLM, SamplingParams
from minivllm.layers.cpu_kernels import cpu_caps, cpu_kernels_available
from minivllm.layers.linear import LinearBase
from minivllm.layers.quantization.head import BlockHead
from minivllm.layers.quantization.lookup import BlockLookup
from minivllm.layers.quantization.methods import GgmlBlockMethod
from minivllm.layers.quantization.rows import KERNEL_ROWS
from minivllm.models.gguf import convert_gguf

pytestmark = pytest.mark.skipif(
    not cpu_kernels_available(), reason="the block kernels need an x86 CPU with AVX2"
)

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 2, 4, 2, 64
# One Q4_K_M-like mix: 4-bit K-quants, a 6-bit v and down, an 8-bit o; layer 0's up in Q4_1
# (beside a Q4_K gate: x8 tiles and K blocks in one fused call), and layer 1's up in F16 (its
# fused gate_up stays dense: one shard is not blocks).
TYPES = {
    "attn_q": QT.Q4_K,
    "attn_k": QT.Q4_K,
    "attn_v": QT.Q6_K,
    "attn_output": QT.Q8_0,
    "ffn_gate": QT.Q4_K,
    "ffn_up": QT.Q4_K,
    "ffn_down": QT.Q6_K,
}
BLOCK_LAYERS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.down_proj")


def _fp16(rng: np.random.Generator, n: int, scale: float) -> np.ndarray:
    return np.abs(rng.standard_normal(n) * scale).astype(np.float16).view(np.uint8).reshape(n, 2)


def _blocks(qtype: QT, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks `[rows, row_bytes]` with scales that keep weights near 0.1."""
    elems, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // elems
    blocks = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    if qtype == QT.Q4_K:
        blocks[:, 0:2], blocks[:, 2:4] = _fp16(rng, n, 2e-4), _fp16(rng, n, 2e-4)
    elif qtype == QT.Q6_K:
        blocks[:, 208:210] = _fp16(rng, n, 3e-5)
    elif qtype in (QT.Q8_0, QT.Q4_0, QT.Q4_1):
        blocks[:, 0:2] = _fp16(rng, n, 1e-3 if qtype == QT.Q8_0 else 1e-2)
    if qtype == QT.Q4_1:  # m = -7.5 d: codes 0..15 centred
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        blocks[:, 2:4] = (-7.5 * d).astype(np.float16).view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


# (layer, part): its type where it differs from TYPES
OVERRIDES = {(0, "ffn_up"): QT.Q4_1, (1, "ffn_up"): QT.F16}


def _write(path: Path, overrides: dict = OVERRIDES) -> None:
    from transformers import LlamaConfig
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # 264 tokens (a multiple of 8: the tied Q6_K table goes into tiles)
    pads = [f"<|pad{i}|>" for i in range(4)]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *bytes_to_unicode().values(), "he"]
    tokens += pads
    cfg = LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=256,
    )
    rng = np.random.default_rng(0)
    writer = gguf_writer(path, "llama", cfg)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(["h e"])
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3 - len(pads)) + [3] * len(pads))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    # the tied embedding in Q6_K, as llama-quantize writes a Q4_K_M's
    writer.add_tensor(
        "token_embd.weight", _blocks(QT.Q6_K, len(tokens), HIDDEN, rng), raw_dtype=QT.Q6_K
    )
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    shapes = {
        "attn_q": (HEADS * HEAD_DIM, HIDDEN),
        "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_output": (HIDDEN, HEADS * HEAD_DIM),
        "ffn_gate": (INTER, HIDDEN),
        "ffn_up": (INTER, HIDDEN),
        "ffn_down": (HIDDEN, INTER),
    }
    for layer in range(LAYERS):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
        for part, (rows, cols) in shapes.items():
            qtype = overrides.get((layer, part), TYPES[part])
            name = f"blk.{layer}.{part}.weight"
            if qtype == QT.F16:
                writer.add_tensor(
                    name, (rng.standard_normal((rows, cols)) * 0.05).astype(np.float16)
                )
            else:
                writer.add_tensor(name, _blocks(qtype, rows, cols, rng), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the GGUF, its float32 HF conversion for the reference)."""
    root = tmp_path_factory.mktemp("blocks")
    _write(root / "m.gguf")
    return root / "m.gguf", convert_gguf(root / "m.gguf", root / "hf")


@pytest.fixture(scope="module")
def llm(model_files: tuple[Path, Path]) -> LLM:
    # the default options on the CPU (the block kernels' device, also on a machine with a
    # GPU): fp32 eager on an AVX2-only CPU, bf16 with the compiled decode step on an AVX-512 one
    return LLM(model=str(model_files[0]), device="cpu", num_kv_blocks=64)


def test_block_typed_layers_hold_no_dense_weight(llm: LLM) -> None:
    """qkv, o and down (all shards block-typed) keep the file's blocks and an empty dense
    weight; layer 0's gate_up keeps its Q4_K gate and Q4_1 up in tiles of 8 rows; layer 1's,
    one shard F16, stays off the block path; the LM head tied to the Q6_K embedding moves it
    into tiles of 8 rows, and the embedding looks its rows up there (one table)."""
    runner = llm.llm_engine.model_runner
    layers = runner.model.model.layers
    for i, layer in enumerate(layers):
        for name in BLOCK_LAYERS:
            module = layer.get_submodule(name)
            assert isinstance(module, LinearBase)
            assert isinstance(module.method, GgmlBlockMethod), (i, name)
            assert module.weight.numel() == 0, (i, name)
    gate_up = layers[0].mlp.gate_up_proj.method
    assert isinstance(gate_up, GgmlBlockMethod)
    assert [(s.qtype, s.x8) for s in gate_up.weight.segments] == [(QT.Q4_K, True), (QT.Q4_1, True)]
    assert not isinstance(layers[1].mlp.gate_up_proj.method, GgmlBlockMethod)
    assert layers[1].mlp.gate_up_proj.weight.numel() == INTER * 2 * HIDDEN
    assert len(runner.block_weights) == LAYERS * 7 - 2 + 2  # + the embedding and tied head
    embedding, head = runner.model.model.embed_tokens, runner.model.lm_head
    assert isinstance(head.method, BlockHead) and head.weight.numel() == 0
    assert isinstance(embedding.lookup, BlockLookup) and embedding.weight.numel() == 0
    assert embedding.lookup.segment is head.method.segment  # one table for both
    assert embedding.lookup.segment.x8 and embedding.lookup.segment.qtype == QT.Q6_K


def _engine_logprobs(llm: LLM, prompt: list[int], new: int) -> tuple[list[int], list[float]]:
    """(prompt + generated tokens, the engine's log-prob of every token after the first)."""
    params = SamplingParams(
        temperature=0, max_tokens=new, ignore_eos=True, prompt_logprobs=0, logprobs=0
    )
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    scores = [
        entry[tok].logprob for entry, tok in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)
    ]
    scores += [
        entry[tok].logprob
        for entry, tok in zip(completion.logprobs, completion.token_ids, strict=True)
    ]
    return prompt + list(completion.token_ids), scores


def test_prefill_and_decode_match_the_dequantized_model(
    llm: LLM, model_files: tuple[Path, Path]
) -> None:
    """Prompt tokens (a 40-row prefill: tile-by-tile dequantization) and generated tokens
    (one-row steps: integer dot products) score as HF fp32 scores them on the dequantized
    weights, within the error of 8-bit activations."""
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, 256, size=40)]
    tokens, scores = _engine_logprobs(llm, prompt, new=8)
    ref = hf_prompt_logprobs(str(model_files[1]), tuple(tokens))  # [T - 1, V]
    expected = ref.gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    # bf16 logits near -50 are 0.25 apart: the bound scales with them
    bound = 0.1 + (
        0.01 * expected.abs() if llm.llm_engine.model_runner.dtype == torch.bfloat16 else 0
    )
    diff = (torch.tensor(scores) - expected).abs()
    assert (diff < bound).all(), diff
    # the generated tokens are the reference's argmax, but where two are within the error
    top2 = ref[len(prompt) - 1 :].topk(2, dim=-1).values
    for step, tok in enumerate(tokens[len(prompt) :]):
        margin = float(top2[step, 0] - top2[step, 1])
        assert tok == int(ref[len(prompt) - 1 + step].argmax()) or margin < 0.5


@pytest.mark.slow
def test_compiled_bf16_decode_runs_on_the_blocks(model_files: tuple[Path, Path]) -> None:
    """bf16 with the compiled decode step (an AVX-512 CPU's default) takes the block kernels
    inside the compiled graph and scores as the reference does, within bf16's error."""
    llm = LLM(model=str(model_files[0]), num_kv_blocks=64, dtype="bfloat16")
    runner = llm.llm_engine.model_runner
    assert runner.block_weights and runner.compiled_decode is not None
    prompt = [int(t) for t in np.random.default_rng(2).integers(3, 256, size=12)]
    tokens, scores = _engine_logprobs(llm, prompt, new=6)
    ref = hf_prompt_logprobs(str(model_files[1]), tuple(tokens))
    expected = ref.gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    assert ((torch.tensor(scores) - expected).abs() < 0.1 + 0.01 * expected.abs()).all()


def test_layers_of_different_kinds_share_the_compiled_steps_graph(tmp_path: Path) -> None:
    """A Q4_K_M file keeps some layers' v and down in Q6_K and the others' in Q4_K. The
    one-call kernel takes the kinds as a tensor, so both layers run one graph (one trace per
    step size at start-up, not one per mix of kinds), each on its own blocks: the scores are
    the dequantized model's, within bf16's error."""
    path = tmp_path / "mixed.gguf"
    _write(path, overrides={(1, "attn_v"): QT.Q4_K, (1, "ffn_down"): QT.Q4_K})
    llm = LLM(model=str(path), num_kv_blocks=64, dtype="bfloat16", speculative_config=OFF)
    compiled = llm.llm_engine.model_runner.compiled_decode
    assert compiled is not None
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 256, size=12)]
    tokens, scores = _engine_logprobs(llm, prompt, new=6)
    assert len(compiled._kind) == LAYERS and len(set(compiled._kind.values())) == 1
    ref = hf_prompt_logprobs(str(convert_gguf(path, tmp_path / "hf")), tuple(tokens))
    expected = ref.gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    assert ((torch.tensor(scores) - expected).abs() < 0.1 + 0.01 * expected.abs()).all()


def _assert_scores_match_the_dequantized_model(path: Path, tmp_path: Path, prompts, outs) -> None:
    """Each completion's token logprobs against HF on the file's dequantization (bf16's
    error: 0.1 + 1% of the score)."""
    hf = convert_gguf(path, tmp_path / "hf")
    for prompt, out in zip(prompts, outs, strict=True):
        completion = out.outputs[0]
        tokens = prompt + list(completion.token_ids)
        ref = hf_prompt_logprobs(str(hf), tuple(tokens))[len(prompt) - 1 :]
        expected = ref.gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]
        scores = torch.tensor(
            [e[t].logprob for e, t in zip(completion.logprobs, completion.token_ids, strict=True)]
        )
        assert ((scores - expected).abs() < 0.1 + 0.01 * expected.abs()).all()


def test_steps_past_a_kernel_switch_run_eagerly_on_each_layers_kinds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above the row table's two-code threshold a step dequantizes its stored blocks, one call
    for a fused layer's segments of different kinds. A compiled graph traced below the
    threshold would recompile (seconds, inside a request) at the first step past it, so such
    steps run eagerly: four sequences decode together (steps of 4 rows, over a threshold of
    2) without a new graph, and score as the dequantized model does."""
    rows_kind = cpu_caps().rows_kind
    monkeypatch.setitem(
        KERNEL_ROWS, rows_kind, dataclasses.replace(KERNEL_ROWS[rows_kind], ggml_two_codes=2)
    )
    path = tmp_path / "mixed.gguf"
    _write(path, overrides={(1, "attn_v"): QT.Q4_K, (1, "ffn_down"): QT.Q4_K})
    llm = LLM(model=str(path), num_kv_blocks=64, dtype="bfloat16", speculative_config=OFF)
    compiled = llm.llm_engine.model_runner.compiled_decode
    assert compiled is not None and compiled.max_tokens == 2
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(3, 256, size=10)] for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "length" and len(completion.token_ids) == 5
    _assert_scores_match_the_dequantized_model(path, tmp_path, prompts, outs)


def test_dense_options_keep_dense_weights(model_files: tuple[Path, Path]) -> None:
    """quantization="none" and an explicit float32 are the dense paths: no blocks kept."""
    for options in ({"quantization": "none"}, {"dtype": "float32"}):
        llm = LLM(model=str(model_files[0]), num_kv_blocks=16, enforce_eager=True, **options)
        assert llm.llm_engine.model_runner.block_weights == set()
        qkv = llm.llm_engine.model_runner.model.model.layers[0].self_attn.qkv_proj
        assert not isinstance(qkv.method, GgmlBlockMethod) and qkv.weight.numel() > 0
        del llm


def test_the_kernel_switch_is_the_fewest_rows_of_a_weight_that_switches() -> None:
    """`kernel_switch_rows` reads each stored-block weight's row table: a Q5_1 weight switches
    to dequantization above `ggml_int_dot` rows; a weight that dequantizes at every count
    ("float" activations) switches nowhere and does not cap the compiled steps."""
    from gguf.quants import quantize

    from minivllm.engine.compiled_decode import kernel_switch_rows
    from minivllm.layers.quantization.kernels.block_weight import BlockSegment, BlockWeight
    from minivllm.layers.quantization.rows import kernel_rows

    raw = quantize(np.random.default_rng(0).standard_normal((64, 256), dtype=np.float32), QT.Q5_1)
    segment = BlockSegment(torch.from_numpy(raw), QT.Q5_1)

    class Layer(torch.nn.Module):
        def __init__(self, activations: str) -> None:
            super().__init__()
            self.method = GgmlBlockMethod(BlockWeight([segment], 256, activations))

    assert kernel_switch_rows(torch.nn.ModuleList([Layer("float")])) == float("inf")
    both = torch.nn.ModuleList([Layer("float"), Layer("int8")])
    assert kernel_switch_rows(both) == kernel_rows().ggml_int_dot


def test_the_compiled_step_is_one_graph_traced_once_for_any_number_of_sequences(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Start-up traces the decode step once, for steps of one sequence and of several, and
    Inductor is called once: a step of one sequence used to specialise on that size (a second
    graph), and the attention's float scale made Dynamo throw its first trace away and trace
    again (a second call). Steps of 3, 2 and 1 sequences and a speculative step then run that
    graph, with the dequantized model's scores."""
    from minivllm.engine.compiled_decode import CompiledDecode

    calls: list[int] = []  # the graphs Dynamo handed to the backend (Inductor)
    backend = CompiledDecode._compile_graph
    monkeypatch.setattr(CompiledDecode, "_compile_graph", lambda *a: calls.append(1) or backend(*a))
    path = tmp_path / "model.gguf"
    _write(path, overrides={(1, "attn_v"): QT.Q4_K, (1, "ffn_down"): QT.Q4_K})  # one layer kind
    llm = LLM(model=str(path), num_kv_blocks=64, dtype="bfloat16", speculative_config=OFF)
    assert llm.llm_engine.model_runner.compiled_decode is not None
    assert len(calls) == 1
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 256, size=9 + s)] for s in range(3)]
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0) for n in (3, 5, 7)
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert len(calls) == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    _assert_scores_match_the_dequantized_model(path, tmp_path, prompts, outs)
