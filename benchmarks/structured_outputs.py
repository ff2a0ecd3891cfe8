"""Throughput with and without a JSON schema: decode tok/s at 1 and 16 concurrent requests.

Offline (`LLM.generate`) on the default model, so the numbers are the engine's, not HTTP's:
the same prompts and sampling with `structured_outputs=None` and with a schema whose output
cannot end early (50 objects at least), every request running to max_tokens.
Runs alternate (free, constrained) `--repeats` times; prints the best of each.

    python benchmarks/structured_outputs.py --concurrency 1 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import time

from minivllm import LLM, SamplingParams
from minivllm.sampling_params import StructuredOutputsParams

# An object whose one string must be long: the output cannot end before max_tokens, so both
# runs generate the same number of tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "notes": {
            "type": "array",
            "minItems": 50,
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "text": {"type": "string"}},
                "required": ["id", "text"],
            },
        }
    },
    "required": ["notes"],
}


def run(llm: LLM, concurrency: int, max_tokens: int, spec: StructuredOutputsParams | None) -> float:
    prompts = [f"Request {i}: list some records as JSON." for i in range(concurrency)]
    params = [
        SamplingParams(
            temperature=0.8, seed=i, max_tokens=max_tokens, ignore_eos=True, structured_outputs=spec
        )
        for i in range(concurrency)
    ]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [len(o.outputs[0].token_ids) for o in outs]
    assert all(n == max_tokens for n in tokens), tokens  # no early end: like for like
    return sum(tokens) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM()
    spec = StructuredOutputsParams(json=SCHEMA)
    run(llm, 2, 8, spec)  # warm-up: the grammar tokenizer, the compiled schema
    for c in args.concurrency:
        free, constrained = [], []
        for _ in range(args.repeats):
            free.append(run(llm, c, args.max_tokens, None))
            constrained.append(run(llm, c, args.max_tokens, spec))
        print(
            f"c={c:2d}: free {max(free):7.1f} tok/s, schema {max(constrained):7.1f} tok/s, "
            f"ratio {max(constrained) / max(free):.2f}"
        )


if __name__ == "__main__":
    main()
