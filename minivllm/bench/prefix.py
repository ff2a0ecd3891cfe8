"""`minivllm bench prefix`: requests sharing a long prefix, prefix caching on versus off."""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from typing import Any

from minivllm.bench.common import Result, machine
from minivllm.bench.workloads import shared_prefix_prompts


def cmd_prefix(args: argparse.Namespace, options: dict[str, Any]) -> dict[str, Any]:
    """Many requests sharing a long prefix, prefix caching on versus off."""
    from minivllm import LLM, SamplingParams

    results = []
    for enabled in (True, False):
        llm = LLM(**(options | {"enable_prefix_caching": enabled}))
        vocab = llm.llm_engine.model_runner.vocab_size
        prompts = shared_prefix_prompts(
            args.num_requests, args.prefix_len, args.suffix_len, vocab, args.seed
        )
        prefix = prompts[0][: args.prefix_len]
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate([prefix[:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        llm.generate(prompts[:1], params, use_tqdm=False)  # the first request fills the cache
        llm.generate(prompts[1:], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        hits = llm.llm_engine.scheduler.block_manager.prefix_hits
        name = "cache on" if enabled else "cache off"
        results.append(Result(name, len(prompts), len(prompts) * args.output_len, seconds))
        print(results[-1].line() + f", prefix-cache hit tokens {hits}", flush=True)
        del llm
    ratio = results[1].seconds / results[0].seconds
    print(f"prefix caching speed-up: {ratio:.2f}x")
    return {
        "benchmark": "prefix",
        "machine": machine(),
        "prefix_len": args.prefix_len,
        "suffix_len": args.suffix_len,
        "output_len": args.output_len,
        "results": [asdict(r) | {"tok_per_s": r.tok_per_s} for r in results],
        "speedup": ratio,
    }
