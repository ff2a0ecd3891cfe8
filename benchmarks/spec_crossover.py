"""Where speculation stops paying: decode throughput with and without n-gram drafts at several
batch sizes, on a grounded prompt (the answer repeats a pasted document, so drafts are mostly
accepted: the best case, hence an upper bound on the batch size where speculation pays).

Each engine is built once; for each batch size B, B copies of the request are prefilled (the
copies share the prompt through the prefix cache), then the decode steps are timed alone.
Speculation runs with the cost model off (`disable_by_batch_size: null, draft_token_cost: 0`),
so every sequence with a match proposes. Prints, per B, both decode rates and their ratio, and
the cost model's figure from the smallest B: with d drafts per verifying step, a verifying step
takes r = (1 + c * (1 + d)) / (1 + c) times a plain one, c = `draft_token_cost` (assuming the
acceptance of all B for the smallest).

    .venv/bin/python benchmarks/spec_crossover.py [--batch-sizes 1 4 16] [--max-tokens 48]
        [--k 4] [--model PATH] [--dtype auto]
"""

from __future__ import annotations

import argparse
import time

from minivllm import LLM, SamplingParams
from minivllm.engine.llm_engine import LLMEngine

DOCUMENT = """\
The KV cache is split into fixed-size blocks. Each request owns a block table: the list of
physical blocks that hold its keys and values, in order. The scheduler decides, every step,
which requests run and how many tokens each of them brings; the block manager gives each
request the blocks its plan needs, and takes them back when the request finishes or is
preempted."""


def decode_rate(engine: LLMEngine, prompt: list[int], batch: int, max_tokens: int) -> float:
    """Completion tokens per second of `batch` copies of `prompt`, decode steps only."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seqs = [engine.add_request(list(prompt), params) for _ in range(batch)]
    while any(s.num_completion_tokens == 0 for s in seqs):  # the prefills
        engine.step()
    start_tokens = sum(s.num_completion_tokens for s in seqs)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    seconds = time.perf_counter() - start
    return (sum(s.num_completion_tokens for s in seqs) - start_tokens) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "disable_by_batch_size": None,
        "draft_token_cost": 0.0,
    }
    messages = [
        {
            "role": "user",
            "content": "Repeat the following text exactly, word for "
            f"word, and nothing else.\n\n{DOCUMENT}",
        }
    ]
    rates: dict[str, dict[int, float]] = {}
    drafts_per_step = accepted = steps = 0.0
    for name, config in [("plain", None), ("ngram", spec)]:
        llm = LLM(
            args.model,
            dtype=args.dtype,
            speculative_config=config,
            max_num_seqs=max(args.batch_sizes),
        )
        engine = llm.llm_engine
        prompt = llm.apply_chat_template(messages)
        decode_rate(engine, prompt, 1, 8)  # warm-up
        before = engine.stats()
        rates[name] = {b: decode_rate(engine, prompt, b, args.max_tokens) for b in args.batch_sizes}
        after = engine.stats()
        if config is not None:
            drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
            accepted = (
                after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
            )
            steps = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
            drafts_per_step = drafted / max(steps, 1)
            print(
                f"acceptance: {accepted / max(drafted, 1):.1%} of {drafted:.0f} draft tokens, "
                f"{drafts_per_step:.2f} drafts and {1 + accepted / max(steps, 1):.2f} tokens "
                "per verifying step"
            )
        engine.close()
    for b in args.batch_sizes:
        plain, ngram = rates["plain"][b], rates["ngram"][b]
        print(
            f"B={b:>3}: plain {plain:7.1f} tok/s, ngram {ngram:7.1f} tok/s, "
            f"ratio {ngram / plain:.2f}"
        )
    # The cost model's figure, from the smallest B: a plain step yields B tokens, a verifying
    # one B * (1 + a * d); their step times' ratio r = (1 + c * (1 + d)) / (1 + c) gives c.
    b = min(args.batch_sizes)
    tokens = 1 + accepted / max(steps, 1) if steps else 1.0
    r = tokens * rates["plain"][b] / rates["ngram"][b]  # verifying step / plain step, in time
    if drafts_per_step and 1 + drafts_per_step > r:
        print(
            f"B={b}: a verifying step takes {r:.2f}x a plain one for {drafts_per_step:.2f} "
            f"drafts: draft_token_cost c = {(r - 1) / (1 + drafts_per_step - r):.3f}"
        )


if __name__ == "__main__":
    main()
