"""One engine step that mixes decodes with a new prompt's prefill, with the batch split into
attention groups (minivllm's `partition_batch`) and as one group, on the default model.

15 requests (prompts of 64-400 random ids) are prefilled and decode a few steps; then one
256-token prompt arrives and the next step runs its prefill beside the 15 decodes. Prints the
time of a plain decode step and of that mixed step, twice for each way.

    .venv/bin/python benchmarks/mixed_step.py
"""

from __future__ import annotations

import random
import time

import minivllm.layers.attention.metadata as attention_metadata
from minivllm import LLM, SamplingParams


def one_group(query_lens: list[int], seq_lens: list[int], overhead: int = 0) -> list[list[int]]:
    return [list(range(len(query_lens)))]


def main() -> None:
    real = attention_metadata.partition_batch
    engine = LLM(None).llm_engine
    rng = random.Random(0)
    vocab = engine.model_runner.vocab_size
    params = SamplingParams(max_tokens=50, ignore_eos=True)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    for name, partition in [("groups", real), ("one group", one_group)] * 2:
        attention_metadata.partition_batch = partition
        for _ in range(15):
            engine.add_request(prompt(rng.randint(64, 400)), params)
        for _ in range(4):  # the prefill of all 15, then decodes
            engine.step()
        start = time.perf_counter()
        engine.step()
        decode = time.perf_counter() - start
        engine.add_request(prompt(256), params)
        start = time.perf_counter()
        engine.step()
        mixed = time.perf_counter() - start
        print(
            f"{name:>9}: decode step {decode * 1e3:.0f} ms, mixed step {mixed * 1e3:.0f} ms",
            flush=True,
        )
        for seq_id in list(engine._requests):
            engine.abort_request(seq_id)
    attention_metadata.partition_batch = real


if __name__ == "__main__":
    main()
