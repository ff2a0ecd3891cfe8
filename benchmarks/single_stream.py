"""One sequence's decode rate through the public API: what a single user waits for per token.

`LLM.generate` of one random 64-token prompt, timed for 1 and for 257 new tokens; the
difference over 256 is the milliseconds per decoded token, engine loop included (scheduling,
the compiled step, the LM head, sampling, detokenizing), unlike `decode_profile.py`, which
times engine steps. Prints one figure per round.

    .venv/bin/python benchmarks/single_stream.py [--rounds 3] [--dtype auto]
"""

from __future__ import annotations

import argparse
import random
import time

from minivllm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    llm = LLM(None, dtype=args.dtype)
    rng = random.Random(0)
    prompt = {"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(64)]}

    def generate(tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(
            [prompt],
            SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.6),
            use_tqdm=False,
        )
        return time.perf_counter() - start

    generate(8)  # warm-up
    for _ in range(args.rounds):
        one, many = generate(1), generate(257)
        print(f"one sequence: {(many - one) / 256 * 1e3:.2f} ms per decoded token")


if __name__ == "__main__":
    main()
