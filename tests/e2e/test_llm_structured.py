"""Structured outputs in the Python API: `SamplingParams(structured_outputs=...)`.

A batch that mixes constrained and free requests, squeezed so that sequences get preempted,
gives every request exactly the tokens it gets alone: the mask is per row, and a preempted
request's grammar state survives its recompute.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from minivllm import LLM, SamplingParams
from minivllm.sampling_params import StructuredOutputsParams
from minivllm.structured import GrammarError

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "label": {"type": "string", "maxLength": 10},
    },
    "required": ["id", "label"],
    "additionalProperties": False,
}
SPECS = [
    StructuredOutputsParams(json=SCHEMA),
    None,
    StructuredOutputsParams(regex=r"[a-z]{2,6}( [a-z]{2,6}){2}"),
    None,
    StructuredOutputsParams(choice=["alpha", "beta"]),
    StructuredOutputsParams(grammar='root ::= "<" [0-9]+ ">"'),
]
PROMPTS = [
    "The quick brown fox",
    "Hello",
    "Paged attention stores",
    "Once upon a time",
    "A scheduler mixes",
    "0 1 2 3",
]


def _params(i: int, spec: StructuredOutputsParams | None) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=100 + i, max_tokens=48, structured_outputs=spec)


def test_mixed_batch_with_preemption_equals_one_at_a_time(tiny_llama_dir) -> None:
    # 24 blocks of 4 tokens for 6 sequences of up to ~55 tokens each: preemption is certain.
    # fp32: the path whose numerics do not depend on the batch's shape (see the README)
    llm = LLM(
        str(tiny_llama_dir), max_model_len=256, block_size=4, num_kv_blocks=24, dtype="float32"
    )
    params = [_params(i, spec) for i, spec in enumerate(SPECS)]
    together = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for prompt, p, out in zip(PROMPTS, params, together):
        alone = llm.generate([prompt], p, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
    jsonschema.validate(json.loads(together[0].outputs[0].text), SCHEMA)
    assert together[4].outputs[0].text in ("alpha", "beta")
    assert together[4].outputs[0].finish_reason == "stop"


def test_a_bad_spec_is_refused_at_add_and_leaves_nothing_behind(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), max_model_len=256)
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(x"))
    with pytest.raises(GrammarError, match="structured_outputs.regex"):
        llm.generate(["a", "b"], [SamplingParams(), bad], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_chat_with_a_schema_and_greedy_min_tokens(tiny_llama_dir) -> None:
    """min_tokens cannot keep a finished grammar from ending: the grammar wins."""
    llm = LLM(str(tiny_llama_dir), max_model_len=256)
    spec = StructuredOutputsParams(choice=["ok"])
    out = llm.chat(
        [{"role": "user", "content": "hi"}],
        SamplingParams(temperature=0, max_tokens=20, min_tokens=10, structured_outputs=spec),
        use_tqdm=False,
    )[0]
    assert out.outputs[0].text == "ok"
    assert out.outputs[0].finish_reason == "stop"


def test_chat_passes_tools_and_template_kwargs(tiny_llama_dir) -> None:
    """The template sees `tools` and the kwargs (the tiny template ignores tools, so a
    template kwarg is what shows)."""
    llm = LLM(str(tiny_llama_dir), max_model_len=256)
    tokenizer = llm.get_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if tools %}TOOLS{% endif %}{% if flag %}FLAG{% endif %}"
    )
    conv = [{"role": "user", "content": "hi"}]
    text = tokenizer.decode(
        llm.apply_chat_template(
            conv,
            tools=[{"type": "function", "function": {"name": "f"}}],
            chat_template_kwargs={"flag": True},
        )
    )
    assert text.endswith("hiTOOLSFLAG")
