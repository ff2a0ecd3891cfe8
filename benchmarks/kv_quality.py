"""`bench quality`'s measure for each `--kv-cache-dtype`, against one HF fp32 reference.

`minivllm bench quality --kv-cache-dtype int8` reports the same fields one dtype at a time;
this runs the HF reference once and scores the text with each cache, one token a step (decode
steps: the paged kernel over the quantized cache) and in chunks of 64 (chunked prefill: SDPA
over the dequantized context). A first prefill attends over its fresh K/V, so it is not run.

    python benchmarks/kv_quality.py --kinds auto int8 fp8
"""

from __future__ import annotations

import argparse

from minivllm import LLM
from minivllm.bench.common import hf_model_dir
from minivllm.bench.quality import QUALITY_TEXT, compare, engine_scores, hf_reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--kinds", nargs="+", default=["auto", "int8", "fp8"])
    parser.add_argument("--max-tokens", type=int, default=None, help="score the first N tokens")
    args = parser.parse_args()
    reference = None
    for kind in args.kinds:
        llm = LLM(args.model, kv_cache_dtype=kind)
        ids = llm.llm_engine.tokenizer.encode(QUALITY_TEXT)[: args.max_tokens]
        if reference is None:
            with hf_model_dir(llm.llm_engine.model_runner) as model_dir:
                reference = hf_reference(model_dir, ids)
        for chunk in (1, 64):
            r = compare(*engine_scores(llm, ids, chunk), *reference)
            print(
                f"{kind:>5} chunk {chunk:>2}: {len(ids)} tokens, perplexity {r['perplexity']:.4f} "
                f"(HF fp32 {r['hf_perplexity']:.4f}, {r['perplexity_delta_pct']:+.2f}%), "
                f"top-1 agreement {r['top1_agreement_pct']:.1f}%",
                flush=True,
            )


if __name__ == "__main__":
    main()
