"""Writing GGUF files from tiny HF models in tests, as llama.cpp's converter does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf


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
