"""The start-up's timed steps (`spec_cost.StepTimes`) kept on disk, so that a warm start reads
them instead of timing them again.

Timing the steps speculation weighs runs a dozen steps, several of many tokens: on a 2-core
CPU a tenth of a warm start (docs/real-models.md, "Start-up: where the seconds go"). What they
measure depends on the model's files, on this machine (its CPU, the threads torch runs on), on
the code that runs the steps and on how it runs them (the runner's config: dtype, KV cache,
weights, eager or compiled), and on the steps' shapes. A file under `<cache>/step-times/`,
named by a hash of all of that, keeps what the first start measured; a later start with the
same answers reads it, and any change (another file, thread count or option, an edited
kernel) is another name, measured again; so is a start whose one-token step runs notably
faster than the kept one (`spec_cost`). Deleting the directory measures everything again.

Only a `ModelRunner`'s steps are kept (not tensor parallelism's, nor with a draft model).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
from pathlib import Path
from typing import Any

from minivllm.cache import cache_dir

logger = logging.getLogger(__name__)

CODE_SUFFIXES = (".py", ".cpp", ".h")


def step_times_key(runner: Any, steps: list[Any]) -> str | None:
    """The name this runner's timed `steps` (what shapes them) are kept under, or None where
    they are not kept."""
    from minivllm.engine.model_runner import ModelRunner

    if not isinstance(runner, ModelRunner):
        return None
    facts = {
        "model": _files(runner.gguf.path if runner.gguf else Path(runner.model_dir)),
        "machine": _machine(runner.device),
        "code": _code(),
        "runner": [repr(runner.config), str(runner.dtype), str(runner.kv_dtype)],
        "runs": [runner.weight_kernel, runner.compiled_decode is not None],
        "steps": steps,
    }
    return hashlib.sha256(json.dumps(facts, default=str).encode()).hexdigest()[:32]


def load_step_times(key: str | None) -> dict[str, float | None] | None:
    """The times kept under `key`, by name; None where there are none (or the file is not
    ours)."""
    if key is None:
        return None
    path = _path(key)
    try:
        times = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(times, dict) or not all(
        isinstance(v, float | int | None) for v in times.values()
    ):
        return None
    logger.info("speculation's step times read from %s (measured at an earlier start)", path)
    return times


def save_step_times(key: str | None, times: dict[str, float | None]) -> None:
    """Keep `times` under `key` (written whole, then renamed: two starts may race)."""
    if key is None:
        return
    path = _path(key)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(times))
        partial.replace(path)
    except OSError:  # a read-only cache: the next start measures again
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)


def _path(key: str) -> Path:
    return cache_dir() / "step-times" / f"{key}.json"


def _stat(path: Path) -> list[Any]:
    stat = path.stat()
    return [str(path), stat.st_size, stat.st_mtime_ns]


def _files(source: Path) -> list[list[Any]]:
    """A GGUF file, or an HF directory's files: their names, sizes and times."""
    source = source.resolve()
    if source.is_file():
        return [_stat(source)]
    return [_stat(path) for path in sorted(source.iterdir()) if path.is_file()]


def _machine(device: Any) -> list[Any]:
    import torch

    from minivllm.layers.cpu_kernels import cpu_caps

    if device.type == "cuda":
        return [torch.__version__, torch.cuda.get_device_name(device)]
    return [
        torch.__version__,
        _cpu_model(),
        os.cpu_count(),
        torch.get_num_threads(),
        cpu_caps().capability,
    ]


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def _code() -> list[list[Any]]:
    """minivllm's own files (its kernels' sources included): an edit is another key."""
    package = Path(__file__).resolve().parents[1]  # minivllm/
    return [
        _stat(path)
        for path in sorted(package.rglob("*"))
        if path.suffix in CODE_SUFFIXES and path.is_file()
    ]
