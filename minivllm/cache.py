"""The minivllm cache root, where converted models are kept (importable without torch: the
server's HTTP process finds a converted GGUF's directory here too)."""

import hashlib
import os
from pathlib import Path

# Bump when what the GGUF conversion (`minivllm.models.gguf.write_model_files`) writes
# changes, so stale caches are not reused.
GGUF_METADATA_VERSION = 2


def cache_dir() -> Path:
    """The minivllm cache root: `$MINIVLLM_CACHE`, else `~/.cache/minivllm`."""
    env = os.environ.get("MINIVLLM_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "minivllm"


def gguf_cache_key(gguf_path: str | Path) -> str:
    """Hash of the file's resolved path, size, mtime and `GGUF_METADATA_VERSION`."""
    path = Path(gguf_path).resolve()
    stat = path.stat()
    text = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|v{GGUF_METADATA_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def gguf_cached_dir(gguf_path: str | Path) -> Path:
    """Where `gguf_model_dir` puts (or finds) the config and tokenizer files of `gguf_path`."""
    path = Path(gguf_path)
    return cache_dir() / "gguf" / f"{path.stem}-{gguf_cache_key(path)}"
