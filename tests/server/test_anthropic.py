"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) driven by the
official `anthropic` SDK against a live server: create, the SDK's stream helpers (text and
tool use), a two-turn tool loop, count_tokens, stop sequences, the max_tokens stop reason, and
errors in Anthropic's shape raised as the SDK's exception classes.

On the tiny random Llama answers are noise; only their shape, and where the grammar enforces
it (a forced tool, a regex) their validity, are checked.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import anthropic
import httpx
import jsonschema
import pytest
from pydantic import BaseModel
from support.faults import FaultyRunner
from support.server_helpers import wait_idle

from minivllm.engine.llm_engine import LLMEngine
from minivllm.server import ServerThread, create_app
from minivllm.server.anthropic.routes import error_response
from minivllm.server.errors import APIError
from minivllm.server.openai.serving import ChatOptions, OpenAIServer

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@dataclass
class Live:
    base_url: str
    client: anthropic.Anthropic
    server: OpenAIServer
    engine: LLMEngine


@pytest.fixture(scope="module")
def live(tiny_llama_long_dir: Path) -> Iterator[Live]:
    engine = LLMEngine.from_options(
        model=str(tiny_llama_long_dir),
        max_model_len=1024,
        num_kv_blocks=256,
        block_size=16,
        device="cpu",
    )
    app = create_app(engine, "tiny", api_key="k", chat=ChatOptions(reasoning_parser="qwen3"))
    with ServerThread(app) as thread:
        client = anthropic.Anthropic(base_url=thread.base_url, api_key="k", max_retries=0)
        yield Live(thread.base_url, client, app.state.server, engine)
        client.close()


def test_create_answers_a_message_cut_by_max_tokens(live) -> None:
    """The response object's fields; a system prompt as blocks; usage splits the prompt into
    computed and cached tokens, which add up to count_tokens."""
    client = live.client
    kw = dict(
        model="tiny",
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
    )
    m = client.messages.create(
        max_tokens=5, metadata={"user_id": "u1"}, extra_body={"ignore_eos": True}, **kw
    )
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.model == "tiny" and m.stop_reason == "max_tokens" and m.stop_sequence is None
    [block] = m.content
    assert block.type == "text" and block.text
    assert m.usage.output_tokens == 5
    counted = client.messages.count_tokens(**kw).input_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted > 5


def test_the_stream_helpers_add_up_to_the_non_streamed_answer(live) -> None:
    """`messages.stream`'s text_stream and get_final_message, at temperature 0, give the
    create answer; the raw events come in Anthropic's order, ping included."""
    base_url, client = live.base_url, live.client
    kw = dict(
        model="tiny",
        max_tokens=8,
        messages=[{"role": "user", "content": "Hi"}],
        extra_body={"temperature": 0.0, "top_k": 5, "top_p": 0.9},
    )
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens > 0
    assert final.id.startswith("msg_")
    body = {"model": "tiny", "max_tokens": 3, "stream": True, "messages": kw["messages"]}
    r = httpx.post(f"{base_url}/v1/messages", json=body, headers={"x-api-key": "k"})
    names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}


def test_a_tool_use_stream_is_assembled_by_the_sdk(live) -> None:
    """A forced tool streams its input as input_json_delta events, which the SDK assembles
    into a tool_use block valid for the tool's schema."""
    client = live.client
    for seed in range(2):
        with client.messages.stream(
            model="tiny",
            max_tokens=60,
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "tool", "name": "get_weather"},
            extra_body={"seed": seed},
        ) as stream:
            deltas = [
                e.delta.partial_json
                for e in stream
                if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
            ]
            final = stream.get_final_message()
        [use] = final.content
        assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
        assert final.stop_reason == "tool_use" and len(deltas) > 1
        assert json.loads("".join(deltas)) == use.input
        jsonschema.validate(use.input, WEATHER)


def test_a_two_turn_tool_loop(live) -> None:
    """tool_choice any gives a tool_use; its tool_result goes back with the assistant turn
    as the SDK returned it, and the next answer reads the first turn from the prefix cache."""
    client = live.client
    first = client.messages.create(
        model="tiny",
        max_tokens=80,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    [use] = first.content
    assert use.type == "tool_use" and first.stop_reason == "tool_use"
    jsonschema.validate(use.input, WEATHER)
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "21 C, sunny"}
    second = client.messages.create(
        model="tiny",
        max_tokens=4,
        tools=TOOLS,
        messages=[
            *ASK,
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": [result]},
        ],
    )
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert second.usage.cache_read_input_tokens > 0
    total = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert total > first.usage.input_tokens + first.usage.cache_read_input_tokens


def test_auto_tools_read_hermes_calls_into_text_and_tool_use_blocks(live) -> None:
    """With tool_choice auto the output's `<tool_call>` blocks (written here under a regex)
    become tool_use blocks after the text, whole and streamed; disable_parallel_tool_use
    keeps the first."""
    client = live.client
    call = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>'
    )
    regex = "ok " + "".join(f"\\{c}" if c in "{}" else c for c in call * 2)
    kw = dict(
        model="tiny",
        max_tokens=200,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        extra_body={"structured_outputs": {"regex": regex}},
    )
    m = client.messages.create(**kw)
    text, use = m.content
    assert text.type == "text" and text.text == "ok" and m.stop_reason == "tool_use"
    assert use.type == "tool_use" and use.input == {"city": "Oslo", "unit": "c"}
    with client.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed.strip() == "ok" and final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == use.input and final.content[1].id != use.id


def test_thinking_is_left_out_of_the_answer(live) -> None:
    """With --reasoning-parser, the model's `<think>` part is not shown (Anthropic shows no
    thinking unless asked, and this server does not take `thinking`), whole or streamed."""
    client = live.client
    kw = dict(
        model="tiny",
        max_tokens=40,
        messages=ASK,
        extra_body={
            "temperature": 0.0,
            "structured_outputs": {"regex": "<think>[a-z]{3}</think>[a-z]{2}"},
        },
    )
    m = client.messages.create(**kw)
    assert len(m.content[0].text) == 2 and "think" not in m.content[0].text
    with client.messages.stream(**kw) as stream:
        assert "".join(stream.text_stream) == m.content[0].text


def test_a_client_that_leaves_a_stream_aborts_its_request(live) -> None:
    base_url, client = live.base_url, live.client
    with client.messages.stream(
        model="tiny", max_tokens=900, messages=ASK, extra_body={"ignore_eos": True}
    ) as stream:
        for _, _event in zip(range(6), stream):
            pass
    assert wait_idle(base_url, timeout=10)["minivllm:num_requests_running"] == 0


class City(BaseModel):
    name: Literal["Paris", "Oslo"]  # the SDK's schema transform drops maxLength
    sunny: bool


def test_parse_a_pydantic_model_through_output_config(live) -> None:
    """`messages.parse(output_format=...)` sends `output_config.format`: the chat path's
    response_format, so the text is valid for the model's schema."""
    client = live.client
    m = client.messages.parse(
        model="tiny", max_tokens=60, messages=ASK, output_format=City, extra_body={"seed": 1}
    )
    assert m.stop_reason == "end_turn", m.content
    assert isinstance(m.parsed_output, City)


def test_count_tokens_counts_the_tools_and_the_system_prompt(live) -> None:
    client = live.client
    plain = client.messages.count_tokens(model="tiny", messages=ASK).input_tokens
    system = client.messages.count_tokens(model="tiny", messages=ASK, system="Be brief.")
    tools = client.messages.count_tokens(model="tiny", messages=ASK, tools=TOOLS)
    assert 0 < plain < system.input_tokens < tools.input_tokens


def test_a_stop_sequence_ends_the_message_and_is_named(live) -> None:
    """A regex makes the random model write the stop sequence: stop_reason stop_sequence,
    the sequence named, and cut from the text, whole and streamed."""
    client = live.client
    kw = dict(
        model="tiny",
        max_tokens=30,
        messages=ASK,
        stop_sequences=["never", "XYZ"],
        extra_body={"structured_outputs": {"regex": "[a-z]{3}XYZ[a-z]{3}"}},
    )
    m = client.messages.create(**kw)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "XYZ")
    assert len(m.content[0].text) == 3
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert len(text) == 3 and (final.stop_reason, final.stop_sequence) == ("stop_sequence", "XYZ")


def _error(exc_info: pytest.ExceptionInfo, kind: str) -> str:
    body = exc_info.value.body
    assert body["type"] == "error" and body["error"]["type"] == kind
    return body["error"]["message"]


def _post(client: anthropic.Anthropic, body: dict) -> object:
    return client.post("/v1/messages", body=body, cast_to=anthropic.types.Message)


@pytest.mark.parametrize(
    "body, names",
    [
        ({"model": "tiny", "messages": ASK}, "max_tokens"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        ({"messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 2000}}, "thinking"),
        ({"messages": ASK, "container": "c"}, "container"),
        ({"messages": ASK, "tools": [{"type": "web_search_20250305"}]}, "tools[0].type"),
        ({"messages": [*ASK, {"role": "assistant", "content": "Sure,"}]}, "messages[1].role"),
        ({"messages": ASK, "output_config": {"effort": "high"}}, "output_config.effort"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(live, body, names) -> None:
    """Each field this server cannot honour is refused by name, never silently ignored."""
    client = live.client
    full = {"model": "tiny", "max_tokens": 4, **body}
    if names == "max_tokens":
        full.pop("max_tokens")
    with pytest.raises(anthropic.BadRequestError) as info:
        _post(client, full)
    assert names in _error(info, "invalid_request_error")


def test_unknown_model_bad_key_and_overload_are_anthropic_errors(live, tiny_llama_long_dir) -> None:
    """404 not_found_error, 401 authentication_error (x-api-key or a bearer token both work),
    529 overloaded_error when the waiting queue is full."""
    base_url, client, server = live.base_url, live.client, live.server
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="nope", max_tokens=2, messages=ASK)
    assert "nope" in _error(info, "not_found_error")
    bad = anthropic.Anthropic(base_url=base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        bad.messages.create(model="tiny", max_tokens=2, messages=ASK)
    _error(info, "authentication_error")
    bearer = anthropic.Anthropic(base_url=base_url, auth_token="k", max_retries=0)
    assert bearer.messages.count_tokens(model="tiny", messages=ASK).input_tokens > 0
    limit = server.engine.max_waiting_requests
    server.engine.max_waiting_requests = 0
    try:
        with pytest.raises(anthropic.OverloadedError) as info:
            client.messages.create(model="tiny", max_tokens=2, messages=ASK)
        _error(info, "overloaded_error")
    finally:
        server.engine.max_waiting_requests = limit
    assert json.loads(error_response(APIError(500, "boom")).body)["error"]["type"] == "api_error"


def test_an_engine_fault_is_an_api_error_whole_and_streamed(live, monkeypatch) -> None:
    """A runner fault ends the request: non-streamed a 500 api_error, streamed an `error`
    event the SDK raises; the server goes on serving."""
    tokenizer = live.engine.tokenizer
    faulty = FaultyRunner(
        live.engine.model_runner,
        fail_when=lambda s: "poison" in tokenizer.decode(s.prompt_token_ids),
    )
    monkeypatch.setattr(live.engine, "model_runner", faulty)
    kw = dict(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "poison"}])
    with pytest.raises(anthropic.InternalServerError) as info:
        live.client.messages.create(**kw)
    assert "injected fault" in _error(info, "api_error")
    with pytest.raises(anthropic.APIStatusError, match="injected fault"):
        with live.client.messages.stream(**kw) as stream:
            list(stream)
    assert live.client.messages.create(model="tiny", max_tokens=2, messages=ASK).content
