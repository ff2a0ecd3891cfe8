"""Model execution end to end: our engine's greedy tokens equal HF transformers' `generate`.

Tiny random Qwen3 and Llama checkpoints (created by the tests) are the models; HF is the
reference. The same tokens must come out whatever the engine does to schedule them: chunked
prefill, prefix caching, preemption under a tiny pool, one request at a time or all at once,
block sizes 4, 16 and 256.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from minivllm.engine.model_runner import slot_mapping_for

PROMPTS = [
    [5, 17, 42, 99, 3],
    [7] * 23,
    list(range(10, 60)),  # longer than a 16-token budget
    [200, 201, 202, 203, 204, 205, 206, 207, 1, 2, 3],
    list(range(10, 40)) + [300, 301],  # shares 30 tokens with the third prompt
    [11],
]
MAX_TOKENS = 12
TOP = 5  # vLLM's rule at an exact tie: each side's token is in the other's top-5


@functools.cache
def hf_reference(model_dir: str) -> list[tuple[list[int], list[list[int]]]]:
    """HF greedy tokens and their top-5 ids at each step, one prompt at a time (no padding)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    for prompt in PROMPTS:
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,
        )
        tokens = out.sequences[0, len(prompt) :].tolist()
        tops = [s[0].topk(TOP).indices.tolist() for s in out.scores]
        results.append((tokens, tops))
    return results


def assert_matches_hf(outputs, reference) -> None:
    """Token-identical, except where an exact tie makes that impossible (vLLM's rule: at the
    first divergence each side's token is in the other's top-5; later tokens then differ)."""
    for out, (hf_tokens, hf_tops) in zip(outputs, reference):
        ours = out.outputs[0].token_ids
        assert len(ours) == len(hf_tokens) == MAX_TOKENS
        for i, (a, b) in enumerate(zip(ours, hf_tokens)):
            if a != b:
                our_top = [t for t, lp in out.outputs[0].logprobs[i].items() if lp.rank <= TOP]
                assert a in hf_tops[i] and b in our_top, (i, ours, hf_tokens)
                break


def greedy(**kw) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP, **kw
    )


@functools.cache
def cached_llm(model_dir: str, **options) -> LLM:
    return LLM(model_dir, dtype="float32", **options)  # the token-exact path HF is held to


SCHEDULES = {
    "default": dict(),
    "chunked-16": dict(max_num_batched_tokens=16),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "tiny-pool-preempts": dict(block_size=4, num_kv_blocks=24),
    "block-4": dict(block_size=4),
    "block-256": dict(block_size=256, num_kv_blocks=8),
}


@pytest.mark.parametrize("arch", ["tiny_llama_dir", "tiny_qwen3_dir", "tiny_llama3_rope_dir"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_greedy_matches_hf_under_every_schedule(request, arch, schedule):
    model_dir = str(request.getfixturevalue(arch))
    llm = cached_llm(model_dir, max_model_len=128, **SCHEDULES[schedule])
    # Twice: the second round finds the first round's prompts in the prefix cache.
    for _ in range(2):
        outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        assert_matches_hf(outputs, hf_reference(model_dir))
    scheduler = llm.llm_engine.scheduler
    if schedule == "tiny-pool-preempts":
        assert scheduler.num_preemptions > 0
    if schedule == "no-prefix-cache":
        assert scheduler.block_manager.prefix_hits == 0
    elif schedule not in ("tiny-pool-preempts", "block-256"):  # 256 > every prompt
        assert scheduler.block_manager.prefix_hits > 0
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_one_request_at_a_time_matches_hf(tiny_qwen3_dir):
    llm = cached_llm(str(tiny_qwen3_dir), max_model_len=128)
    outputs = [llm.generate([p], greedy(), use_tqdm=False)[0] for p in PROMPTS]
    assert_matches_hf(outputs, hf_reference(str(tiny_qwen3_dir)))


def test_slot_mapping_follows_the_seed_formula():
    table, bs = [7, 2, 9], 4
    slots = slot_mapping_for(table, 3, 6, bs)
    assert slots == [table[p // bs] * bs + p % bs for p in range(3, 9)]
    assert slots == [31, 8, 9, 10, 11, 36]


def test_prompt_forms_and_output_order(tiny_llama_dir):
    llm = cached_llm(str(tiny_llama_dir), max_model_len=128)
    tokenizer = llm.get_tokenizer()
    text = "The quick brown fox"
    ids = tokenizer.encode(text)
    outs = llm.generate([text, ids, {"prompt_token_ids": ids}], greedy(), use_tqdm=False)
    assert [o.request_id for o in outs] == ["0", "1", "2"]
    assert outs[0].prompt == text and outs[0].prompt_token_ids == ids
    tokens = [o.outputs[0].token_ids for o in outs]
    assert tokens[0] == tokens[1] == tokens[2]
    assert outs[0].outputs[0].text == tokenizer.decode(
        outs[0].outputs[0].token_ids, skip_special_tokens=True
    )


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_llama_dir):
    llm = cached_llm(str(tiny_llama_dir), max_model_len=128)
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True)
    batch = llm.generate(PROMPTS[:4], [params, noise, noise, noise], use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    other_seed = llm.generate(
        [PROMPTS[0]],
        SamplingParams(temperature=1.0, seed=99, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )
    assert other_seed[0].outputs[0].token_ids != alone


def test_top_k_1_and_tiny_top_p_equal_greedy(tiny_qwen3_dir):
    llm = cached_llm(str(tiny_qwen3_dir), max_model_len=128)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]
    for params in (
        SamplingParams(temperature=0.8, top_k=1, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=1e-6, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.8, min_p=1.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    ):
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert got == want, params


def test_mixed_greedy_and_sampled_in_one_batch(tiny_qwen3_dir):
    llm = cached_llm(str(tiny_qwen3_dir), max_model_len=128)
    want = llm.generate(PROMPTS[:2], greedy(), use_tqdm=False)
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = llm.generate(PROMPTS[:2], [greedy(), sampled], use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_n_samples_and_logprobs(tiny_llama_dir):
    llm = cached_llm(str(tiny_llama_dir), max_model_len=128)
    out = llm.generate(
        [PROMPTS[0]],
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, logprobs=2),
        use_tqdm=False,
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        for token, lp in zip(c.token_ids, c.logprobs):
            assert token in lp and len(lp) in (2, 3) and all(v.logprob <= 0 for v in lp.values())


def test_stop_strings_cut_the_text(tiny_llama_dir):
    llm = cached_llm(str(tiny_llama_dir), max_model_len=128)
    full = llm.generate(
        [PROMPTS[3]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )[0]
    text = full.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    cut = llm.generate(
        [PROMPTS[3]],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0]
    assert cut.outputs[0].text == text[: text.find(stop)]
    assert cut.outputs[0].finish_reason == "stop"


def test_bad_requests_leave_the_engine_serving(tiny_llama_dir):
    llm = cached_llm(str(tiny_llama_dir), max_model_len=128)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2], [10**6]], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        llm.generate([list(range(1, 200))], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], greedy(), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # the good half was not left behind
    assert len(llm.generate([PROMPTS[0]], greedy(), use_tqdm=False)) == 1


def test_unsupported_architecture_and_missing_path_are_clear_errors(tmp_path: Path, tiny_llama_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    broken = tmp_path / "broken"
    broken.mkdir()
    text = (Path(tiny_llama_dir) / "config.json").read_text()
    (broken / "config.json").write_text(text.replace("LlamaForCausalLM", "GPT2LMHeadModel"))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LLM(str(broken))
