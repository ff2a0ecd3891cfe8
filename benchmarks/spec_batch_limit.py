"""Speculation's batch rule at 16 sequences: the same n-gram config with two values of
`disable_by_batch_size` (the measured limit against vLLM's "any batch"), both engines in this
process, taking turns on the same 16 random prompts (the serve benchmark's c=16 level: 32-256
tokens, 128 greedy tokens each, `ignore_eos`), added at once.

    .venv/bin/python benchmarks/spec_batch_limit.py MODEL.gguf [--limits 256 3] [--rounds 2]
        [--draft-token-cost 0.3]

`draft_token_cost` is given (no start-up measurement), so the two engines differ only in the
batch rule. Prints tok/s and the draft tokens each engine verified, per round. Never part of
`make test`.
"""

from __future__ import annotations

import argparse
import time

from minivllm import LLM, SamplingParams
from minivllm.bench.workloads import Workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--limits", type=int, nargs="+", default=[256, 3])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--draft-token-cost", type=float, default=0.3)
    args = parser.parse_args()
    engines = {
        limit: LLM(
            args.model,
            speculative_config={
                "method": "ngram",
                "disable_by_batch_size": limit,
                "draft_token_cost": args.draft_token_cost,
            },
        )
        for limit in args.limits
    }
    vocab = next(iter(engines.values())).llm_engine.model_runner.vocab_size
    prompts, _ = Workload(16, (32, 256), (128, 128)).make(vocab)
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    for round_ in range(args.rounds):
        for limit, llm in engines.items():
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            seconds = time.perf_counter() - start
            drafts = llm.llm_engine.stats().get("spec_decode_num_draft_tokens", 0)
            print(
                f"round {round_}, disable_by_batch_size {limit}: "
                f"{len(prompts) * 128 / seconds:.1f} tok/s, {drafts:.0f} draft tokens so far",
                flush=True,
            )


if __name__ == "__main__":
    main()
