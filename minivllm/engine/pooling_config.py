"""The engine's pooling method for embedding requests: the `pooling` option, else what the
model's sentence-transformers config says (`modules.json` naming a Pooling module whose
`config.json` sets a `pooling_mode_*`), else last-token pooling, as vLLM does for decoder
models (whose last token is the only one that has seen the whole prompt).

Pure Python: no torch here.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

from minivllm.config import EngineConfig

logger = logging.getLogger(__name__)

# sentence-transformers' Pooling config flags, by the method each one means here
_ST_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_ST_POOLING = "sentence_transformers.models.Pooling"


def model_pooling(model_dir: str | Path) -> str | None:
    """The pooling method the model's sentence-transformers config names, or None (no such
    config). ValueError for a mode this engine does not pool by (max, weighted mean)."""
    modules_file = Path(model_dir) / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    pooling = [m for m in modules if isinstance(m, dict) and m.get("type") == _ST_POOLING]
    if not pooling:
        return None
    config_file = Path(model_dir) / str(pooling[0].get("path", "")) / "config.json"
    if not config_file.is_file():
        return None
    settings = json.loads(config_file.read_text())
    chosen = [method for flag, method in _ST_MODES.items() if settings.get(flag)]
    if not chosen:
        modes = sorted(k for k, v in settings.items() if k.startswith("pooling_mode") and v)
        raise ValueError(
            f"the model's pooling ({', '.join(modes) or 'none'}) is not one this engine "
            "implements: pass pooling='last', 'mean' or 'cls'"
        )
    return chosen[0]


def with_pooling(config: EngineConfig, model_dir: str | Path) -> EngineConfig:
    """The config with `pooling` resolved: the option, else the model's, else "last"."""
    if config.pooling is not None:
        return config
    method = model_pooling(model_dir)
    if method is not None:
        logger.info("pooling for embeddings: %s (the model's sentence-transformers config)", method)
    return replace(config, pooling=method or "last")
