"""Decode speed over a quantized KV cache against the `auto` one, at a given context.

For each `--kv-cache-dtype` (interleaved, `--rounds` times: the machine is shared and noisy),
it loads the model, prefills `c` random prompts of `context` tokens and decodes a token (not
timed: the first decode steps at a new length may trace the compiled step again), then asks
the same prompts for `2 + new` tokens: the prompts come back from the prefix cache, so the
timed run is about the decode of `new` tokens per sequence over a `context`-token cache. It
prints decode tok/s per run and the ratio of each dtype's best to `auto`'s best.

    python benchmarks/kv_cache_dtype.py --context 512 --concurrency 1 16
"""

from __future__ import annotations

import argparse
import gc
import random
import time

from minivllm import LLM, SamplingParams


def decode_rate(llm: LLM, context: int, concurrency: int, new: int) -> float:
    """Decode tok/s of `concurrency` sequences at `context` tokens of cached prompt."""
    rng = random.Random(context * 1000 + concurrency)
    vocab = llm.llm_engine.model_runner.vocab_size
    prompts = [
        [rng.randrange(100, vocab - 100) for _ in range(context)] for _ in range(concurrency)
    ]
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    params = SamplingParams(max_tokens=2 + new, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return concurrency * new / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--new", type=int, default=32, help="decoded tokens per sequence")
    parser.add_argument("--kinds", nargs="+", default=["auto", "int8"])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    best: dict[tuple[str, int], float] = {}
    for round_ in range(args.rounds):
        for kind in args.kinds:
            llm = LLM(
                args.model,
                kv_cache_dtype=kind,
                max_model_len=args.context + args.new + 16,
                max_num_seqs=max(args.concurrency),
            )
            for c in args.concurrency:
                rate = decode_rate(llm, args.context, c, args.new)
                best[kind, c] = max(rate, best.get((kind, c), 0.0))
                print(f"round {round_} {kind:>5} context {args.context} c={c}: {rate:.1f} tok/s")
            del llm
            gc.collect()
    for c in args.concurrency:
        base = best["auto", c]
        ratios = ", ".join(f"{k} {best[k, c]:.1f} ({best[k, c] / base:.2f}x)" for k in args.kinds)
        print(f"context {args.context} c={c}, best of {args.rounds}: {ratios}")


if __name__ == "__main__":
    main()
