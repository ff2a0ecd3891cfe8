"""Tiny random HF checkpoints (plus tokenizer) for model tests, and paged-cache test helpers.

A pytest plugin module: list it in `pytest_plugins` to get the session fixtures
`tiny_llama_dir` (tied embeddings), `tiny_llama_long_dir` (the same, with an 8192-token
context), `tiny_llama3_rope_dir` (llama3 rope scaling, untied) and
`tiny_qwen3_dir` (untied, q/k norms) and `tiny_family_dirs` (Qwen2, Mistral, Gemma 2,
Gemma 3, Phi-3, with sliding windows and soft-caps that bite). Each is an HF-style directory
with config.json, model.safetensors (fp32) and a small byte-level BPE tokenizer with a chat
template. Nothing is downloaded; everything is built from a fixed seed in well under a second
per model.
"""

import json
import math
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, PreTrainedTokenizerFast, Qwen3Config
from transformers import LlamaForCausalLM as HFLlamaForCausalLM
from transformers import Qwen3ForCausalLM as HFQwen3ForCausalLM

from minivllm.layers.attention import AttentionMetadata

TINY_VOCAB_SIZE = 384  # model vocab; the tokenizer uses at most TOKENIZER_VOCAB_SIZE of it
TOKENIZER_VOCAB_SIZE = 320
SPECIAL_TOKENS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "A scheduler mixes prefill chunks with decode steps in one batch.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Once upon a time there was a tiny language model that loved numbers: 0 1 2 3 4 5 6 7 8 9.",
]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a few sentences, with bos/eos and a chat template."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def tiny_config_kwargs(tokenizer: PreTrainedTokenizerFast) -> dict:
    """Shared shape of the tiny models: hidden 64, 4 heads, 2 KV heads (GQA), head_dim 16."""
    return dict(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        # Larger than HF's 0.02 so random logits have clear winners (stable greedy tests).
        initializer_range=0.15,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def save_tiny_checkpoint(
    out_dir: Path, model_cls: type, config: LlamaConfig | Qwen3Config, seed: int
) -> Path:
    """Initialise `model_cls(config)` from `seed`; save it (fp32 safetensors) and a tokenizer."""
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    # Random norm weights too, so a norm that ignores its weight cannot pass the tests.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Llama checkpoint with tied embeddings and default rope."""
    tokenizer = build_tokenizer()
    config = LlamaConfig(**tiny_config_kwargs(tokenizer), tie_word_embeddings=True)
    config.architectures = ["LlamaForCausalLM"]
    return save_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_llama"), HFLlamaForCausalLM, config, 0
    )


LONG_CONTEXT = 8192


@pytest.fixture(scope="session")
def tiny_llama_long_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with `max_position_embeddings` raised to LONG_CONTEXT (default rope, so the
    weights are the same): requests long enough that no machine finishes them before a test's
    disconnect or shutdown lands."""
    out = tmp_path_factory.mktemp("tiny_llama_long")
    for item in tiny_llama_dir.iterdir():
        shutil.copy(item, out / item.name)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = LONG_CONTEXT
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="session")
def tiny_llama3_rope_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Llama checkpoint, untied, with Llama-3.1-style rope scaling that bites at 32 tokens."""
    tokenizer = build_tokenizer()
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    config = LlamaConfig(
        **tiny_config_kwargs(tokenizer), tie_word_embeddings=False, rope_parameters=rope
    )
    config.architectures = ["LlamaForCausalLM"]
    out_dir = tmp_path_factory.mktemp("tiny_llama3_rope")
    return save_tiny_checkpoint(out_dir, HFLlamaForCausalLM, config, 1)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3 checkpoint with untied embeddings and per-head q/k norms."""
    tokenizer = build_tokenizer()
    config = Qwen3Config(**tiny_config_kwargs(tokenizer), tie_word_embeddings=False)
    config.architectures = ["Qwen3ForCausalLM"]
    return save_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_qwen3"), HFQwen3ForCausalLM, config, 2
    )


def make_attention_metadata(
    block_tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    block_size: int,
    device: torch.device | str = "cpu",
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for one step, and the `[num_tokens]` positions of its new tokens.

    Sequence `s` has `context_lens[s]` tokens already cached and brings `query_lens[s]` new ones;
    position `p` lives at slot `block_tables[s][p // block_size] * block_size + p % block_size`.
    """
    positions, slots = [], []
    for table, context_len, query_len in zip(block_tables, context_lens, query_lens, strict=True):
        for pos in range(context_len, context_len + query_len):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    max_blocks = max(len(table) for table in block_tables)
    padded = [table + [0] * (max_blocks - len(table)) for table in block_tables]
    query_start_loc = [0]
    for query_len in query_lens:
        query_start_loc.append(query_start_loc[-1] + query_len)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int64, device=device),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens,
        block_size=block_size,
    )
    return meta, torch.tensor(positions, dtype=torch.int64, device=device)


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One `(k_cache, v_cache)` pair per layer, each `[num_blocks, block_size, KVH, D]`.

    Filled with NaN so that reading a slot nobody wrote shows up in the output.
    """
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype))
        for _ in range(num_layers)
    ]


# ------------------------------------------------------------------ more families
# Each tiny checkpoint exercises its family's features at sizes where they bite: a sliding
# window of 8 tokens (the test prompts run to 50), soft-caps small enough to change the
# scores, Gemma's query_pre_attn_scalar different from head_dim.

TINY_WINDOW = 8


def family_configs(tokenizer: PreTrainedTokenizerFast) -> dict[str, tuple[Any, type, int]]:
    """name -> (HF config, HF model class, seed) of the tiny checkpoint of each family."""
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        MistralConfig,
        MistralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    base = tiny_config_kwargs(tokenizer)
    gemma = dict(
        base,
        query_pre_attn_scalar=24,
        sliding_window=TINY_WINDOW,
        tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh",
    )
    return {
        "qwen2": (
            Qwen2Config(
                **base,
                use_sliding_window=True,
                sliding_window=TINY_WINDOW,
                max_window_layers=1,
                tie_word_embeddings=True,
            ),
            Qwen2ForCausalLM,
            10,
        ),
        "mistral": (
            MistralConfig(
                **base,
                sliding_window=TINY_WINDOW,
                tie_word_embeddings=False,
            ),
            MistralForCausalLM,
            11,
        ),
        "gemma2": (
            Gemma2Config(
                **gemma,
                attn_logit_softcapping=2.0,
                final_logit_softcapping=6.0,
            ),
            Gemma2ForCausalLM,
            12,
        ),
        "gemma3": (
            Gemma3TextConfig(
                **gemma,
                layer_types=["sliding_attention", "full_attention"],
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {
                        "rope_type": "linear",
                        "rope_theta": 1000000.0,
                        "factor": 8.0,
                    },
                },
            ),
            Gemma3ForCausalLM,
            13,
        ),
        "phi3": (
            Phi3Config(
                **base,
                sliding_window=TINY_WINDOW,
                tie_word_embeddings=False,
            ),
            Phi3ForCausalLM,
            14,
        ),
    }


FAMILIES = ["qwen2", "mistral", "gemma2", "gemma3", "phi3"]


@pytest.fixture(scope="session")
def tiny_family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> directory of a tiny checkpoint of each family of FAMILIES, built on first use."""
    tokenizer = build_tokenizer()
    dirs = {}
    for name, (config, model_cls, seed) in family_configs(tokenizer).items():
        config.architectures = [model_cls.__name__]
        out = tmp_path_factory.mktemp(f"tiny_{name}")
        dirs[name] = save_tiny_checkpoint(out, model_cls, config, seed)
    return dirs


def shuffled_nan_cache(
    seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, rng: random.Random
) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """Block tables for sequences of `seq_lens` tokens, their blocks drawn from a pool shuffled
    by `rng` (two blocks to spare), and that pool's K and V
    `[num_blocks, block_size, num_kv_heads, head_dim]` full of NaN, so a stray read shows."""
    needed = [math.ceil(n / block_size) for n in seq_lens]
    free = list(range(sum(needed) + 2))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in needed]
    shape = (sum(needed) + 2, block_size, num_kv_heads, head_dim)
    return tables, torch.full(shape, float("nan")), torch.full(shape, float("nan"))
