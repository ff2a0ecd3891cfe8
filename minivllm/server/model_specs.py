"""The models a multi-model server may serve: `--model PATH` (repeated) and `--models-dir DIR`.

In DIR, each `.gguf` file is a model named by its stem and each HF directory (one holding a
config.json) a model named by the directory's name; or, where DIR holds a `models.yaml` or
`models.json`, that file alone lists them, name -> path (relative to DIR) or name -> {path,
engine options}:

    {"chat": {"path": "SmolLM2-135M-Instruct-Q8_0.gguf", "max_model_len": 4096},
     "coder": "qwen2.5-coder-1.5b-q4_k_m.gguf"}

A model's engine options are the command line's, overridden by its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minivllm.config import EngineConfig

MODELS_FILES = ("models.yaml", "models.yml", "models.json")


@dataclass(frozen=True)
class ModelSpec:
    """One servable model: its name (what requests say in `model`) and its engine options."""

    name: str
    engine_options: dict[str, Any]

    def estimated_bytes(self) -> int:
        """Memory the model will take before it is measured: its weight files on disk plus
        the KV budget its options give (0 where left to the engine)."""
        path = Path(str(self.engine_options.get("model") or ""))
        if path.is_file():
            weights = path.stat().st_size
        elif path.is_dir():
            suffixes = {".safetensors", ".bin", ".gguf", ".pt"}
            weights = sum(f.stat().st_size for f in path.iterdir() if f.suffix in suffixes)
        else:
            weights = 0
        kv_gb = self.engine_options.get("kv_cache_memory_gb") or 0
        return weights + int(float(kv_gb) * 1e9)


def model_name(path: str | None) -> str:
    """A model's name from its path: the file's stem or the directory's name (the default
    model's own name without one)."""
    if path is None:
        return "SmolLM2-135M-Instruct"
    return str(path).rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf")


def model_specs(
    models: list[str | None], models_dir: str | None, engine_options: dict[str, Any]
) -> list[ModelSpec]:
    """The `--model` paths, then the models of `--models-dir`; ValueError (naming what to
    change) for a duplicate name, a bad models file or bad engine options."""
    specs = [ModelSpec(model_name(m), {**engine_options, "model": m}) for m in models]
    if models_dir is not None:
        specs += dir_specs(Path(models_dir), engine_options)
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(
                f"two models are named {spec.name!r}: rename one, or name them in a models.json"
            )
        seen.add(spec.name)
        _check_options(spec)
    if not specs:
        raise ValueError(f"no models found in {models_dir}: add .gguf files or HF directories")
    return specs


def dir_specs(root: Path, engine_options: dict[str, Any]) -> list[ModelSpec]:
    """The models of one `--models-dir` (see the module docstring)."""
    if not root.is_dir():
        raise ValueError(f"--models-dir {root} is not a directory")
    listed = next((root / f for f in MODELS_FILES if (root / f).is_file()), None)
    if listed is not None:
        return [
            _listed_spec(name, entry, root, engine_options, listed)
            for name, entry in _read_models_file(listed).items()
        ]
    specs = []
    for item in sorted(root.iterdir()):
        if item.suffix == ".gguf" or (item / "config.json").is_file():
            specs.append(ModelSpec(model_name(str(item)), {**engine_options, "model": str(item)}))
    return specs


def _read_models_file(path: Path) -> dict[str, Any]:
    text = path.read_text()
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml  # PyYAML, installed with transformers

            data = yaml.safe_load(text)
    except Exception as exc:
        raise ValueError(f"{path} cannot be read: {exc}") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{path} must map model names to a path or to {{path, options}}")
    return data


def _listed_spec(
    name: object, entry: object, root: Path, engine_options: dict[str, Any], source: Path
) -> ModelSpec:
    if isinstance(entry, str):
        entry = {"path": entry}
    if not isinstance(name, str) or not isinstance(entry, dict) or "path" not in entry:
        raise ValueError(f"{source}: {name!r} must map to a path or to {{path, options}}")
    options = dict(entry)
    path = Path(str(options.pop("path")))
    path = path if path.is_absolute() else root / path
    if not path.exists():
        raise ValueError(f"{source}: the model {name!r}'s path {path} does not exist")
    return ModelSpec(name, {**engine_options, **options, "model": str(path)})


def _check_options(spec: ModelSpec) -> None:
    try:
        EngineConfig.from_options(**spec.engine_options)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the model {spec.name!r}: {exc}") from None
