"""Speculative decoding with n-gram (prompt lookup) drafts on a grounded prompt: the model is
asked to repeat a pasted document, so its answer reuses spans of the prompt.

One engine without speculation, one with `{"method": "ngram", ...}` and, with
`--draft-model`, one with `{"model": DRAFT, ...}`, each warmed up, then the same greedy chat
request timed on each. Prints tok/s of each, the speedup, the draft acceptance rate, the mean
tokens per verification step, whether the outputs are the same tokens as without
speculation, the n-gram proposer's cost per call and the draft model's per step.

    .venv/bin/python benchmarks/spec_decode.py [--model PATH] [--k 4] [--max-tokens 256]
        [--rounds 2] [--dtype auto] [--device cpu] [--draft-model PATH|default]
"""

from __future__ import annotations

import argparse
import json
import time

from minivllm import LLM, SamplingParams
from minivllm.config import SpeculativeConfig
from minivllm.engine.spec_decode import NgramProposer
from minivllm.models.paths import default_model_path

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
    parser.add_argument(
        "--draft-model",
        default=None,
        help="also time a draft model (HF dir or .gguf; 'default': the default model)",
    )
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

    configs: list[tuple[str, dict | None]] = [("no speculation", None), ("ngram", spec)]
    if args.draft_model is not None:
        draft = str(default_model_path()) if args.draft_model == "default" else args.draft_model
        configs.append(("draft model", {"model": draft, "num_speculative_tokens": args.k}))
    results = {}
    draft_cost = None
    for name, config in configs:
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
        results[name] = (best, tokens, delta, config)
        print(f"{name:>15}: {best:7.1f} tok/s ({len(tokens)} tokens, best of {args.rounds})")
        if config is not None and "model" in config:
            draft_cost = delta["spec_decode_draft_seconds"], delta["spec_decode_draft_steps"]
        llm.llm_engine.close()

    base, base_tokens = results["no speculation"][0], results["no speculation"][1]
    for name, (rate, tokens, delta, config) in results.items():
        if config is None:
            continue
        drafts = delta["spec_decode_num_draft_tokens"]
        accepted = delta["spec_decode_num_accepted_tokens"]
        steps = delta["spec_decode_num_drafts"]
        print(f"{name}: speedup {rate / base:.2f}x with {json.dumps(config)}")
        if drafts:
            print(
                f"  acceptance: {accepted / drafts:.1%} of {drafts} draft tokens; "
                f"{(accepted + steps) / steps:.2f} tokens per verification step"
            )
        print(f"  same tokens as without speculation: {tokens == base_tokens}")
        if config.get("model") and steps:
            seconds, runs = draft_cost or (0.0, 0)
            print(
                f"  draft model: {seconds / max(runs, 1) * 1e3:.1f} ms per draft step "
                f"({runs} steps), {seconds / steps * 1e3:.1f} ms of drafting per verification "
                f"step; {seconds:.1f} s of the timed rounds"
            )

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
