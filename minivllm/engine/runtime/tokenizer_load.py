"""The HTTP side's tokenizer, loaded while the engine process starts (engine_process.py): on a
thread of the lowest CPU priority, from the model's directory as the engine names it, or
before that where this side can foresee it."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any

from minivllm.cache import gguf_cached_dir


def predicted_model_dir(model: Any) -> Path | None:
    """The directory the engine will resolve `model` to, where this side can tell without
    importing torch: a model directory, or a GGUF file converted at an earlier start (its
    directory in minivllm's cache); None otherwise (the default model, a first start). The
    torch-free part of `minivllm.models.paths.resolve_model_dir`, which decides: a wrong guess
    only costs the early load (`TokenizerLoad.serves`)."""
    if not isinstance(model, str | Path):
        return None
    path = Path(model).expanduser()
    with contextlib.suppress(OSError):
        if path.is_dir():
            return path if (path / "config.json").is_file() else None
        if path.suffix.lower() == ".gguf" and path.is_file():
            cached = gguf_cached_dir(path)
            return cached if (cached / "config.json").is_file() else None
    return None


class TokenizerLoad:
    """A model directory's tokenizer, loading on a thread of the lowest CPU priority (Linux
    sets it per thread): the engine's load, on the start-up's critical path, runs torch
    threads on both cores of a 2-core CPU, and beside this load at equal priority it took
    0.4-0.5 s longer. `result()` waits for it (and raises what the load raised)."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._result: dict[str, Any] = {}
        self._thread = threading.Thread(
            target=self._load, name="minivllm-tokenizer-load", daemon=True
        )
        self._thread.start()

    def _load(self) -> None:
        from minivllm.tokenizer import load_tokenizer  # transformers, not torch

        with contextlib.suppress(AttributeError, OSError):  # no per-thread priority here
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            self._result["tokenizer"] = load_tokenizer(self.model_dir)
        except Exception as exc:  # raised on the caller's thread
            self._result["error"] = exc

    def result(self) -> Any:
        self._thread.join()
        if "error" in self._result:
            raise self._result["error"]
        return self._result["tokenizer"]

    def serves(self, model_dir: Path) -> bool:
        """Whether it loads `model_dir`'s tokenizer."""
        with contextlib.suppress(OSError):
            return self.model_dir.resolve() == model_dir.resolve()
        return False


def load_tokenizer_behind_the_engine(model_dir: Path) -> Any:
    """The tokenizer, loaded by a thread of the lowest CPU priority (`TokenizerLoad`)."""
    return TokenizerLoad(model_dir).result()
