"""How an engine thread shares the CPU with the HTTP thread of its own process.

Only the in-process runtime needs it (`AsyncLLMEngine` beside uvicorn: `minivllm serve --lab`
or `--no-engine-process`); an engine process has the cores to itself.
"""

from __future__ import annotations

import sys
from typing import Any

from minivllm.engine.llm_engine import LLMEngine


def share_the_cpu_with_http(engine: LLMEngine) -> None:
    """On the CPU the engine thread and the HTTP thread share the cores and the GIL. Measured
    at one stream on 2 cores (`minivllm bench serve --compare llama.cpp`, docs/benchmarks.md):
    with torch's default 5 ms GIL switch interval, the engine thread waited for the GIL after
    its ops; and a one-sequence step on every core stalled in its threads' barriers whenever
    the HTTP thread held a core. So: a 0.5 ms switch interval, and one-sequence steps on all
    cores but one (steps of many sequences keep every core)."""
    import torch

    runner: Any = engine.model_runner  # a real ModelRunner: a fake one has no device
    if getattr(runner, "device", None) is None or runner.device.type != "cpu":
        return
    sys.setswitchinterval(0.0005)
    runner.small_step_threads = max(1, torch.get_num_threads() - 1)
