"""Per-token cost of a grammar engine's token mask, xgrammar against llguidance.

For each engine and batch size: compile a JSON schema once, then decode `--steps` tokens for
`--batch` requests at once: fill every row's bitmask (one batched call), apply it to
[batch, vocab] logits with the engine's own `apply_token_bitmask` (both libraries use the same
bitmask layout), pick a random allowed token per row and advance the matcher. Prints the
median milliseconds per step of mask fill, apply and advance, and the compile time.

    python benchmarks/grammar_mask.py --batch 1 16 --steps 64
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from minivllm.layers.sampler import apply_token_bitmask
from minivllm.models.paths import resolve_model_dir
from minivllm.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
        "kind": {"enum": ["a", "b", "c"]},
    },
    "required": ["name", "age", "tags", "address", "kind"],
}


def pick(logits_row: torch.Tensor, rng: random.Random) -> int:
    allowed = torch.nonzero(logits_row > -1e30).flatten()
    return int(allowed[rng.randrange(len(allowed))])


def bench_xgrammar(tokenizer, vocab: int, batch: int, steps: int) -> dict[str, float]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t0
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    batcher = xgr.BatchGrammarMatcher(max_threads=2)
    bitmask = xgr.allocate_token_bitmask(batch, vocab)

    def fill() -> None:
        batcher.batch_fill_next_token_bitmask(matchers, bitmask)

    def advance(tokens: list[int]) -> None:
        for m, t in zip(matchers, tokens):
            if not m.is_terminated():
                m.accept_token(t)

    def apply(logits: torch.Tensor) -> torch.Tensor:
        return apply_token_bitmask(logits, bitmask)

    return _run(fill, apply, advance, batch, vocab, steps, compile_s)


def bench_llguidance(tokenizer, vocab: int, batch: int, steps: int) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
    compile_s = time.perf_counter() - t0
    executor = llguidance.LLExecutor(num_threads=2)
    bitmask = lt.allocate_token_bitmask(batch, vocab)

    def fill() -> None:
        lt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def advance(tokens: list[int]) -> None:
        for m, t in zip(matchers, tokens):
            if not m.is_stopped():
                m.consume_token(t)

    def apply(logits: torch.Tensor) -> torch.Tensor:
        return apply_token_bitmask(logits, bitmask)

    return _run(fill, apply, advance, batch, vocab, steps, compile_s)


def _run(fill, apply, advance, batch, vocab, steps, compile_s) -> dict[str, float]:
    rng = random.Random(0)
    times: dict[str, list[float]] = {"fill": [], "apply": [], "advance": []}
    for _ in range(steps):
        logits = torch.randn(batch, vocab)
        t0 = time.perf_counter()
        fill()
        t1 = time.perf_counter()
        logits = apply(logits)
        t2 = time.perf_counter()
        tokens = [pick(logits[i], rng) for i in range(batch)]
        t3 = time.perf_counter()
        advance(tokens)
        t4 = time.perf_counter()
        times["fill"].append(t1 - t0)
        times["apply"].append(t2 - t1)
        times["advance"].append(t4 - t3)
    # The median step: on a shared machine the mean is the neighbours' load as much as ours.
    result = {k: 1000 * statistics.median(v) for k, v in times.items()}
    result["compile_ms"] = 1000 * compile_s
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch's intra-op threads (1: steadier on a loaded machine)",
    )
    args = parser.parse_args()
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    tokenizer = load_tokenizer(resolve_model_dir(None))
    vocab = len(tokenizer)
    print(f"vocab {vocab}, {args.steps} steps, ms per step (median)")
    for batch in args.batch:
        for name, bench in [("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)]:
            r = bench(tokenizer, vocab, batch, args.steps)
            print(
                f"{name:10s} batch {batch:2d}: fill {r['fill']:.3f}  apply {r['apply']:.3f}  "
                f"advance {r['advance']:.3f}  compile {r['compile_ms']:.1f} ms"
            )


if __name__ == "__main__":
    main()
