"""The Responses API (POST /v1/responses and the stored responses' routes) driven by the
official `openai` SDK against a live server: plain and streamed answers, function tools
forced by the grammar mask, structured text, the store and `previous_response_id`
continuations (served from the prefix cache), cancel, and the 4xx of bad input.

On the tiny random Llama answers are noise; only their shape and, where a schema or a named
tool enforces it, their validity are checked.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter
from support.server_helpers import wait_idle

from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.runtime.engine_process import EngineProcess
from minivllm.server import ServerThread, create_app
from minivllm.server.openai.serving import ChatOptions
from minivllm.server.responses.protocol import ResponseObject
from minivllm.server.responses.routes import ResponsesAPI
from minivllm.server.responses.store import ResponseStore, StoreOptions
from minivllm.server.serve import response_store_options

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": WEATHER,
        "strict": True,
    }
]
NAMED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def live(tiny_llama_long_dir: Path) -> Iterator[tuple[str, openai.OpenAI, ResponsesAPI]]:
    engine = LLMEngine.from_options(
        model=str(tiny_llama_long_dir),
        max_model_len=1024,
        num_kv_blocks=256,
        block_size=16,
        device="cpu",
    )
    app = create_app(
        engine,
        "tiny",
        api_key="k",
        chat=ChatOptions(reasoning_parser="qwen3"),
        response_store=StoreOptions(max_responses=8, max_bytes=1 << 20),
    )
    with ServerThread(app) as thread:
        client = openai.OpenAI(
            base_url=f"{thread.base_url}/v1", api_key="k", max_retries=0, timeout=60
        )
        yield thread.base_url, client, app.state.responses
        client.close()


def test_a_string_input_gives_a_completed_or_incomplete_message(live) -> None:
    _, client, _ = live
    r = client.responses.create(
        model="tiny",
        input="Hello",
        max_output_tokens=5,
        temperature=0,
        instructions="Be brief.",
        metadata={"k": "v"},
    )
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [message] = r.output
    assert message.type == "message" and message.content[0].type == "output_text"
    assert r.output_text == message.content[0].text
    assert r.usage.output_tokens == 5 and r.usage.input_tokens > 5
    assert r.metadata == {"k": "v"} and r.instructions == "Be brief."


def test_a_named_tool_is_a_valid_function_call_and_the_loop_closes_by_items(live) -> None:
    """tool_choice names the function: the call's arguments follow its schema (closed, as
    the schema does not state additionalProperties); its output goes back as items."""
    _, client, _ = live
    for seed in range(3):
        r = client.responses.create(
            model="tiny",
            input="Weather in Paris?",
            tools=TOOLS,
            tool_choice=NAMED,
            temperature=1.0,
            max_output_tokens=60,
            extra_body={"seed": seed},
        )
        [call] = [i for i in r.output if i.type == "function_call"]
        assert call.name == "get_weather" and call.call_id and r.status == "completed"
        jsonschema.validate(args := json.loads(call.arguments), WEATHER)
        assert set(args) <= {"city", "unit"}
    follow = client.responses.create(
        model="tiny",
        max_output_tokens=4,
        temperature=0,
        tools=TOOLS,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"},
        ],
    )
    assert follow.output[0].type == "message"
    assert follow.usage.input_tokens > r.usage.input_tokens


def test_previous_response_id_continues_from_the_prefix_cache(live) -> None:
    """The second turn's prompt extends the first turn's: its tokens come from the cache."""
    _, client, _ = live
    first = client.responses.create(
        model="tiny", input="Tell me a long story " * 6, max_output_tokens=8, temperature=0
    )
    second = client.responses.create(
        model="tiny",
        input="And then?",
        max_output_tokens=4,
        temperature=0,
        previous_response_id=first.id,
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16 * (first.usage.input_tokens // 16)
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_required_tool_choice_and_a_tool_loop_by_previous_response_id(live) -> None:
    _, client, _ = live
    r = client.responses.create(
        model="tiny",
        input="Weather?",
        tools=TOOLS,
        tool_choice="required",
        temperature=1.0,
        max_output_tokens=80,
        parallel_tool_calls=False,
    )
    [call] = [i for i in r.output if i.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    answer = client.responses.create(
        model="tiny",
        previous_response_id=r.id,
        max_output_tokens=3,
        tools=TOOLS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )
    assert answer.output[-1].type in ("message", "function_call")
    assert answer.usage.input_tokens_details.cached_tokens > 0


class City(BaseModel):
    name: str = Field(max_length=12)
    sunny: bool


def test_parse_a_pydantic_model_through_text_format(live) -> None:
    _, client, _ = live
    r = client.responses.parse(
        model="tiny", input="A city?", text_format=City, temperature=1.0, max_output_tokens=60
    )
    assert isinstance(r.output_parsed, City), r.output_text
    json_object = client.responses.create(
        model="tiny", input="x", max_output_tokens=40, text={"format": {"type": "json_object"}}
    )
    if json_object.status == "completed":
        assert isinstance(json.loads(json_object.output_text), dict)


def test_the_stream_is_the_sdks_events_and_adds_up_to_the_response(live) -> None:
    """Every event validates against the SDK's event union, numbered in order; the text
    deltas join to the final response's text, which GET returns too."""
    base_url, client, _ = live
    kw = dict(model="tiny", input="Hi", max_output_tokens=6, temperature=0)
    events = list(client.responses.create(stream=True, **kw))
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event.model_dump())
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-1] == "response.incomplete"
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == client.responses.create(**kw).output_text
    assert client.responses.retrieve(final.id).output_text == text
    with client.responses.stream(
        model="tiny",
        input="Weather?",
        tools=TOOLS,
        tool_choice=NAMED,
        temperature=1.0,
        max_output_tokens=60,
    ) as stream:
        args = "".join(
            e.delta for e in stream if e.type == "response.function_call_arguments.delta"
        )
        done = stream.get_final_response()
    [call] = done.output
    assert call.arguments == args
    jsonschema.validate(json.loads(args), WEATHER)


def test_thinking_is_a_reasoning_item_whole_and_streamed(live) -> None:
    """With --reasoning-parser, `<think>` becomes a reasoning item before the message (a
    regex makes the random model think)."""
    _, client, _ = live
    kw = dict(
        model="tiny",
        input="Why?",
        max_output_tokens=40,
        temperature=1.0,
        extra_body={"seed": 3, "structured_outputs": {"regex": "<think>[a-z]{3}</think>[a-z]{2}"}},
    )
    r = client.responses.create(**kw)
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and len(reasoning.content[0].text) == 3
    assert message.type == "message" and len(r.output_text) == 2
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    events = list(client.responses.create(stream=True, **kw))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == reasoning.content[0].text
    assert events[-1].response.output_text == r.output_text


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"input": [{"type": "web_search_call", "id": "x"}]}, 400, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            400,
            "input[0].content[0].type",
        ),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        (
            {
                "input": "x",
                "text": {
                    "format": {"type": "json_schema", "name": "s", "schema": {"type": "nope"}}
                },
            },
            400,
            "response_format.json_schema.schema",
        ),
        ({"input": "x", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
        (
            {"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS},
            400,
            "tool_choice",
        ),
        ({"input": "x", "top_logprobs": 2}, 400, "top_logprobs"),
        ({"input": "x", "background": True}, 400, "background"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(live, body, status, param) -> None:
    base_url, _, _ = live
    r = httpx.post(f"{base_url}/v1/responses", json=body, headers={"Authorization": "Bearer k"})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_the_api_key_guards_every_route(live) -> None:
    base_url, _, _ = live
    assert httpx.post(f"{base_url}/v1/responses", json={"input": "x"}).status_code == 401
    for method in ("GET", "DELETE"):
        r = httpx.request(method, f"{base_url}/v1/responses/resp_x")
        assert r.status_code == 401
    assert httpx.post(f"{base_url}/v1/responses/resp_x/cancel").status_code == 401


def test_get_delete_and_unknown_ids(live) -> None:
    _, client, _ = live
    r = client.responses.create(model="tiny", input="x", max_output_tokens=1)
    assert client.responses.retrieve(r.id).id == r.id
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model="tiny", input="x", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_cancel_ends_a_running_response_and_its_continuation_is_refused(live) -> None:
    base_url, client, api = live
    result = {}

    def create() -> None:
        result["r"] = client.responses.create(
            model="tiny", input="x", max_output_tokens=900, extra_body={"ignore_eos": True}
        )

    worker = threading.Thread(target=create)
    worker.start()
    deadline = time.monotonic() + 10
    while not api.running and time.monotonic() < deadline:
        time.sleep(0.01)
    [response_id] = list(api.running)
    cancelled = client.responses.cancel(response_id)
    worker.join(10)
    assert cancelled.id == response_id and cancelled.usage.output_tokens < 900
    assert cancelled.status == "cancelled" and result["r"].status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input="y", previous_response_id=response_id)
    with client.responses.create(
        model="tiny", input="x", max_output_tokens=900, stream=True, extra_body={"ignore_eos": True}
    ) as stream:
        first = next(stream)
        assert client.responses.cancel(first.response.id).status == "cancelled"
        last = list(stream)[-1]
    assert last.type == "response.failed" and last.response.status == "cancelled"
    with pytest.raises(openai.BadRequestError):  # a finished one cannot be cancelled
        client.responses.cancel(
            client.responses.create(model="tiny", input="x", max_output_tokens=1).id
        )


def test_a_client_that_leaves_a_stream_aborts_its_request(live) -> None:
    """Closing a stream mid-way aborts the engine's request at once; the stored response
    says it was cancelled."""
    base_url, client, api = live
    with client.responses.create(
        model="tiny", input="x", max_output_tokens=900, stream=True, extra_body={"ignore_eos": True}
    ) as stream:
        events = [next(stream) for _ in range(6)]
    response_id = events[0].response.id
    m = wait_idle(base_url, timeout=10)
    assert m["minivllm:num_requests_running"] == 0
    deadline = time.monotonic() + 10
    while response_id in api.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.responses.retrieve(response_id).status == "cancelled"


@pytest.mark.slow  # an engine process takes tens of seconds to start on a busy CPU
def test_over_an_engine_process(tiny_llama_long_dir: Path) -> None:
    """`minivllm serve`'s way (the engine in a process of its own): answer, stream, cancel.
    The Responses code only uses the server's shared steps, which test_server.py runs over
    both engines; this checks the whole path once."""
    engine = EngineProcess(
        dict(
            model=str(tiny_llama_long_dir),
            max_model_len=1024,
            num_kv_blocks=128,
            block_size=16,
            device="cpu",
        )
    )
    with ServerThread(create_app(engine, "tiny")) as thread:
        client = openai.OpenAI(base_url=f"{thread.base_url}/v1", api_key="x", max_retries=0)
        r = client.responses.create(model="tiny", input="Hi", max_output_tokens=4)
        streamed = list(
            client.responses.create(model="tiny", input="Hi", max_output_tokens=4, stream=True)
        )
        assert r.usage.output_tokens == streamed[-1].response.usage.output_tokens == 4
        with client.responses.create(
            model="tiny",
            input="x",
            max_output_tokens=900,
            stream=True,
            extra_body={"ignore_eos": True},
        ) as stream:
            first = next(stream)
            assert client.responses.cancel(first.response.id).status == "cancelled"
        assert wait_idle(thread.base_url, 10)["minivllm:num_requests_running"] == 0
        client.close()


def test_serve_flags_give_the_store_options() -> None:
    assert response_store_options(argparse.Namespace()) == StoreOptions()
    assert response_store_options(argparse.Namespace(no_response_store=True)).max_responses == 0
    options = response_store_options(
        argparse.Namespace(response_store_max_responses=5, response_store_max_bytes=100)
    )
    assert (options.max_responses, options.max_bytes) == (5, 100)
    from minivllm.cli import build_parser

    args = build_parser().parse_args(
        ["serve", "--response-store-max-responses", "7", "--response-store-max-bytes", "2048"]
    )
    assert response_store_options(args) == StoreOptions(max_responses=7, max_bytes=2048)
    args = build_parser().parse_args(["serve", "--no-response-store"])
    assert response_store_options(args).max_responses == 0


def test_the_store_is_bounded_in_count_and_bytes() -> None:
    """Oldest first out; a soak of many responses never grows it past its bounds."""
    store = ResponseStore(StoreOptions(max_responses=3, max_bytes=4000))

    def put(i: int, size: int = 10) -> str:
        response = ResponseObject(id=f"resp_{i}", model="m")
        store.put(response, [{"role": "user", "content": "x" * size}])
        return response.id

    ids = [put(i) for i in range(4)]
    assert store.get(ids[0]) is None and store.get(ids[3]) is not None
    store.get(ids[1])  # recently used: kept over ids[2]
    put(4)
    assert store.get(ids[2]) is None and store.get(ids[1]) is not None
    for i in range(5, 2000):
        put(i, size=i % 1500)
        assert len(store) <= 3 and store.num_bytes <= 4000
    put(9999, size=5000)  # larger than the whole bound: not kept
    assert store.get("resp_9999") is None
    off = ResponseStore(StoreOptions(max_responses=0))
    off.put(ResponseObject(id="resp_x", model="m"), [])
    assert len(off) == 0
