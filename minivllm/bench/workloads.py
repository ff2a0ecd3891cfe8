"""The benchmarks' workloads: seeded random token-id prompts, built in one place.

nano-vllm's throughput benchmark, scaled: random ids (away from the vocabulary's special ends),
uniform lengths. Every benchmark (throughput, prefix, overhead, serve) draws its prompts here,
so that the same seed gives the same prompts whichever benchmark or peer runs them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    """`length` token ids drawn uniformly from `[100, vocab_size - 100)`."""
    return [rng.randrange(100, vocab_size - 100) for _ in range(length)]


@dataclass
class Workload:
    """`num_requests` prompts of `input_len` tokens (uniform in the range), each asking for
    `output_len` tokens (uniform in the range)."""

    num_requests: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    seed: int = 0

    def make(self, vocab_size: int) -> tuple[list[list[int]], list[int]]:
        """`(prompts, output lengths)`, the same for the same fields."""
        rng = random.Random(self.seed)
        prompts = [
            random_prompt(rng, rng.randint(*self.input_len), vocab_size)
            for _ in range(self.num_requests)
        ]
        outputs = [rng.randint(*self.output_len) for _ in range(self.num_requests)]
        return prompts, outputs


def shared_prefix_prompts(
    num_requests: int, prefix_len: int, suffix_len: int, vocab_size: int, seed: int = 0
) -> list[list[int]]:
    """`num_requests` prompts that share their first `prefix_len` tokens, each followed by
    its own `suffix_len` random tokens."""
    rng = random.Random(seed)
    prefix = random_prompt(rng, prefix_len, vocab_size)
    return [prefix + random_prompt(rng, suffix_len, vocab_size) for _ in range(num_requests)]
