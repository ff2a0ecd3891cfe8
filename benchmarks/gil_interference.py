"""What a second Python thread costs the engine's steps: the server's situation in one process.

`minivllm serve` steps the engine on one thread while the HTTP side (asyncio, on another
thread of the same process) formats and sends each token: both need the GIL. This prefills
`--batch` random prompts of the default model, then times decode steps alone and beside a
thread that does a little Python (one small JSON chunk per sequence) every 2 ms, with the
server's 0.5 ms GIL switch interval, on 2 torch threads and on 1. It prints wall ms per step
(min and median of 4 x 10 steps).

    .venv/bin/python benchmarks/gil_interference.py --batch 16
    .venv/bin/python benchmarks/gil_interference.py --batch 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import torch

from minivllm import LLM, SamplingParams
from minivllm.bench.workloads import Workload


def timed_steps(engine) -> tuple[float, float]:
    """(min, median) wall ms per step over 4 runs of 10 steps."""
    runs = []
    for _ in range(4):
        start = time.perf_counter()
        for _ in range(10):
            engine.step()
        runs.append((time.perf_counter() - start) / 10 * 1e3)
    return min(runs), statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    sys.setswitchinterval(0.0005)  # as minivllm/server/serve.py sets it
    engine = LLM(None, num_kv_blocks=1024).llm_engine
    prompts, _ = Workload(args.batch, (32, 256), (1, 1), 7).make(engine.model_runner.vocab_size)
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=2000, ignore_eos=True))
    while engine.scheduler.waiting or any(
        s.num_cached_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()
    stop = threading.Event()

    def http_like() -> None:  # a token's worth of Python per sequence, every 2 ms
        chunk = {"id": "cmpl", "choices": [{"delta": {"content": "hello"}, "index": 0}]}
        while not stop.is_set():
            for _ in range(args.batch):
                json.dumps(chunk)
            time.sleep(0.002)

    for threads in (2, 1):
        torch.set_num_threads(threads)
        alone = timed_steps(engine)
        stop.clear()
        helper = threading.Thread(target=http_like)
        helper.start()
        beside = timed_steps(engine)
        stop.set()
        helper.join()
        print(
            f"batch {args.batch}, {threads} torch threads: {alone[0]:.1f} / {alone[1]:.1f} ms "
            f"per step alone, {beside[0]:.1f} / {beside[1]:.1f} beside the thread "
            f"(min / median; {beside[1] / alone[1]:.2f}x)",
            flush=True,
        )
    for seq in list(engine.scheduler.running):
        engine.abort_request(seq.seq_id)


if __name__ == "__main__":
    main()
