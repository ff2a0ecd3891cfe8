"""Checks shared by the speculative-decoding tests on real (tiny) models: the distribution of
sampled tokens with and without speculation."""

from __future__ import annotations

from collections import Counter

from minivllm import LLM, SamplingParams
from minivllm.config import SPECULATION_OFF

# n-gram speculation with the cost model off (tests/engine/test_spec_policy.py covers it):
# every match proposes, at any batch size, so a test verifies drafts wherever the proposer
# finds them.
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "disable_by_batch_size": None,
    "draft_token_cost": 0.0,
}
# The off switch: unset, an engine on the CPU speculates where its start-up measurement says
# drafts pay, so the baselines "without speculation" say so.
OFF = SPECULATION_OFF


def second_tokens(llm: LLM, prompt: list[int], n: int) -> Counter:
    """How often each (first, second) token pair comes out; a third token leaves room for a
    draft of the second."""
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # the others then hit the prefix cache
    outputs = llm.generate([prompt] * n, params, use_tqdm=False)
    return Counter(tuple(o.outputs[0].token_ids[:2]) for o in outputs)


def total_variation(a: Counter, b: Counter) -> float:
    na, nb = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a[k] / na - b[k] / nb) for k in set(a) | set(b))
