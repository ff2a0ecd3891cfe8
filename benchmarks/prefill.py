"""A prefill's wall time on the CPU, with the minor page faults it takes.

Prefills `--prompts` random prompts of `--min`..`--max` tokens (by default the serve
benchmark's c=16 level: 16 prompts of 32-256 tokens) together, one token each, `--rounds`
times after a warm-up, and prints each round's seconds, tokens a second and minor page faults.
`--malloc-defaults` leaves glibc's malloc as it is (no `memory.hold_step_blocks`): its large
blocks fresh from the system each step, the MLP in 16 MB slices.

    .venv/bin/python benchmarks/prefill.py --model FILE.gguf [--malloc-defaults]
"""

from __future__ import annotations

import argparse
import resource
import time

from minivllm import LLM, SamplingParams, heap
from minivllm.bench.workloads import Workload
from minivllm.config import SPECULATION_OFF
from minivllm.engine import memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--min", type=int, default=32)
    parser.add_argument("--max", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--malloc-defaults", action="store_true")
    args = parser.parse_args()
    if args.malloc_defaults:  # before the engine holds them
        memory.hold_step_blocks = lambda device: None
    llm = LLM(args.model, speculative_config=SPECULATION_OFF, enable_prefix_caching=False)
    prompts, _ = Workload(args.prompts, (args.min, args.max), (1, 1)).make(
        llm.llm_engine.model_runner.vocab_size
    )
    tokens = sum(map(len, prompts))
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(requests, params, use_tqdm=False)  # warm-up
    print(f"{args.prompts} prompts, {tokens} tokens, block budget {heap.block_budget() >> 20} MB")
    for _ in range(args.rounds):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        llm.generate(requests, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        print(f"prefill {seconds:.2f} s, {tokens / seconds:.0f} tok/s, {faults} minor faults")


if __name__ == "__main__":
    main()
