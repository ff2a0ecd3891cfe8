"""Structured outputs through the server: `response_format`, vLLM's `structured_outputs` (and
`guided_*`), on completions and chat, streamed or not, with the openai SDK's `.parse()`.

The tiny random checkpoint babbles, so an output that parses and validates at temperature 1
does so because of the mask, not the model. Bad specs and double constraints are 400s that
name the field; unknown fields are 400s, informational ones are accepted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from minivllm.engine.llm_engine import LLMEngine
from minivllm.server import ServerThread, create_app

SEEDS = range(6)
SCHEMAS = [
    {  # nested objects, an enum, a bounded array, integer and number ranges
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 6},
                "minItems": 1,
                "maxItems": 3,
            },
            "address": {
                "type": "object",
                "properties": {
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    "main": {"type": "boolean"},
                },
                "required": ["zip", "main"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "role", "tags", "address"],
        "additionalProperties": False,
    },
    {  # an array of objects, numbers with ranges
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -5, "maximum": 5},
                "ok": {"type": "boolean"},
            },
            "required": ["x", "ok"],
            "additionalProperties": False,
        },
        "minItems": 2,
        "maxItems": 4,
    },
]


class Person(BaseModel):
    name: str = Field(max_length=10)
    kind: Literal["cat", "dog"]
    legs: int = Field(ge=0, le=8)


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[tuple[str, openai.OpenAI]]:
    engine = LLMEngine.from_options(
        model=str(tiny_llama_dir), max_model_len=512, num_kv_blocks=256, device="cpu"
    )
    app = create_app(engine, "tiny")
    with ServerThread(app) as thread:
        client = openai.OpenAI(base_url=f"{thread.base_url}/v1", api_key="x", max_retries=0)
        yield thread.base_url, client
        client.close()


def _complete(client: openai.OpenAI, seed: int, **extra) -> openai.types.Completion:
    return client.completions.create(
        model="tiny",
        prompt="Hello",
        max_tokens=250,
        temperature=1.0,
        seed=seed,
        extra_body=extra,
    )


@pytest.mark.parametrize("schema", SCHEMAS, ids=["object", "array"])
def test_json_schema_outputs_validate_at_temperature_1(server, schema) -> None:
    """Every seed's output parses and validates, and ends where the JSON ends."""
    _, client = server
    for seed in SEEDS:
        out = _complete(client, seed, structured_outputs={"json": schema}).choices[0]
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), schema)


def test_response_format_json_schema_and_json_object_in_chat(server) -> None:
    _, client = server
    messages = [{"role": "user", "content": "Give me JSON"}]
    for seed in SEEDS:
        r = client.chat.completions.create(
            model="tiny",
            messages=messages,
            temperature=1.0,
            seed=seed,
            max_tokens=250,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": SCHEMAS[1], "strict": True},
            },
        )
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[1])
    r = client.chat.completions.create(
        model="tiny",
        messages=messages,
        temperature=0,
        max_tokens=5,
        response_format={"type": "json_object"},
    )
    assert r.choices[0].message.content.startswith("{")


def test_sdk_parse_with_a_pydantic_model(server) -> None:
    """The openai SDK's `chat.completions.parse` gets an instance of the model back."""
    _, client = server
    for seed in SEEDS:
        r = client.chat.completions.parse(
            model="tiny",
            messages=[{"role": "user", "content": "A pet?"}],
            temperature=1.0,
            seed=seed,
            max_tokens=200,
            response_format=Person,
        )
        assert isinstance(r.choices[0].message.parsed, Person)


def test_regex_choice_and_grammar_are_exact(server) -> None:
    _, client = server
    for seed in SEEDS:
        text = _complete(client, seed, structured_outputs={"regex": r"[0-9]{3}-[a-z]{2}"})
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text.choices[0].text)
        text = _complete(client, seed, guided_choice=["red", "green", "blue"])
        assert text.choices[0].text in {"red", "green", "blue"}
        grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "x" [0-9]'
        text = _complete(client, seed, structured_outputs={"grammar": grammar})
        assert re.fullmatch(r"\((?:[a-c]|x[0-9])(?:,(?:[a-c]|x[0-9]))*\)", text.choices[0].text)


def test_streamed_constrained_output_is_the_same_text(server) -> None:
    _, client = server
    kw = dict(
        model="tiny",
        prompt="Hi",
        max_tokens=250,
        temperature=1.0,
        seed=3,
        extra_body={"structured_outputs": {"json": SCHEMAS[0]}},
    )
    whole = client.completions.create(**kw).choices[0].text
    parts = [c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(parts) == whole
    jsonschema.validate(json.loads(whole), SCHEMAS[0])


BAD = [
    # (id, extra body, the param the 400 must name)
    ("bad-schema", {"structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs.json"),
    ("bad-regex", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    (
        "bad-grammar",
        {"structured_outputs": {"grammar": "root ::= ("}},
        "structured_outputs.grammar",
    ),
    ("empty-choice", {"guided_choice": []}, "guided_choice"),
    ("two-in-one", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("two-fields", {"structured_outputs": {"regex": "a"}, "guided_choice": ["b"]}, "guided_choice"),
    (
        "response-format-and-so",
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "structured_outputs.regex",
    ),
    ("unknown-format", {"response_format": {"type": "xml"}}, "response_format.type"),
    (
        "schema-missing",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema",
    ),
    (
        "bad-format-schema",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {"a": {"type": "what"}}},
                },
            }
        },
        "response_format.json_schema.schema",
    ),
    ("unknown-field", {"modalities": ["audio"]}, "modalities"),
    ("unknown-so-key", {"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
]


@pytest.mark.parametrize("extra, param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_constraints_are_400s_naming_the_field(server, extra, param) -> None:
    base_url, _ = server
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 4,
        **extra,
    }
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_informational_fields_are_accepted(server) -> None:
    base_url, _ = server
    body = {
        "model": "tiny",
        "prompt": "x",
        "max_tokens": 2,
        "user": "u",
        "store": False,
        "metadata": {"k": "v"},
        "service_tier": "auto",
    }
    assert httpx.post(f"{base_url}/v1/completions", json=body, timeout=30).status_code == 200
