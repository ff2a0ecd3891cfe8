"""From what the user asked for to a model: its directory and HF config (its tokenizer:
`minivllm.tokenizer`).

`resolve_config` finds the model (`paths.resolve_model_dir`), reads its HF config, refuses an
unsupported architecture before any weight is read, and fills the engine options that depend
on the model (`max_model_len`) in a new, still frozen, `EngineConfig`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from minivllm.config import EngineConfig
from minivllm.models.paths import resolve_model_dir
from minivllm.models.registry import get_model_class


def resolve_config(config: EngineConfig) -> tuple[EngineConfig, Path, Any]:
    """Find the model, read its HF config, and fill the model-dependent options.

    Returns `(config, model_dir, hf_config)`. Raises `ValueError` for an unsupported
    architecture or a `max_model_len` the model cannot take.
    """
    model_dir = resolve_model_dir(config.model)
    hf_config = AutoConfig.from_pretrained(model_dir)
    get_model_class(hf_config)  # an unsupported architecture fails here, before any loading
    model_max = int(getattr(hf_config, "max_position_embeddings", 0) or 0) or None
    max_model_len = config.max_model_len or model_max
    if max_model_len is None:
        raise ValueError("the model config gives no max_position_embeddings: set max_model_len")
    if model_max is not None and max_model_len > model_max:
        raise ValueError(
            f"max_model_len ({max_model_len}) exceeds the model's max_position_embeddings "
            f"({model_max})"
        )
    return replace(config, max_model_len=max_model_len), model_dir, hf_config
