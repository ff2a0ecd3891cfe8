"""JSON schemas' objects are closed unless they say otherwise (vLLM's default, OpenAI's
strict mode): a tool whose parameters are `{name, age}` must not let a small model add
`"description"`, `"inputs"`... until max_tokens, which llguidance alone (the JSON Schema
spec) would allow."""

from __future__ import annotations

import copy

import pytest
import torch
from support.model_fixtures import TINY_VOCAB_SIZE, build_tokenizer

from minivllm.layers.sampler import allowed_tokens
from minivllm.sampling_params import SamplingParams, StructuredOutputsParams
from minivllm.structured import StructuredOutputs
from minivllm.structured.grammar import close_objects

EOS = 1  # the tiny tokenizer's </s>
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name"],
}


def test_close_objects_closes_nested_objects_and_keeps_stated_ones() -> None:
    schema = {
        "type": "object",
        "properties": {
            "person": PERSON,
            "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {}}}},
            "extra": {"type": "object", "additionalProperties": True},
            "typed": {"type": "object", "additionalProperties": {"type": "integer"}},
            "either": {"anyOf": [{"$ref": "#/$defs/Point"}, {"type": "null"}]},
        },
        "$defs": {"Point": {"properties": {"x": {"type": "number"}}}},
    }
    original = copy.deepcopy(schema)
    closed = close_objects(schema)
    assert schema == original, "the caller's schema was changed"
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["person"]["additionalProperties"] is False
    assert props["tags"]["items"]["additionalProperties"] is False
    assert props["extra"]["additionalProperties"] is True
    assert props["typed"]["additionalProperties"] == {"type": "integer"}
    assert "additionalProperties" not in props["either"]
    assert "additionalProperties" not in props["either"]["anyOf"][0]  # a $ref is left alone
    assert closed["$defs"]["Point"]["additionalProperties"] is False


def test_close_objects_leaves_composed_objects_open() -> None:
    """allOf members each hold part of the properties, and an object completed by a sibling
    anyOf holds only part: closing any of them would reject what the schema means."""
    schema = {
        "type": "object",
        "properties": {"kind": {"type": "string"}},
        "anyOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}],
        "allOf": [{"properties": {"c": {}}}],
    }
    closed = close_objects(schema)
    assert "additionalProperties" not in closed
    assert all("additionalProperties" not in s for s in closed["anyOf"] + closed["allOf"])


@pytest.fixture(scope="module")
def structured() -> StructuredOutputs:
    tokenizer = build_tokenizer()
    return StructuredOutputs(tokenizer, TINY_VOCAB_SIZE, (EOS,))


def _accepts(structured: StructuredOutputs, schema: dict, text: str) -> bool:
    """Whether the mask lets `text`, token by token, through to its end."""
    spec = StructuredOutputsParams(json=schema)
    matcher = structured.matcher_for(SamplingParams(structured_outputs=spec))
    for token in structured.tokenizer.encode(text, add_special_tokens=False):
        allowed = allowed_tokens(torch.from_numpy(structured.bitmask([matcher])), TINY_VOCAB_SIZE)[
            0
        ]
        if not allowed[token]:
            return False
        matcher.accept(token)
    final = allowed_tokens(torch.from_numpy(structured.bitmask([matcher])), TINY_VOCAB_SIZE)[0]
    return bool(final[EOS])


def test_the_mask_refuses_undeclared_properties_unless_the_schema_allows_them(
    structured: StructuredOutputs,
) -> None:
    assert _accepts(structured, PERSON, '{"name":"Al","age":3}')
    assert not _accepts(structured, PERSON, '{"name":"Al","description":"x"}')
    assert _accepts(
        structured, {**PERSON, "additionalProperties": True}, '{"name":"Al","description":"x"}'
    )
