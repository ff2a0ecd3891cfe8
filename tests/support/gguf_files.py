"""Writing GGUF files from tiny HF models in tests, as llama.cpp's converter does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np


def gguf_writer(path: Path, arch: str, cfg: Any) -> gguf.GGUFWriter:
    """A writer for architecture `arch` holding the shape keys every architecture has (layers,
    context, widths, heads), read from the HF config `cfg`; the caller adds the rest."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    return writer


def tiny_vocab() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary: 3 specials, the 256 byte symbols, and a few merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_tokens = list(bytes_to_unicode().values())
    merges = ["h e", "l l", "he ll", "Ġ w", "o r", "Ġw or"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *byte_tokens]
    tokens += [m.replace(" ", "") for m in merges]
    return tokens, merges


def write_tiny_llama_gguf(
    path: Path, arch: str = "llama", ffn_type: gguf.GGMLQuantizationType | None = None
) -> Path:
    """A loadable llama GGUF of random weights (2 layers, hidden 64, tied embedding) with a
    tokenizer, written as llama.cpp's converter lays it out; `ffn_type` stores the MLP's down
    projections (rows of 256) in that quantized type (random blocks, see `random_blocks`)."""
    tokens, merges = tiny_vocab()
    hidden, ffn, heads, kv_heads, head_dim, layers = 64, 256, 4, 2, 16, 2
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    rng = np.random.default_rng(0)

    def dense(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    writer.add_tensor("token_embd.weight", dense(len(tokens), hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", dense(heads * head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_k.weight", dense(kv_heads * head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_v.weight", dense(kv_heads * head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_output.weight", dense(hidden, heads * head_dim))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", dense(ffn, hidden))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", dense(ffn, hidden))
        if ffn_type is None:
            writer.add_tensor(f"blk.{i}.ffn_down.weight", dense(hidden, ffn))
        else:
            writer.add_tensor(
                f"blk.{i}.ffn_down.weight",
                random_blocks(ffn_type, (hidden, ffn), rng),
                raw_dtype=ffn_type,
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_blocks(
    qtype: gguf.GGMLQuantizationType, shape: tuple[int, int], rng: np.random.Generator
) -> np.ndarray:
    """Random `[rows, bytes per row]` blocks of `qtype`, each block's first two bytes an fp16
    0.01: the scale in the Q8_0, Q4_0 and IQ4_NL layouts, so their values stay small."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    data = rng.integers(0, 256, (rows, cols // block, block_bytes), dtype=np.uint8)
    data[..., :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return data.reshape(rows, cols // block * block_bytes)
