"""Decode speed over a quantized KV cache against the `auto` one, at a given context.

It loads the model once per `--kv-cache-dtype` (all kept loaded), prefills the prompts of
`context` tokens and decodes a token with each (not timed: the first decode steps at a new
length may trace the compiled step again). Then, `--rounds` times, interleaving the dtypes
(the machine is shared and noisy), it asks the same prompts for `2 + new` tokens: the prompts
come back from the prefix cache, so each timed run is the decode of `new` tokens per sequence
over a `context`-token cache. It prints decode tok/s per run and each dtype's best against
`auto`'s best.

`--shared-prefix`: the prompts share all but their last block (one prefill instead of `c`,
which at 8k tokens and c=16 is what fits a session on two cores). Each sequence still reads
its whole context every step, but the same pool blocks, which the CPU's caches may then hold:
it understates what the smaller cache saves in memory traffic.

    python benchmarks/kv_cache_dtype.py --context 512 --concurrency 1 16
    python benchmarks/kv_cache_dtype.py --context 8000 --concurrency 1 16 --shared-prefix
"""

from __future__ import annotations

import argparse
import random
import time

from minivllm import LLM, SamplingParams
from minivllm.config import SPECULATION_OFF

TAIL = 16  # the tokens that differ between prompts with --shared-prefix (one block)


def make_prompts(vocab: int, context: int, concurrency: int, shared: bool) -> list[list[int]]:
    """`concurrency` random prompts of `context` tokens (sharing all but TAIL if `shared`)."""
    rng = random.Random(context * 1000 + concurrency)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    if not shared:
        return [tokens(context) for _ in range(concurrency)]
    prefix = tokens(context - TAIL)
    return [prefix + tokens(TAIL) for _ in range(concurrency)]


def decode_rate(llm: LLM, prompts: list[list[int]], new: int) -> float:
    """Decode tok/s of the (already cached) `prompts`, `new` tokens each."""
    params = SamplingParams(max_tokens=2 + new, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return len(prompts) * new / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--new", type=int, default=32, help="decoded tokens per sequence")
    parser.add_argument("--kinds", nargs="+", default=["auto", "int8"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shared-prefix", action="store_true")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=None)
    args = parser.parse_args()
    llms: dict[str, LLM] = {}
    prompts: dict[int, list[list[int]]] = {}
    for kind in args.kinds:
        options = {"kv_cache_memory_gb": args.kv_cache_memory_gb} if args.kv_cache_memory_gb else {}
        llm = llms[kind] = LLM(
            args.model,
            kv_cache_dtype=kind,
            max_model_len=args.context + args.new + 16,
            # every concurrency's prompts stay cached: the pool holds this many sequences
            max_num_seqs=sum(args.concurrency),
            speculative_config=SPECULATION_OFF,  # the cache's decode steps, no drafts
            **options,
        )
        vocab = llm.llm_engine.model_runner.vocab_size
        for c in args.concurrency:
            prompts[c] = make_prompts(vocab, args.context, c, args.shared_prefix)
            start = time.perf_counter()
            llm.generate(prompts[c], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
            print(f"{kind:>5} c={c}: prefilled in {time.perf_counter() - start:.1f} s", flush=True)
    best: dict[tuple[str, int], float] = {}
    for round_ in range(args.rounds):
        for kind, llm in llms.items():
            for c in args.concurrency:
                rate = decode_rate(llm, prompts[c], args.new)
                best[kind, c] = max(rate, best.get((kind, c), 0.0))
                print(f"round {round_} {kind:>5} context {args.context} c={c}: {rate:.1f} tok/s")
    for c in args.concurrency:
        base = best["auto", c]
        ratios = ", ".join(f"{k} {best[k, c]:.1f} ({best[k, c] / base:.2f}x)" for k in args.kinds)
        print(f"context {args.context} c={c}, best of {args.rounds}: {ratios}")


if __name__ == "__main__":
    main()
