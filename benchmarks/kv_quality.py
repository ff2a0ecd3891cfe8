"""`bench quality`'s measure for each `--kv-cache-dtype`, against one reference.

`minivllm bench quality --kv-cache-dtype int8` reports the same fields one dtype at a time;
this scores the text with each cache, one token a step (decode steps: the paged kernel over
the quantized cache) and in chunks of 64 (chunked prefill: SDPA over the dequantized
context). A first prefill attends over its fresh K/V, so it is not run.

The reference is HF fp32 (`--reference hf`, run once), or the engine itself with the
unquantized cache (`--reference auto`): the same weights and kernels, so the difference is
the quantized cache's alone, and no HF copy of a large model is needed.

    python benchmarks/kv_quality.py --kinds auto int8 fp8
    python benchmarks/kv_quality.py --model /path/to/1.5b.gguf --reference auto --kinds int8
    python benchmarks/kv_quality.py --model /path/to/1.5b.gguf --reference auto --dtype float32
"""

from __future__ import annotations

import argparse
import gc

from minivllm import LLM
from minivllm.bench.common import hf_model_dir
from minivllm.bench.quality import QUALITY_TEXT, compare, engine_scores, hf_reference

CHUNKS = (1, 64)


def references(args: argparse.Namespace) -> tuple[str, dict[int, tuple[list[float], list[int]]]]:
    """The reference's name and its (log-probs, top-1) for each chunk size."""
    llm = LLM(args.model, kv_cache_dtype="auto", dtype=args.dtype)
    ids = llm.llm_engine.tokenizer.encode(QUALITY_TEXT)[: args.max_tokens]
    if args.reference == "hf":
        with hf_model_dir(llm.llm_engine.model_runner) as model_dir:
            scores = hf_reference(model_dir, ids)
        return "HF fp32", dict.fromkeys(CHUNKS, scores)
    return "auto KV", {chunk: engine_scores(llm, ids, chunk) for chunk in CHUNKS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--kinds", nargs="+", default=["auto", "int8", "fp8"])
    parser.add_argument("--max-tokens", type=int, default=None, help="score the first N tokens")
    parser.add_argument("--reference", choices=["hf", "auto"], default="hf")
    # float32 isolates the cache's rounding: in bf16 a model's top-1 against itself already
    # moves with any change of one bf16 step in K/V (docs/memory.md)
    parser.add_argument("--dtype", default="auto", help="the model's compute dtype")
    args = parser.parse_args()
    ref_name, reference = references(args)
    gc.collect()  # the reference's engine, before the next one loads
    for kind in args.kinds:
        llm = LLM(args.model, kv_cache_dtype=kind, dtype=args.dtype)
        ids = llm.llm_engine.tokenizer.encode(QUALITY_TEXT)[: args.max_tokens]
        for chunk in CHUNKS:
            r = compare(*engine_scores(llm, ids, chunk), *reference[chunk])
            print(
                f"{kind:>5} chunk {chunk:>2}: {len(ids)} tokens, perplexity {r['perplexity']:.4f} "
                f"({ref_name} {r['hf_perplexity']:.4f}, {r['perplexity_delta_pct']:+.2f}%), "
                f"top-1 agreement {r['top1_agreement_pct']:.1f}%",
                flush=True,
            )
        del llm
        gc.collect()


if __name__ == "__main__":
    main()
