"""The model's sampling defaults: vLLM's `--generation-config` (`ModelConfig.
get_diff_sampling_param`).

A model's `generation_config.json` may recommend sampling values (Qwen2.5: temperature 0.7,
top_p 0.8, top_k 20, repetition_penalty 1.05). As vLLM does by default ("auto"), those become
the defaults of requests that leave the field unset: the server's requests and
`LLM.get_default_sampling_params()`; a value the request sets wins. "vllm" keeps vLLM's own
neutral defaults; a folder path reads that folder's `generation_config.json` instead.

Only the sampling fields count (HF's `max_new_tokens` becomes `max_tokens`); bos/eos ids are
not sampling defaults. A GGUF carries no sampling fields: its conversion writes only the token
ids, so the default model keeps vLLM's defaults. Pure Python: no torch here.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from minivllm.config import EngineConfig
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# HF's generation_config.json names that vLLM reads as sampling defaults, in vLLM's order.
SAMPLING_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
FILE_NAME = "generation_config.json"


def default_sampling_params(source: str, model_dir: str | Path) -> dict[str, Any]:
    """The sampling defaults `source` gives, by SamplingParams' names (empty: none).

    `source`: "auto" (the model directory's file, if it has one), "vllm" (none) or a folder
    holding a generation_config.json. ValueError for a folder without the file, a file that
    is not a JSON object, or values SamplingParams refuses."""
    if source == "vllm":
        return {}
    if source == "auto":
        path = Path(model_dir) / FILE_NAME
        if not path.is_file():
            return {}
    else:
        path = Path(source).expanduser() / FILE_NAME
        if not path.is_file():
            raise ValueError(
                f"generation_config {source!r} is not a folder holding a {FILE_NAME}; give "
                "'auto' (the model's own), 'vllm' (no model defaults) or such a folder"
            )
    defaults = _read_sampling_fields(path)
    if defaults:
        logger.warning(
            "sampling defaults from %s: %s; a request that sets a field keeps its own value "
            "(--generation-config vllm turns these off)",
            path,
            defaults,
        )
    return defaults


def _read_sampling_fields(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    defaults = {name: config[name] for name in SAMPLING_FIELDS if config.get(name) is not None}
    if "max_new_tokens" in defaults:  # HF's max_new_tokens is vLLM's max_tokens
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"{path} has a sampling value SamplingParams refuses: {exc}") from None
    return defaults


def with_eos_token_ids(config: EngineConfig, tokenizer: Any, model_dir: Any) -> EngineConfig:
    """The model's EOS ids: generation_config.json's, plus the tokenizer's own."""
    eos: set[int] = set(config.eos_token_ids)
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        value = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(value, int):
            eos.add(value)
        elif isinstance(value, list):
            eos.update(v for v in value if isinstance(v, int))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return replace(config, eos_token_ids=tuple(sorted(eos)))
