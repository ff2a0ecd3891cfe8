"""vLLM's `Logprob` objects in the Python API: each entry's `.logprob`, its `.rank` in the full
vocabulary (checked against a brute-force ranking of HF's fp32 distribution) and its
`.decoded_token`, for generated tokens (greedy and sampled) and for prompt tokens."""

from __future__ import annotations

import functools

import pytest
import torch
from support.hf_reference import hf_model, hf_prompt_logprobs

from minivllm import LLM, Logprob, SamplingParams
from minivllm.logprobs import logprob_entry

PROMPTS = [[5, 17, 42, 99, 3, 5, 5], list(range(10, 40))]
TOP = 3
TOL = 1e-4  # fp32 engine vs fp32 HF: ranks are compared up to ties within this


@functools.cache
def cached_llm(model_dir: str) -> LLM:
    return LLM(model_dir, dtype="float32", max_model_len=128)


def hf_completion_logprobs(model_dir: str, prompt: list[int], completion: list[int]):
    """[len(completion), V]: HF's log-softmax at the positions that chose each completion
    token (one forward over prompt + completion)."""
    with torch.inference_mode():
        logits = hf_model(model_dir)(torch.tensor([prompt + completion])).logits[0]
    return logits[len(prompt) - 1 : -1].float().log_softmax(-1)


def assert_entry_matches(
    entry: dict[int, Logprob], token: int, ref: torch.Tensor, num_top: int, tokenizer
) -> None:
    """One entry against one row of the reference distribution: the top-N most likely first
    with ranks 1..N, `token` present with its full-vocabulary rank, every text decoded."""
    assert token in entry
    tops = list(entry.items())[:num_top]
    assert [lp.rank for _, lp in tops] == list(range(1, num_top + 1))
    want_top = ref.topk(num_top).values.tolist()
    assert [lp.logprob for _, lp in tops] == pytest.approx(want_top, abs=TOL)
    for t, lp in entry.items():
        assert lp.logprob == pytest.approx(ref[t].item(), abs=TOL)
        assert lp.decoded_token == tokenizer.decode([t])
    own = entry[token]
    value = ref[token].item()
    # Brute force over the whole vocabulary: vLLM's count of logprobs >= the token's own.
    lowest, highest = int((ref > value + TOL).sum()) + 1, int((ref >= value - TOL).sum())
    assert lowest <= own.rank <= highest, (token, own.rank, lowest, highest)


@pytest.mark.parametrize("temperature", [0.0, 2.0])
def test_completion_logprobs_ranks_and_texts_match_hf(tiny_llama_dir, temperature):
    """Greedy tokens rank 1; sampled ones (hot, so some fall outside the top-N) carry their
    own rank; the top-N rank 1..N; cumulative_logprob sums the chosen tokens'."""
    model_dir = str(tiny_llama_dir)
    llm = cached_llm(model_dir)
    params = SamplingParams(
        temperature=temperature, seed=3, max_tokens=12, ignore_eos=True, logprobs=TOP
    )
    outside_top = 0
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False), strict=True):
        completion = out.outputs[0]
        ref = hf_completion_logprobs(model_dir, prompt, completion.token_ids)
        assert len(completion.logprobs) == len(completion.token_ids)
        for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert_entry_matches(entry, token, ref[i], TOP, llm.get_tokenizer())
            if temperature == 0.0:
                assert entry[token].rank == 1
            outside_top += entry[token].rank > TOP
        chosen = [e[t].logprob for e, t in zip(completion.logprobs, completion.token_ids)]
        assert completion.cumulative_logprob == pytest.approx(sum(chosen))
    if temperature > 0:
        assert outside_top > 0, "no sampled token fell outside the top-N: the test is too cold"


def test_prompt_logprobs_ranks_and_texts_match_hf(tiny_llama_dir):
    """Prompt tokens are arbitrary ids, so most rank deep in the vocabulary."""
    model_dir = str(tiny_llama_dir)
    llm = cached_llm(model_dir)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False), strict=True):
        ref = hf_prompt_logprobs(model_dir, tuple(prompt))
        assert out.prompt_logprobs[0] is None
        for pos in range(1, len(prompt)):
            entry = out.prompt_logprobs[pos]
            assert_entry_matches(entry, prompt[pos], ref[pos - 1], TOP, llm.get_tokenizer())
        assert max(e[t].rank for e, t in zip(out.prompt_logprobs[1:], prompt[1:])) > TOP


def test_logprobs_zero_gives_the_chosen_token_alone(tiny_llama_dir):
    llm = cached_llm(str(tiny_llama_dir))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    completion = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert list(entry) == [token] and entry[token].rank == 1


def test_logprob_entry_keeps_the_top_n_first_and_adds_the_token():
    entry = logprob_entry(7, -5.0, 40, [1, 2], [-0.1, -0.2])
    assert entry == {1: Logprob(-0.1, 1), 2: Logprob(-0.2, 2), 7: Logprob(-5.0, 40)}
    # A token among the top-N keeps its top-N rank (vLLM: the top-N entry wins).
    assert logprob_entry(2, -0.2, 2, [1, 2], [-0.1, -0.2]) == {
        1: Logprob(-0.1, 1),
        2: Logprob(-0.2, 2),
    }


def test_logprob_is_importable_as_in_vllm():
    from minivllm.logprobs import Logprob as FromModule

    assert FromModule is Logprob
    assert Logprob(-1.0) == Logprob(logprob=-1.0, rank=None, decoded_token=None)
