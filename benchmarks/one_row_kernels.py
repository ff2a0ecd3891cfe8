"""A one-sequence decode step with the 4-bit layers on torch's int4 kernel and on our qgemv
kernel's AVX-512 VNNI path (the first entry of `chooser.int4_table`'s row table), two engines
in one process stepped in interleaved rounds, so that the machine's drift hits both alike.

    .venv/bin/python benchmarks/one_row_kernels.py [--rounds 12] [--steps 20] [--context 200]

Prints the median and min ms per step of each. Needs a CPU where the VNNI path runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

from minivllm import LLM, SamplingParams
from minivllm.bench.workloads import Workload
from minivllm.layers.cpu_kernels import cpu_caps
from minivllm.layers.quantization import rows as kernel_rows


def decoding_engine(vnni: bool, context: int) -> Any:
    """An engine decoding one sequence, its 4-bit layers taking (or not) the VNNI path at one
    row: its row threshold in the table is 1 (or 0) while the weights are packed."""
    kind = cpu_caps().kind
    real = kernel_rows.KERNEL_ROWS[kind]
    kernel_rows.KERNEL_ROWS[kind] = dataclasses.replace(real, qgemv_vnni_bf16=int(vnni))
    try:
        engine = LLM(None, num_kv_blocks=512).llm_engine
    finally:
        kernel_rows.KERNEL_ROWS[kind] = real
    prompts, _ = Workload(1, (context, context), (1, 1)).make(engine.model_runner.vocab_size)
    engine.add_request(
        prompts[0], SamplingParams(max_tokens=4000, ignore_eos=True, temperature=0.6)
    )
    for _ in range(5):  # the prefill and warm-up decodes
        engine.step()
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--context", type=int, default=200)
    args = parser.parse_args()
    if not cpu_caps().qgemv_vnni:
        raise SystemExit("qgemv's VNNI path does not run here")
    engines = {
        "torch int4": decoding_engine(False, args.context),
        "qgemv VNNI": decoding_engine(True, args.context),
    }
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    for name, values in times.items():
        print(
            f"{name}: median {statistics.median(values):.2f} ms, min {min(values):.2f} ms a "
            f"step ({args.rounds} interleaved rounds of {args.steps})"
        )


if __name__ == "__main__":
    main()
