"""`LLM.embed` against HF's `AutoModel(...).last_hidden_state`, pooled the same way, in fp32.

Guards: the pooled row being the final normed hidden state (not a layer's or the logits'),
the row offsets of each sequence in a batched step, mean pooling carried across chunked
prefill and across preemption, cls pooling, and a cached prefix never pooled from nothing.
"""

from pathlib import Path

import pytest
import torch
from support.hf_reference import hf_embedding

from minivllm import LLM, PoolingParams, SamplingParams

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Paged attention stores keys",
    "Hello, world!",
    "A scheduler mixes prefill chunks with decode steps in one batch, and",
]
COSINE = 0.999


def make_llm(model_dir: Path, **options) -> LLM:
    options = {
        "max_model_len": 128,
        "num_kv_blocks": 64,
        "block_size": 4,
        "dtype": "float32",
        **options,
    }
    return LLM(str(model_dir), device="cpu", enforce_eager=True, **options)


def check_against_hf(llm: LLM, model_dir: Path, method: str, prompts: list[str]) -> None:
    outs = llm.embed(prompts, use_tqdm=False)
    assert [o.request_id for o in outs] == [str(i) for i in range(len(prompts))]
    for prompt, out in zip(prompts, outs):
        ids = llm.get_tokenizer().encode(prompt)
        assert out.prompt_token_ids == ids
        ours = torch.tensor(out.outputs.embedding)
        assert out.outputs.hidden_size == 64
        assert abs(ours.norm().item() - 1.0) < 1e-5
        cosine = torch.dot(ours, hf_embedding(str(model_dir), ids, method)).item()
        assert cosine >= COSINE, (method, prompt, cosine)


@pytest.mark.parametrize("method", ["last", "mean", "cls"])
def test_embed_matches_hf_batched(tiny_llama_dir: Path, method: str) -> None:
    """Several prompts in one step, each pooled from its own rows, match HF's pooled states."""
    llm = make_llm(tiny_llama_dir, pooling=method)
    check_against_hf(llm, tiny_llama_dir, method, PROMPTS)
    check_against_hf(llm, tiny_llama_dir, method, PROMPTS[1:2])  # alone in its step


@pytest.mark.parametrize("method", ["last", "mean"])
def test_embed_with_chunked_prefill(tiny_llama_dir: Path, method: str) -> None:
    """A token budget of 8 cuts each prompt into chunks over several steps: mean pooling sums
    across them, last pooling takes the final chunk's last row."""
    llm = make_llm(tiny_llama_dir, pooling=method, max_num_batched_tokens=8)
    check_against_hf(llm, tiny_llama_dir, method, PROMPTS)


def test_embed_with_preemption(tiny_llama_dir: Path) -> None:
    """A generation holding growing blocks makes the pool run out while an embedding is
    mid-prefill: the embedding (admitted last) is preempted, its partial mean dropped and
    recomputed from position 0, not added twice."""
    llm = make_llm(tiny_llama_dir, num_kv_blocks=14, max_num_batched_tokens=4)
    engine = llm.llm_engine
    engine.add_request(PROMPTS[1], SamplingParams(max_tokens=40, ignore_eos=True))
    seq = engine.add_request(PROMPTS[0], PoolingParams(method="mean"))
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished and o.embedding is not None]
    assert engine.scheduler.num_preemptions > 0 and seq.num_preemptions > 0
    hf = hf_embedding(str(tiny_llama_dir), seq.prompt_token_ids, "mean")
    assert torch.dot(torch.tensor(finals[0].embedding), hf).item() >= COSINE


def test_embed_after_prefix_is_cached(tiny_llama_dir: Path) -> None:
    """With prefix caching on, a prompt whose prefix a generation cached is still pooled over
    every position (an embedding takes no cached blocks), and a generation after it reuses
    the blocks the embedding filled."""
    llm = make_llm(tiny_llama_dir, pooling="mean", enable_prefix_caching=True)
    llm.generate(PROMPTS[0], use_tqdm=False)
    check_against_hf(llm, tiny_llama_dir, "mean", PROMPTS[:1])
    out = llm.generate(PROMPTS[2], use_tqdm=False)[0]
    assert out.num_cached_prompt_tokens == 0
    check_against_hf(llm, tiny_llama_dir, "mean", PROMPTS[2:])
    again = llm.generate(PROMPTS[2], use_tqdm=False)[0]
    assert again.num_cached_prompt_tokens > 0


def test_embed_options(tiny_llama_dir: Path) -> None:
    """The request's method wins over the engine's; normalize=False gives the raw state;
    token ids are a prompt too; a too-long prompt is a clear error, not a hang."""
    llm = make_llm(tiny_llama_dir)  # no sentence-transformers config: last
    assert llm.llm_engine.config.pooling == "last"
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    raw = llm.embed([ids], PoolingParams(method="mean", normalize=False), use_tqdm=False)[0]
    expected = hf_embedding(str(tiny_llama_dir), ids, "mean", normalize=False)
    torch.testing.assert_close(torch.tensor(raw.outputs.embedding), expected, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed([[5] * 129], use_tqdm=False)
    assert len(llm.embed([[5] * 128], use_tqdm=False)[0].outputs.embedding) == 64
    with pytest.raises(ValueError, match="pooling method"):
        PoolingParams(method="max")


@pytest.mark.slow  # the decode step's compile at start-up: tens of seconds
def test_compiled_decode_step_pools_the_same_rows(tiny_llama_dir: Path) -> None:
    """A one-token prompt runs as a decode-shaped step, which bf16 on the CPU runs through the
    compiled decode step: its rows pool as the eager step's do."""
    compiled = LLM(str(tiny_llama_dir), device="cpu", dtype="bfloat16", max_model_len=64)
    assert compiled.llm_engine.model_runner.compiled_decode is not None
    eager = make_llm(tiny_llama_dir, dtype="bfloat16")
    ours, ref = (
        torch.tensor(llm.embed([[5]], use_tqdm=False)[0].outputs.embedding)
        for llm in (compiled, eager)
    )
    assert torch.dot(ours, ref).item() >= 0.999
