"""Speculation's default against the off switch: the same model with `speculative_config`
unset and with `{"method": "none"}`, `bench serve`'s text workloads (`grounded` answers quote
their prompt, `chat` ones do not) at one sequence and at 16, each engine in a process of its
own (two engines in one process share Dynamo's cache of the compiled layer, which skewed the
ratios), the two taking turns, best of `--rounds`. Prints each rate and their ratio, and what
the default chose at start-up (its measured `draft_token_cost`, or off).

    .venv/bin/python benchmarks/spec_default.py --model FILE.gguf [--workloads grounded chat]
        [--concurrency 1 16] [--max-tokens 128] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from minivllm import LLM, SamplingParams
from minivllm.bench.text_workloads import text_prompts
from minivllm.config import SPECULATION_OFF


def rate(llm: LLM, prompts: list[list[int]], concurrency: int, max_tokens: int) -> float:
    """Completion tokens per second, prefills included, `concurrency` requests at a time."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        batch = [{"prompt_token_ids": p} for p in prompts[i : i + concurrency]]
        outputs = llm.generate(batch, params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens / (time.perf_counter() - start)


def run_one(args: argparse.Namespace) -> dict[str, float]:
    """One engine (`args.one`), every workload and concurrency once: {"workload c": tok/s}."""
    spec = SPECULATION_OFF if args.one == "off" else None
    llm = LLM(args.model, kv_cache_memory_gb=args.kv_cache_memory_gb, speculative_config=spec)
    chosen = llm.llm_engine.config.speculative_config
    rates: dict[str, float] = {"draft_token_cost": chosen.draft_token_cost if chosen else -1.0}
    for workload in args.workloads:
        for concurrency in args.concurrency:
            prompts = text_prompts(llm.get_tokenizer(), workload, max(4, concurrency), concurrency)
            rates[f"{workload} c={concurrency}"] = rate(llm, prompts, concurrency, args.max_tokens)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--workloads", nargs="+", default=["grounded", "chat"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kv-cache-memory-gb", type=float, default=0.5)
    parser.add_argument("--one", choices=["default", "off"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args)))
        return
    best: dict[str, dict[str, float]] = {"default": {}, "off": {}}
    for _ in range(args.rounds):
        for name in best:
            command = [sys.executable, __file__, *sys.argv[1:], "--one", name]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            for key, value in json.loads(out.splitlines()[-1]).items():
                best[name][key] = max(best[name].get(key, value), value)
    cost = best["default"].pop("draft_token_cost")
    best["off"].pop("draft_token_cost")
    chose = f"n-gram, draft_token_cost {cost:.3f}" if cost >= 0 else "off"
    print(f"model {args.model or 'default'}: the default chose {chose}")
    for key, off in best["off"].items():
        default = best["default"][key]
        ratio = default / off
        print(f"{key:>14}: default {default:6.1f} tok/s, off {off:6.1f} tok/s, {ratio:.2f}x")


if __name__ == "__main__":
    main()
