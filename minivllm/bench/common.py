"""What every benchmark shares: a result line, the machine's description, the chart."""

from __future__ import annotations

import os
import platform
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Result:
    """One run's output tokens over its wall-clock seconds and over the CPU seconds the
    process used (`time.process_time`): on a shared, oversubscribed machine the wall clock
    mostly measures the neighbours, the CPU time what the run itself cost."""

    name: str
    requests: int
    output_tokens: int
    seconds: float
    cpu_seconds: float | None = None

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def tok_per_cpu_s(self) -> float | None:
        return None if self.cpu_seconds is None else self.output_tokens / self.cpu_seconds

    def line(self) -> str:
        cpu = (
            ""
            if self.cpu_seconds is None
            else (f"; {self.cpu_seconds:.2f} CPU s, {self.tok_per_cpu_s:.1f} tok per CPU s")
        )
        return (
            f"{self.name:>12}: {self.requests} requests, {self.output_tokens} output tokens, "
            f"{self.seconds:.2f} s, {self.tok_per_s:.1f} tok/s{cpu}"
        )


def hf_model_dir(runner: Any) -> AbstractContextManager[Path]:
    """A directory HF `from_pretrained` can load for the engine runner's model: the model's
    own, or for a GGUF (read in place, so its directory has no weights) a float32 conversion
    in a temporary directory, removed afterwards."""
    return _hf_model_dir(runner.model_dir, runner.gguf.path if runner.gguf else None)


@contextmanager
def _hf_model_dir(model_dir: Path, gguf_path: Path | None) -> Iterator[Path]:
    if gguf_path is None:
        yield model_dir
        return
    from minivllm.models.gguf import convert_gguf

    with tempfile.TemporaryDirectory(prefix="minivllm-hf-") as tmp:
        yield convert_gguf(gguf_path, tmp)


def machine() -> dict[str, Any]:
    import torch

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average_1min": os.getloadavg()[0],
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.barh([r["name"] for r in results], [r["tok_per_s"] for r in results], color="#3b6ea5")
    ax.set_xlim(0, 1.18 * max(r["tok_per_s"] for r in results))  # room for the labels
    ax.set_xlabel("output tokens / s")
    ax.set_title(f"minivllm bench {report['benchmark']}")
    for i, r in enumerate(results):
        ax.text(r["tok_per_s"], i, f" {r['tok_per_s']:.1f}", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
