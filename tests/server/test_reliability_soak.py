"""The CI soak: scripts/soak.py's checks, sized to run in well under a minute on 2 cores.

300 streaming requests of mixed lengths from 24 concurrent clients, about a third of them
disconnecting mid-stream, two injected runner faults, on a KV pool small enough to force
preemption (num_kv_blocks=64, max_num_seqs=16, tiny Llama). `scripts/soak.py --model DIR
--requests N --duration S` runs the long version.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from minivllm.engine.llm_engine import LLMEngine

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"
_spec = importlib.util.spec_from_file_location("minivllm_soak", _SCRIPT)
soak = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = soak  # dataclasses look their module up there
_spec.loader.exec_module(soak)

NUM_REQUESTS = 300
FAULTS = {150, 600}  # ModelRunner.run calls, counted from the start of the load
MAX_NUM_SEQS = 16


def test_soak_streams_disconnects_preemption_and_faults(tiny_llama_dir: Path) -> None:
    """Every request that was not abandoned got its whole greedy completion exactly once
    (streamed text == the non-streamed reference, usage == max_tokens, one [DONE]) or an
    error event for an injected fault; preemption happened; afterwards /health is OK,
    nothing runs or waits, kv usage is 0, the server's request maps are empty, and the log
    holds no error besides the injected faults."""
    specs = soak.make_specs(NUM_REQUESTS, seed=0)
    threads = torch.get_num_threads()
    # One intra-op thread: the tiny model gains nothing from more, and on a busy 2-core
    # machine spinning OpenMP threads make each step 20x slower.
    torch.set_num_threads(1)
    try:
        report, engine = soak.soak_local(
            str(tiny_llama_dir),
            specs,
            concurrency=24,
            duration=120,
            fail_on_calls=FAULTS,
            num_kv_blocks=64,
            max_num_seqs=MAX_NUM_SEQS,
        )
    finally:
        torch.set_num_threads(threads)
    print(report.summary())
    assert report.problems == [], report.problems[:10]
    assert len(report.results) == NUM_REQUESTS, "the duration cap cut the load short"
    assert isinstance(engine, LLMEngine)
    assert report.metrics["minivllm:num_preemptions_total"] > 0
    assert report.count("abandoned") > NUM_REQUESTS // 6
    fired = len(engine.model_runner.failures)
    assert fired >= 1
    assert 0 < report.count("injected_error") <= fired * MAX_NUM_SEQS
    assert report.count("completed") > NUM_REQUESTS // 3
