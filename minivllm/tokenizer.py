"""A model directory's tokenizer, loaded without importing torch where it can be.

The server's HTTP process loads it too, and has no other use for torch: importing it there
(through the model registry, or transformers' AutoTokenizer) held ~0.2 GB of its resident
memory (docs/real-models.md). A snapshot unpickles without torch; only a load from the
sources imports AutoTokenizer."""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
from pathlib import Path
from typing import Any

import tokenizers
import transformers

from minivllm.cache import cache_dir
from minivllm.heap import release_free_heap


def load_tokenizer(model_dir: Path) -> Any:
    """The model directory's tokenizer (never fetched from the hub: the directory is local).

    A directory minivllm wrote itself (a GGUF's conversion, under `<cache>/gguf`) keeps the
    loaded tokenizer pickled beside its files, for the next start: transformers 5 rebuilds a
    GemmaTokenizer's 262k-token vocabulary from its JSON in Python (2.8 s of a warm start, in
    each of the server's two processes), where unpickling it takes 1.2 s. The snapshot's name
    holds transformers' version and the tokenizer files' sizes and times: any change makes a
    new one. A user's own directory is only read. What the load freed goes back to the system
    (`release_free_heap`)."""
    tokenizer = _load(Path(model_dir))
    release_free_heap()
    return tokenizer


def _load(model_dir: Path) -> Any:
    snapshot = _tokenizer_snapshot(model_dir)
    if snapshot is not None and snapshot.exists():
        try:
            return pickle.loads(snapshot.read_bytes())  # noqa: S301 - our own cache's file
        except Exception:  # a torn or foreign file: load from the sources, write it again
            pass
    tokenizer = _from_sources(model_dir)
    _drop_construction_copies(tokenizer)  # nor does the snapshot keep them
    if snapshot is not None:
        partial = snapshot.with_name(f"{snapshot.name}.{os.getpid()}.partial")
        try:
            partial.write_bytes(pickle.dumps(tokenizer))
            partial.replace(snapshot)  # both processes of a server may write it: last wins
        except Exception:  # unpicklable, or a read-only cache: the next start loads it again
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
    return tokenizer


# transformers 5's BPE tokenizer classes (Llama, Qwen2, Gemma...) keep the vocabulary and merges
# they built the Rust tokenizer from as Python objects, read only by their __init__: for
# Gemma 3's 262k tokens and 515k merges 0.14 GB in each of the server's processes, and 0.2-0.5 s
# of unpickling the snapshot.
CONSTRUCTION_COPIES = ("_vocab", "_merges")
SNAPSHOT_FORMAT = 2  # in the snapshot's name: 2 is without the copies


def _drop_construction_copies(tokenizer: Any) -> None:
    if not isinstance(getattr(tokenizer, "_tokenizer", None), tokenizers.Tokenizer):
        return  # not a Rust-backed tokenizer: its Python vocabulary may be the tokenizer
    for name in CONSTRUCTION_COPIES:
        value = tokenizer.__dict__.get(name)
        if isinstance(value, dict | list):
            tokenizer.__dict__[name] = type(value)()


def _from_sources(model_dir: Path) -> Any:
    from transformers import AutoTokenizer  # imports torch (transformers 5): only when needed

    return AutoTokenizer.from_pretrained(model_dir)


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
    fingerprint = hashlib.sha256(f"{transformers.__version__};{SNAPSHOT_FORMAT}".encode())
    for path in sources:
        stat = path.stat()
        fingerprint.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    for stale in model_dir.glob("tokenizer-snapshot-*.pickle"):
        if not stale.name.endswith(f"{fingerprint.hexdigest()[:16]}.pickle"):
            with contextlib.suppress(OSError):  # a read-only cache keeps it
                stale.unlink(missing_ok=True)
    return model_dir / f"tokenizer-snapshot-{fingerprint.hexdigest()[:16]}.pickle"
