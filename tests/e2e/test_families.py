"""Each newer family end to end: the engine's greedy tokens equal HF `generate` in fp32.

Tiny random Qwen2, Mistral, Gemma 2, Gemma 3 and Phi-3 checkpoints (`tiny_family_dirs`) with a
sliding window of 8 tokens, while most prompts here are longer (up to 50 tokens plus 12
generated): the window must hold across chunked prefill (16-token budget), prefix-cache hits
(the second round), and recompute after preemption (a 24-block pool of 4-token blocks).
"""

from __future__ import annotations

import functools

import pytest
import torch
from support.model_fixtures import FAMILIES, TINY_WINDOW
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams

PROMPTS = [
    [5, 17, 42, 99, 3],
    [7] * 23,
    list(range(10, 60)),
    [200, 201, 202, 203, 204, 205, 206, 207, 1, 2, 3],
    list(range(10, 40)) + [300, 301],  # shares 30 tokens with the third prompt
]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SCHEDULES = {
    "chunked-16": dict(max_num_batched_tokens=16),
    "tiny-pool-preempts": dict(block_size=4, num_kv_blocks=24),
}


@functools.cache
def hf_greedy(model_dir: str) -> list[list[int]]:
    """HF's greedy tokens for each prompt, one prompt at a time (no padding)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        with torch.inference_mode():
            tokens = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
        out.append(tokens[0, len(prompt) :].tolist())
    return out


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf(tiny_family_dirs, family: str, schedule: str) -> None:
    assert max(len(p) for p in PROMPTS) > TINY_WINDOW
    model_dir = str(tiny_family_dirs[family])
    llm = LLM(model_dir, dtype="float32", max_model_len=128, **SCHEDULES[schedule])
    want = hf_greedy(model_dir)
    for _ in range(2):  # the second round finds the first one's prompts in the prefix cache
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == want
    scheduler = llm.llm_engine.scheduler
    if schedule == "tiny-pool-preempts":
        assert scheduler.num_preemptions > 0
    else:
        assert scheduler.block_manager.prefix_hits > 0
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
