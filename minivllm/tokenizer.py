"""A model directory's tokenizer, loaded without importing torch where it can be.

The server's HTTP process loads it too, and has no other use for torch: importing it there
(through the model registry, or transformers' AutoTokenizer) held ~0.2 GB of its resident
memory (docs/real-models.md). A snapshot unpickles without torch; only a load from the
sources imports AutoTokenizer."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
import time
from pathlib import Path
from typing import Any

import tokenizers
import transformers

from minivllm.cache import cache_dir
from minivllm.heap import release_free_heap

logger = logging.getLogger(__name__)


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
    tokenizer = _read_snapshot(snapshot)
    if tokenizer is None:
        tokenizer = _from_sources(model_dir)
        _drop_construction_copies(tokenizer)  # nor does the snapshot keep them
        _write_snapshot(snapshot, tokenizer)
    return tokenizer


def _read_snapshot(snapshot: Path | None) -> Any | None:
    if snapshot is None or not snapshot.exists():
        return None
    try:
        return pickle.loads(snapshot.read_bytes())  # noqa: S301 - our own cache's file
    except Exception:  # a torn or foreign file: load from the sources, write it again
        return None


def _write_snapshot(snapshot: Path | None, tokenizer: Any) -> None:
    if snapshot is None:
        return
    partial = snapshot.with_name(f"{snapshot.name}.{os.getpid()}.partial")
    try:
        partial.write_bytes(pickle.dumps(tokenizer))
        partial.replace(snapshot)  # both processes of a server may write it: last wins
    except Exception:  # unpicklable, or a read-only cache: the next start loads it again
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)


def load_decoder(model_dir: Path) -> Any:
    """The tokenizer of a process that turns token ids into text and does little else (the
    server's engine process: its requests arrive tokenized).

    A BPE tokenizer's merges are read only to encode, and parsing them is most of its load:
    from a snapshot of Gemma 3's (262k tokens, 515k merges) 0.37 s without them against 1.07
    with, Qwen2.5's 0.15 against 0.38, on a Zen 3. So a converted GGUF's tokenizer gets a
    second snapshot without them, and the engine decodes with that one (`DecodingTokenizer`);
    whatever else it is asked for (encoding a text prompt, llguidance's view of the
    tokenizer) loads the whole tokenizer first. A user's own directory, or a tokenizer
    without merges, loads whole."""
    snapshot = _tokenizer_snapshot(Path(model_dir))
    if snapshot is None:
        return load_tokenizer(model_dir)
    path = snapshot.with_name(snapshot.name.replace("snapshot-", "snapshot-decoder-", 1))
    decoder = _read_snapshot(path)
    if decoder is None:
        decoder = load_tokenizer(model_dir)
        if not os.access(path.parent, os.W_OK):  # nowhere to keep it: built at every start,
            return decoder  # it would cost more than it saves
        if not _drop_merges(decoder):
            return decoder
        _write_snapshot(path, decoder)
    release_free_heap()
    return DecodingTokenizer(decoder, Path(model_dir))


def _drop_merges(tokenizer: Any) -> bool:
    """Give `tokenizer` a Rust BPE model without its merges, in place (False where it has none
    to drop: not Rust-backed, or not BPE). It decodes as before; it would encode a text letter
    by letter, so only `DecodingTokenizer` holds it."""
    backend = getattr(tokenizer, "_tokenizer", None)
    # The model's kind from the object: serializing the whole tokenizer only to find it is not
    # BPE would be repeated at every start (no snapshot is kept for it).
    if not isinstance(backend, tokenizers.Tokenizer) or not isinstance(
        backend.model, tokenizers.models.BPE
    ):
        return False
    spec = json.loads(backend.to_str())
    model = spec["model"]  # a BPE model's, by the check above
    if not model.get("merges"):
        return False
    model["merges"] = []
    tokenizer._tokenizer = tokenizers.Tokenizer.from_str(json.dumps(spec))
    return True


class DecodingTokenizer:
    """A tokenizer whose decoding runs on a copy without its BPE merges (`load_decoder`); any
    other attribute is the whole tokenizer's, loaded on first use (`full`)."""

    def __init__(self, decoder: Any, model_dir: Path) -> None:
        self._decoder = decoder
        self._model_dir = model_dir
        self._full: Any | None = None

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        return self._decoder.decode(*args, **kwargs)

    def convert_ids_to_tokens(self, *args: Any, **kwargs: Any) -> Any:
        return self._decoder.convert_ids_to_tokens(*args, **kwargs)

    @property
    def eos_token_id(self) -> int | None:
        return self._decoder.eos_token_id

    def __len__(self) -> int:
        return len(self._decoder)

    @property
    def full(self) -> Any:
        """The whole tokenizer, merges included (loaded the first time it is asked for)."""
        if self._full is None:
            start = time.perf_counter()
            self._full = load_tokenizer(self._model_dir)
            logger.info(
                "loaded the whole tokenizer of %s (merges included) in %.1f s: more than "
                "decoding was asked of it (a text prompt, a grammar)",
                self._model_dir.name,
                time.perf_counter() - start,
            )
        return self._full

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_decoder", "_model_dir", "_full"):
            raise AttributeError(name)  # pickling and copying probe these before __init__
        return getattr(self.full, name)


def whole_tokenizer(tokenizer: Any) -> Any:
    """`tokenizer` itself, or a `DecodingTokenizer`'s whole one (what llguidance reads)."""
    return tokenizer.full if isinstance(tokenizer, DecodingTokenizer) else tokenizer


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
