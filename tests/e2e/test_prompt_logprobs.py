"""`SamplingParams.prompt_logprobs`: the log-probability of every prompt token after the first,
against HF's full-sequence forward, whatever the scheduling (chunked prefill, preemption,
batching, LM-head slices, tensor parallelism)."""

from __future__ import annotations

import pytest
from support.hf_reference import hf_prompt_logprobs

from minivllm import LLM, SamplingParams
from minivllm.engine import logits

PROMPTS = [list(range(10, 50)), [5, 17, 42, 99, 3, 5, 5], [7] * 20, [300, 301]]
TOP = 3


def assert_matches_hf(model_dir: str, prompt: list[int], got: list | None) -> None:
    assert got is not None and len(got) == len(prompt) and got[0] is None
    ref = hf_prompt_logprobs(model_dir, tuple(prompt))
    for pos in range(1, len(prompt)):
        entry = got[pos]
        assert entry[prompt[pos]].logprob == pytest.approx(
            ref[pos - 1, prompt[pos]].item(), abs=1e-4
        )
        top = ref[pos - 1].topk(TOP)
        for token, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert entry[token].logprob == pytest.approx(value, abs=1e-4)
        assert len(entry) in (TOP, TOP + 1)  # the top-N, plus the prompt token if outside


SCHEDULES = {
    "default": dict(),
    "chunked-16": dict(max_num_batched_tokens=16),
    "tiny-pool-preempts": dict(block_size=4, num_kv_blocks=20, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen3_dir"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_prompt_logprobs_match_hf(model, schedule, request):
    """Every request of a batch asks for prompt logprobs but one, which gets None; all run
    twice, so the second round would hit the prefix cache: these requests take no hits."""
    model_dir = str(request.getfixturevalue(model))
    llm = LLM(model_dir, dtype="float32", **SCHEDULES[schedule])
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=TOP)
        for _ in PROMPTS
    ]
    params[-1] = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for _ in range(2):
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        for prompt, out in zip(PROMPTS[:-1], outs[:-1], strict=True):
            assert_matches_hf(model_dir, prompt, out.prompt_logprobs)
            assert out.num_cached_prompt_tokens == 0
        assert outs[-1].prompt_logprobs is None
    if schedule == "tiny-pool-preempts":
        assert llm.llm_engine.scheduler.num_preemptions > 0


def test_prompt_logprobs_across_lm_head_slices(tiny_llama_dir, monkeypatch):
    """With 7 rows per LM-head call, one step's samples and prompt rows straddle slices."""
    monkeypatch.setattr(logits, "LOGITS_ROWS", 7)
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    plain = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=TOP)
    prompts = [[11] * 3, *PROMPTS]
    params = [plain] * 3 + [scored] * 2
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts[3:], outs[3:], strict=True):
        assert_matches_hf(str(tiny_llama_dir), prompt, out.prompt_logprobs)
    monkeypatch.setattr(logits, "LOGITS_ROWS", 512)
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]


def test_prompt_logprobs_with_tensor_parallelism(tiny_qwen3_dir):
    with LLM(
        str(tiny_qwen3_dir), tensor_parallel_size=2, max_model_len=128, dtype="float32"
    ) as llm:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=TOP)
        outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS[:2], outs, strict=True):
        assert_matches_hf(str(tiny_qwen3_dir), prompt, out.prompt_logprobs)


def test_prompt_logprobs_must_be_a_count():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=True)
