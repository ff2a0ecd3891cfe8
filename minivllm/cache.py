"""The minivllm cache root, where converted models are kept."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """The minivllm cache root: `$MINIVLLM_CACHE`, else `~/.cache/minivllm`."""
    env = os.environ.get("MINIVLLM_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "minivllm"
