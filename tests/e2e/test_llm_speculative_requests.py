"""Speculation for requests with per-token bookkeeping: logprobs (one entry per token, the
accepted drafts' from their own rows) and structured outputs (a mask per verified row, the
drafts cut to what the grammar allows, the grammar fed every accepted token). Greedy output,
logprobs included, is the same as without speculation, and drafts were verified."""

from __future__ import annotations

import functools
import math

from support.spec_checks import NGRAM, OFF

from minivllm import LLM, SamplingParams
from minivllm.sampling_params import StructuredOutputsParams

PROMPTS = [[5, 17, 42, 99, 3] * 4, [200, 201, 202, 203, 1, 2, 3] * 3 + [200, 201], [7] * 9]


@functools.cache
def cached_llm(model_dir: str, speculative: bool) -> LLM:
    return LLM(
        model_dir,
        dtype="float32",
        max_model_len=256,
        block_size=4,
        speculative_config=NGRAM if speculative else OFF,
    )


def both(model_dir: str, prompts: list, params: list[SamplingParams]) -> tuple[list, list, dict]:
    plain = cached_llm(model_dir, False).generate(prompts, params, use_tqdm=False)
    llm = cached_llm(model_dir, True)
    before = llm.llm_engine.stats()
    spec = llm.generate(prompts, params, use_tqdm=False)
    after = llm.llm_engine.stats()
    delta = {k: after[k] - before[k] for k in after if k.startswith("spec_decode")}
    return [o.outputs[0] for o in plain], [o.outputs[0] for o in spec], delta


def test_greedy_logprobs_with_speculation_are_the_same(tiny_llama_dir):
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=n)
        for n in (0, 3, 1)
    ]
    plain, spec, delta = both(str(tiny_llama_dir), PROMPTS, params)
    assert delta["spec_decode_num_accepted_tokens"] > 0
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids
        assert len(s.logprobs) == len(s.token_ids)
        for want, got in zip(p.logprobs, s.logprobs):
            assert got.keys() == want.keys()
            for token, lp in want.items():
                assert got[token].rank == lp.rank
                assert math.isclose(got[token].logprob, lp.logprob, abs_tol=1e-4)
        assert math.isclose(s.cumulative_logprob, p.cumulative_logprob, abs_tol=1e-3)


def test_greedy_structured_outputs_with_speculation_are_the_same(tiny_llama_dir):
    llm = cached_llm(str(tiny_llama_dir), False)
    tokenizer = llm.get_tokenizer()
    texts = [
        "ab ab ab ab ab ab ab ab",
        "alpha beta alpha beta alpha",
        "<12><12><12><12>",
        '{"id": 7, "label": "x"} {"id": 7, "label": "x"}',
    ]
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    specs = [
        StructuredOutputsParams(regex=r"(ab ){2,20}"),
        StructuredOutputsParams(choice=["alpha beta alpha", "beta"]),
        StructuredOutputsParams(grammar='root ::= ("<" [0-9]+ ">")+'),
        StructuredOutputsParams(
            json={
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "label": {"type": "string", "maxLength": 4},
                },
                "required": ["id", "label"],
                "additionalProperties": False,
            }
        ),
    ]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=32, structured_outputs=spec, logprobs=1 if i == 0 else None
        )
        for i, spec in enumerate(specs)
    ]
    plain, spec, delta = both(str(tiny_llama_dir), prompts, params)
    assert delta["spec_decode_num_drafts"] > 0
    for p, s in zip(plain, spec):
        assert (s.token_ids, s.text, s.finish_reason) == (p.token_ids, p.text, p.finish_reason)
    assert spec[1].text in ("alpha beta alpha", "beta")
