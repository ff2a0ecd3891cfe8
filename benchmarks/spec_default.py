"""Speculation's default against the off switch, side by side in one process: the same model
loaded twice (`speculative_config` unset, and `{"method": "none"}`), `bench serve`'s text
workloads (`grounded` answers quote their prompt, `chat` ones do not) at one sequence and at
16, the two engines taking turns, best of `--rounds`. Prints each rate and their ratio, and
what the default chose at start-up (its measured `draft_token_cost`, or off).

    .venv/bin/python benchmarks/spec_default.py --model FILE.gguf [--workloads grounded chat]
        [--concurrency 1 16] [--max-tokens 128] [--rounds 2]
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--workloads", nargs="+", default=["grounded", "chat"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kv-cache-memory-gb", type=float, default=0.5)
    args = parser.parse_args()
    common = {"kv_cache_memory_gb": args.kv_cache_memory_gb}
    engines = {
        "default": LLM(args.model, **common),
        "off": LLM(args.model, speculative_config=SPECULATION_OFF, **common),
    }
    spec = engines["default"].llm_engine.config.speculative_config
    chose = f"n-gram, draft_token_cost {spec.draft_token_cost:.3f}" if spec else "off"
    print(f"model {args.model or 'default'}: the default chose {chose}", flush=True)
    tokenizer = engines["off"].get_tokenizer()
    for workload in args.workloads:
        for concurrency in args.concurrency:
            prompts = text_prompts(tokenizer, workload, max(4, concurrency), seed=concurrency)
            best = {name: 0.0 for name in engines}
            for _ in range(args.rounds):
                for name, llm in engines.items():
                    best[name] = max(best[name], rate(llm, prompts, concurrency, args.max_tokens))
            print(
                f"{workload:>8} c={concurrency:<2}: default {best['default']:6.1f} tok/s, "
                f"off {best['off']:6.1f} tok/s, {best['default'] / best['off']:.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
