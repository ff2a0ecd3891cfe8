"""Every model family over a paged KV cache against HF transformers on tiny random checkpoints.

Guards: wrong checkpoint-name mapping or fused-shard order, tied/untied heads, q/k norms,
rope scaling, and the cache carried across steps (chunked prefill, decode, mixed batches);
for the newer families q/k/v biases (Qwen2), sliding windows (Mistral, Qwen2, Phi-3, Gemma),
Gemma's norms, scaled embeddings, soft-caps and local/global rotary, Phi-3's fused checkpoint.
"""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.model_fixtures import FAMILIES, allocate_kv_caches, make_attention_metadata
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from minivllm.models.llama import head_dim_of
from minivllm.models.loader import load_model
from minivllm.models.registry import get_model_class

BLOCK_SIZE = 4
NUM_BLOCKS = 64
PROMPT = "The quick brown fox jumps over the lazy dog. Paged attention stores keys"
OTHER_PROMPT = "Hello, world! How are"
ATOL = 1e-4

CHECKPOINTS = ["tiny_llama_dir", "tiny_llama3_rope_dir", "tiny_qwen3_dir", *FAMILIES]


class PagedModel:
    """Our model plus a KV cache and per-sequence block tables: a minimal stand-in runner."""

    def __init__(self, model_dir: Path) -> None:
        self.model, self.config = load_model(model_dir, torch.float32, "cpu")
        self.caches = allocate_kv_caches(
            self.config.num_hidden_layers,
            NUM_BLOCKS,
            BLOCK_SIZE,
            self.config.num_key_value_heads,
            head_dim_of(self.config),
        )
        # Blocks handed out in a scrambled order, so contiguity is never assumed.
        self.free_blocks = [(7 * i + 3) % NUM_BLOCKS for i in range(NUM_BLOCKS)]
        self.tables: dict[int, list[int]] = {}
        self.cached: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run one step where sequence `s` brings tokens `chunks[s]`; return each sequence's
        logits `[len(chunk), vocab]`."""
        ids = list(chunks)
        for seq_id in ids:
            table = self.tables.setdefault(seq_id, [])
            total = self.cached.get(seq_id, 0) + len(chunks[seq_id])
            while len(table) * BLOCK_SIZE < total:
                table.append(self.free_blocks.pop(0))
        meta, positions = make_attention_metadata(
            [self.tables[s] for s in ids],
            [self.cached.get(s, 0) for s in ids],
            [len(chunks[s]) for s in ids],
            BLOCK_SIZE,
        )
        input_ids = torch.tensor([t for s in ids for t in chunks[s]], dtype=torch.int64)
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, self.caches, meta)
            logits = self.model.compute_logits(hidden)
        out, start = {}, 0
        for seq_id in ids:
            n = len(chunks[seq_id])
            out[seq_id] = logits[start : start + n]
            start += n
            self.cached[seq_id] = self.cached.get(seq_id, 0) + n
        return out


@pytest.fixture(params=CHECKPOINTS)
def model_dir(request: pytest.FixtureRequest) -> Path:
    if request.param in FAMILIES:
        return request.getfixturevalue("tiny_family_dirs")[request.param]
    return request.getfixturevalue(request.param)


@pytest.fixture
def hf_model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def encode(model_dir: Path, text: str) -> list[int]:
    return AutoTokenizer.from_pretrained(model_dir)(text).input_ids


def hf_logits(hf_model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()  # [len(ids), vocab]


def hf_greedy(hf_model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
        )
    return out[0, len(ids) :].tolist()


def test_whole_prompt_in_one_step(model_dir: Path, hf_model: torch.nn.Module) -> None:
    """One prefill step gives HF's logits at every position."""
    ids = encode(model_dir, PROMPT)
    assert len(ids) > 3 * BLOCK_SIZE
    logits = PagedModel(model_dir).step({0: ids})[0]
    torch.testing.assert_close(logits, hf_logits(hf_model, ids), rtol=0, atol=ATOL)


def test_chunked_prefill_carries_the_cache(model_dir: Path, hf_model: torch.nn.Module) -> None:
    """The prompt split into chunks over several steps (chunk edges inside and on block edges)
    gives the same logits as HF on the whole prompt."""
    ids = encode(model_dir, PROMPT)
    expected = hf_logits(hf_model, ids)
    paged = PagedModel(model_dir)
    start = 0
    for size in [5, 3, 1, 7, len(ids)]:
        chunk = ids[start : start + size]
        if not chunk:
            break
        logits = paged.step({0: chunk})[0]
        torch.testing.assert_close(logits, expected[start : start + len(chunk)], rtol=0, atol=ATOL)
        start += len(chunk)
    assert start == len(ids)


def test_greedy_decoding_matches_hf_generate(model_dir: Path, hf_model: torch.nn.Module) -> None:
    """Prefill then 10 single-token decode steps pick HF generate's tokens, one by one."""
    ids = encode(model_dir, PROMPT)
    expected = hf_greedy(hf_model, ids, 10)
    paged = PagedModel(model_dir)
    token = int(paged.step({0: ids})[0][-1].argmax())
    generated = [token]
    for _ in range(9):
        token = int(paged.step({0: [token]})[0][-1].argmax())
        generated.append(token)
    assert generated == expected


def test_mixed_batch_of_prefill_and_decodes(model_dir: Path, hf_model: torch.nn.Module) -> None:
    """Two sequences sharing steps (a decode next to another's prefill chunks, then batched
    decodes) each decode as HF generate does alone."""
    prompts = {0: encode(model_dir, PROMPT), 1: encode(model_dir, OTHER_PROMPT)}
    expected = {s: hf_greedy(hf_model, ids, 8) for s, ids in prompts.items()}
    paged = PagedModel(model_dir)
    generated: dict[int, list[int]] = {0: [], 1: []}
    half = len(prompts[1]) // 2
    steps: list[dict[int, list[int]]] = [
        {0: prompts[0]},
        {0: None, 1: prompts[1][:half]},
        {1: prompts[1][half:], 0: None},
    ]
    for plan in steps:
        chunks = {s: (c if c is not None else [generated[s][-1]]) for s, c in plan.items()}
        logits = paged.step(chunks)
        for s in chunks:
            if s == 0 or plan is steps[-1]:
                generated[s].append(int(logits[s][-1].argmax()))
    while len(generated[0]) < 8 or len(generated[1]) < 8:
        chunks = {s: [g[-1]] for s, g in generated.items() if len(g) < 8}
        logits = paged.step(chunks)
        for s in chunks:
            generated[s].append(int(logits[s][-1].argmax()))
    assert generated == expected


def test_tied_and_untied_heads(tiny_llama_dir: Path, tiny_qwen3_dir: Path) -> None:
    """tie_word_embeddings shares one tensor; untied checkpoints load their own lm_head."""
    llama, _ = load_model(tiny_llama_dir, torch.float32, "cpu")
    assert llama.lm_head.weight is llama.model.embed_tokens.weight
    qwen3, _ = load_model(tiny_qwen3_dir, torch.float32, "cpu")
    assert qwen3.lm_head.weight is not qwen3.model.embed_tokens.weight
    assert not torch.equal(qwen3.lm_head.weight, qwen3.model.embed_tokens.weight)
    assert not any(p.requires_grad for p in qwen3.parameters())
    assert not qwen3.training


def test_bfloat16_load_keeps_rotary_float32(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    """Loading in bf16 makes bf16 parameters, float32 rotary frequencies, float32 logits close
    to the fp32 model's."""
    model, config = load_model(tiny_qwen3_dir, torch.bfloat16, "cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    ids = encode(tiny_qwen3_dir, PROMPT)
    caches = allocate_kv_caches(
        config.num_hidden_layers,
        16,
        BLOCK_SIZE,
        config.num_key_value_heads,
        config.head_dim,
        dtype=torch.bfloat16,
    )
    table = list(range(math.ceil(len(ids) / BLOCK_SIZE)))
    meta, positions = make_attention_metadata([table], [0], [len(ids)], BLOCK_SIZE)
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(ids), positions, caches, meta))
    assert logits.dtype == torch.float32
    reference = PagedModel(tiny_qwen3_dir).step({0: ids})[0]
    assert (logits - reference).abs().max() < 0.2 * reference.abs().max()


def test_sharded_checkpoint_with_index(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    """Weights split over two files named by model.safetensors.index.json load the same."""
    for name in ["config.json", "tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(tiny_qwen3_dir / name, tmp_path / name)
    tensors = load_file(tiny_qwen3_dir / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate([names[::2], names[1::2]]):
        file_name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, tmp_path / file_name)
        weight_map.update({n: file_name for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded, _ = load_model(tmp_path, torch.float32, "cpu")
    whole, _ = load_model(tiny_qwen3_dir, torch.float32, "cpu")
    for (name, a), (_, b) in zip(
        sharded.state_dict().items(), whole.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_missing_weight_is_named(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    """A checkpoint without one projection fails, naming the checkpoint tensor."""
    shutil.copy(tiny_qwen3_dir / "config.json", tmp_path / "config.json")
    tensors = load_file(tiny_qwen3_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    del tensors["lm_head.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing 2") as error:
        load_model(tmp_path, torch.float32, "cpu")
    assert "model.layers.1.self_attn.k_proj.weight" in str(error.value)
    assert "lm_head.weight" in str(error.value)


def test_wrong_shape_is_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A tensor of the wrong shape fails with its checkpoint name and both shapes."""
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    tensors = load_file(tiny_llama_dir / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"up_proj\.weight.*shape mismatch"):
        load_model(tmp_path, torch.float32, "cpu")


def test_unsupported_architecture_names_it() -> None:
    """An unknown architecture is refused with its name and the supported list."""
    config = LlamaConfig()
    config.architectures = ["MambaForCausalLM"]
    with pytest.raises(ValueError, match="MambaForCausalLM") as error:
        get_model_class(config)
    assert "LlamaForCausalLM" in str(error.value)
    assert "Qwen3ForCausalLM" in str(error.value)
    config.architectures = None
    with pytest.raises(ValueError, match="supported"):
        get_model_class(config)
