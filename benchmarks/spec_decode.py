"""Speculative decoding with n-gram (prompt lookup) drafts on a grounded prompt: the model is
asked to repeat a pasted document, so its answer reuses spans of the prompt.

One engine without speculation and one with `{"method": "ngram", ...}`, each warmed up, then
the same greedy chat request timed on both. Prints tok/s of each, the speedup, the draft
acceptance rate, the mean tokens per verification step, whether the two outputs are the same
tokens, and the proposer's own cost per call.

    .venv/bin/python benchmarks/spec_decode.py [--model PATH] [--k 4] [--max-tokens 256]
        [--rounds 2] [--dtype auto] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import time

from minivllm import LLM, SamplingParams
from minivllm.config import SpeculativeConfig
from minivllm.engine.spec_decode import NgramProposer

DOCUMENT = """\
The KV cache is split into fixed-size blocks. Each request owns a block table: the list of
physical blocks that hold its keys and values, in order. The scheduler decides, every step,
which requests run and how many tokens each of them brings; the block manager gives each
request the blocks its plan needs, and takes them back when the request finishes or is
preempted. A block whose tokens are all committed gets a hash of its content and of the blocks
before it, so a later request with the same prefix reuses it instead of computing it again.
Scheduled is not cached: the plan says what the model will compute, and only after the model
has run does the request's cached count grow."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
    }
    messages = [
        {
            "role": "user",
            "content": "Repeat the following text exactly, word for "
            f"word, and nothing else.\n\n{DOCUMENT}",
        }
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    results = {}
    for name, config in [("no speculation", None), ("ngram", spec)]:
        llm = LLM(args.model, dtype=args.dtype, device=args.device, speculative_config=config)
        llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
        before = llm.llm_engine.stats()
        best, tokens = 0.0, []
        for _ in range(args.rounds):
            start = time.perf_counter()
            out = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
            elapsed = time.perf_counter() - start
            tokens = out.token_ids
            best = max(best, len(tokens) / elapsed)
        after = llm.llm_engine.stats()
        delta = {k: after[k] - before[k] for k in after if k.startswith("spec_decode")}
        results[name] = (best, tokens, delta)
        print(f"{name:>15}: {best:7.1f} tok/s ({len(tokens)} tokens, best of {args.rounds})")
        llm.llm_engine.close()

    base, spec_rate = results["no speculation"][0], results["ngram"][0]
    _, tokens, delta = results["ngram"]
    drafts = delta["spec_decode_num_draft_tokens"]
    accepted = delta["spec_decode_num_accepted_tokens"]
    steps = delta["spec_decode_num_drafts"]
    print(f"speedup: {spec_rate / base:.2f}x with {json.dumps(spec)}")
    if drafts:
        print(
            f"acceptance: {accepted / drafts:.1%} of {drafts} draft tokens; "
            f"{(accepted + steps) / steps:.2f} tokens per verification step"
        )
    print(f"same tokens as without speculation: {tokens == results['no speculation'][1]}")

    proposer = NgramProposer(SpeculativeConfig(**spec))
    context = list(range(400)) + tokens  # a long context the lookup must scan
    start = time.perf_counter()
    calls = 1000
    for _ in range(calls):
        proposer.propose(context, args.k)
    per_call = (time.perf_counter() - start) / calls
    print(f"proposer: {per_call * 1e6:.0f} us per call on a {len(context)}-token context")


if __name__ == "__main__":
    main()
