"""From what the user asked for to a model: its directory, HF config and tokenizer.

`resolve_config` finds the model (`paths.resolve_model_dir`), reads its HF config, refuses an
unsupported architecture before any weight is read, and fills the engine options that depend
on the model (`max_model_len`) in a new, still frozen, `EngineConfig`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
from dataclasses import replace
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoConfig, AutoTokenizer

from minivllm.cache import cache_dir
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


def load_tokenizer(model_dir: Path) -> Any:
    """The model directory's tokenizer (never fetched from the hub: the directory is local).

    A directory minivllm wrote itself (a GGUF's conversion, under `<cache>/gguf`) keeps the
    loaded tokenizer pickled beside its files, for the next start: transformers 5 rebuilds a
    GemmaTokenizer's 262k-token vocabulary from its JSON in Python (2.8 s of a warm start, in
    each of the server's two processes), where unpickling it takes 1.2 s. The snapshot's name
    holds transformers' version and the tokenizer files' sizes and times: any change makes a
    new one. A user's own directory is only read."""
    snapshot = _tokenizer_snapshot(Path(model_dir))
    if snapshot is not None and snapshot.exists():
        try:
            return pickle.loads(snapshot.read_bytes())  # noqa: S301 - our own cache's file
        except Exception:  # a torn or foreign file: load from the sources, write it again
            pass
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if snapshot is not None:
        partial = snapshot.with_name(f"{snapshot.name}.{os.getpid()}.partial")
        try:
            partial.write_bytes(pickle.dumps(tokenizer))
            partial.replace(snapshot)  # both processes of a server may write it: last wins
        except Exception:  # unpicklable, or a read-only cache: the next start loads it again
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
    return tokenizer


def _tokenizer_snapshot(model_dir: Path) -> Path | None:
    """Where a tokenizer snapshot of `model_dir` lives: None unless minivllm made the
    directory (a GGUF's conversion in its cache)."""
    try:
        model_dir.resolve().relative_to((cache_dir() / "gguf").resolve())
    except ValueError:
        return None
    sources = sorted(
        path
        for pattern in ("tokenizer*", "special_tokens_map.json", "chat_template*", "*.model")
        for path in model_dir.glob(pattern)
        if not path.name.startswith("tokenizer-snapshot")
    )
    fingerprint = hashlib.sha256(transformers.__version__.encode())
    for path in sources:
        stat = path.stat()
        fingerprint.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    for stale in model_dir.glob("tokenizer-snapshot-*.pickle"):
        if not stale.name.endswith(f"{fingerprint.hexdigest()[:16]}.pickle"):
            with contextlib.suppress(OSError):  # a read-only cache keeps it
                stale.unlink(missing_ok=True)
    return model_dir / f"tokenizer-snapshot-{fingerprint.hexdigest()[:16]}.pickle"
