"""Tool calling, reasoning and the tokenizer endpoints through the server.

`tool_choice` required or named is enforced by the grammar mask, so the tiny random model's
calls are valid for the tools' schemas at temperature 1; `auto` reads Hermes `<tool_call>`
blocks (checked on the parser, as a random model does not write them).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from minivllm.engine.llm_engine import LLMEngine
from minivllm.server import ServerThread, create_app
from minivllm.server.openai.reasoning import ReasoningStream, split_reasoning
from minivllm.server.openai.serving import ChatOptions
from minivllm.server.openai.tools import ToolStream, parse_calls, with_fallback_prompt

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if shout %}LOUD{% endif %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def server(tiny_llama_long_dir: Path) -> Iterator[tuple[str, openai.OpenAI]]:
    engine = LLMEngine.from_options(
        model=str(tiny_llama_long_dir), max_model_len=1024, num_kv_blocks=256, device="cpu"
    )
    app = create_app(engine, "tiny", chat=ChatOptions(reasoning_parser="qwen3"))
    with ServerThread(app) as thread:
        client = openai.OpenAI(base_url=f"{thread.base_url}/v1", api_key="x", max_retries=0)
        yield thread.base_url, client
        client.close()


def _chat(client: openai.OpenAI, **kw):
    return client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=150, temperature=1.0, tools=TOOLS, **kw
    )


def test_named_tool_choice_gives_a_valid_call(server) -> None:
    _, client = server
    for seed in range(5):
        r = _chat(
            client, seed=seed, tool_choice={"type": "function", "function": {"name": "get_weather"}}
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_required_gives_calls_of_the_given_tools(server) -> None:
    _, client = server
    for seed in range(5):
        r = _chat(client, seed=seed, tool_choice="required", parallel_tool_calls=False)
        [call] = r.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_streamed_tool_call_reassembles_to_the_non_streamed_one(server) -> None:
    _, client = server
    kw = dict(seed=11, tool_choice={"type": "function", "function": {"name": "get_time"}})
    whole = _chat(client, **kw).choices[0].message.tool_calls[0]
    name, args, finish = "", "", None
    for chunk in _chat(client, stream=True, **kw):
        for delta in chunk.choices[0].delta.tool_calls or []:
            name += delta.function.name or ""
            args += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, args, finish) == (whole.function.name, whole.function.arguments, "tool_calls")


def test_a_forced_call_cut_by_max_tokens_is_still_a_tool_call(server) -> None:
    """With tool_choice named or required the output is the call: cut by max_tokens it comes
    back in tool_calls (finish_reason "length"), streamed or not, never as content."""
    _, client = server
    for choice, cut in (
        ({"type": "function", "function": {"name": "get_weather"}}, 6),
        ("required", 20),
    ):
        kw = dict(
            model="tiny",
            messages=ASK,
            max_tokens=cut,
            temperature=1.0,
            seed=0,
            tools=TOOLS,
            tool_choice=choice,
        )
        out = client.chat.completions.create(**kw).choices[0]
        assert out.finish_reason == "length" and out.message.content is None, out
        [call] = out.message.tool_calls
        assert call.function.name in SCHEMAS, call
        finish, calls = None, []
        for chunk in client.chat.completions.create(stream=True, **kw):
            assert not chunk.choices[0].delta.content
            calls += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "length" and calls


def test_cut_required_output_keeps_its_whole_calls_and_the_cut_one() -> None:
    text = (
        '[{"name":"get_time","parameters":{"zone":"utc"}},{"name":"get_weather","parameters":{"ci'
    )
    content, calls = parse_calls(text, "required", None)
    assert content is None
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_time", '{"zone": "utc"}'),
        ("get_weather", '{"ci'),
    ]
    assert parse_calls('[{"name":"get_ti', "required", None) == (None, [])
    [call] = parse_calls('{"city":"Par', "named", "get_weather")[1]
    assert call.function.arguments == '{"city":"Par'


def test_a_tool_schema_without_additional_properties_admits_only_its_own(server) -> None:
    """Unstated additionalProperties is false (vLLM's default): a random model at
    temperature 1 writes only the declared keys."""
    _, client = server
    person = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    }
    tools = [{"type": "function", "function": {"name": "add_person", "parameters": person}}]
    for seed in range(4):
        r = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            max_tokens=60,
            temperature=1.0,
            seed=seed,
            tools=tools,
            tool_choice={"type": "function", "function": {"name": "add_person"}},
        )
        args = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
        assert set(args) <= {"name", "age"}, args


def test_a_tool_result_turn_is_accepted(server) -> None:
    _, client = server
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    r = client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length")


def test_tools_are_shown_to_a_template_without_a_tool_section(server) -> None:
    _, client = server
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1)
    with_tools = _chat(client, tool_choice="auto", seed=0)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    none = _chat(client, tool_choice="none", seed=0)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert with_fallback_prompt(ASK, TOOLS)[0]["role"] == "system"


def test_hermes_calls_are_parsed_and_streamed_as_deltas() -> None:
    text = (
        'Let me check. <tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n'
        "</tool_call>"
    )
    content, [call] = parse_calls(text, "auto", None)
    assert content == "Let me check."
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_time",
        {"zone": "utc"},
    )
    stream, sent = ToolStream("auto", None), ""
    for i in range(0, len(text), 3):
        delta, calls = stream.feed(text[i : i + 3], finished=i + 3 >= len(text))
        sent += delta
        assert "<" not in sent  # nothing of the call leaks into the content
    assert sent.strip() == "Let me check." and calls[0].function.name == "get_time"
    assert parse_calls("no calls <tool_call>{broken", "auto", None) == (
        "no calls <tool_call>{broken",
        [],
    )


@pytest.mark.parametrize(
    "parser, text",
    [
        ("deepseek_r1", "thinking hard</think>\n\nThe answer"),
        ("qwen3", "<think>\nwhy</think>answer"),
        ("qwen3", "just an answer"),
        ("deepseek_r1", "<think>never ends"),
    ],
)
def test_reasoning_streams_as_the_whole_splits(parser, text) -> None:
    stream, reasoning, content = ReasoningStream(parser), "", ""
    for i in range(0, len(text), 2):
        r, c = stream.feed(text[i : i + 2], finished=i + 2 >= len(text))
        reasoning, content = reasoning + r, content + c
    want_reasoning, want_content = split_reasoning(parser, text)
    assert (reasoning, content) == (want_reasoning or "", want_content)


def test_reasoning_content_through_the_server(server) -> None:
    """A regex forces the random model to think: the parser splits it off."""
    _, client = server
    r = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        max_tokens=40,
        temperature=1.0,
        seed=1,
        extra_body={"structured_outputs": {"regex": "<think>[a-z]{3}</think>[a-z]{2}"}},
    )
    message = r.choices[0].message
    assert len(message.reasoning_content) == 3 and len(message.content) == 2


def test_tokenize_detokenize_and_version(server) -> None:
    base_url, _ = server
    r = httpx.post(f"{base_url}/tokenize", json={"prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
    back = httpx.post(f"{base_url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"].endswith("Hello world")
    chat = httpx.post(f"{base_url}/tokenize", json={"messages": ASK}).json()
    assert chat["count"] > r["count"]
    assert httpx.post(f"{base_url}/detokenize", json={"tokens": [10**9]}).status_code == 400
    assert httpx.get(f"{base_url}/version").json()["version"]


def test_cached_tokens_count_prefix_cache_hits(server) -> None:
    _, client = server
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 16


def test_chat_template_and_its_kwargs(tiny_llama_dir: Path) -> None:
    engine = LLMEngine.from_options(model=str(tiny_llama_dir), max_model_len=256, device="cpu")
    app = create_app(
        engine, "t", chat=ChatOptions(chat_template=TEMPLATE, chat_template_kwargs={"shout": False})
    )
    with ServerThread(app) as thread:

        def text(**kw) -> str:
            ids = httpx.post(f"{thread.base_url}/tokenize", json={"messages": ASK, **kw}).json()
            return httpx.post(
                f"{thread.base_url}/detokenize", json={"tokens": ids["tokens"]}
            ).json()["prompt"]

        assert "LOUD" not in text() and text().startswith("<|user|>")
        assert "LOUD" in text(chat_template_kwargs={"shout": True})


def test_serve_takes_the_model_positionally_and_the_chat_flags(tmp_path: Path) -> None:
    from minivllm.cli import build_parser
    from minivllm.server.serve import chat_options

    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    args = build_parser().parse_args(
        [
            "serve",
            "some/model",
            "--chat-template",
            str(template),
            "--chat-template-kwargs",
            '{"shout": true}',
            "--reasoning-parser",
            "qwen3",
        ]
    )
    assert args.model_tag == "some/model"
    assert chat_options(args) == ChatOptions(TEMPLATE, {"shout": True}, "qwen3")
    args.chat_template_kwargs = "{nope"
    with pytest.raises(SystemExit, match="not valid JSON"):
        chat_options(args)


def test_cors_only_when_asked(tiny_llama_dir: Path) -> None:
    engine = LLMEngine.from_options(model=str(tiny_llama_dir), max_model_len=256, device="cpu")
    preflight = {"Origin": "http://example.com", "Access-Control-Request-Method": "POST"}
    for origins, allowed in [(None, None), (["http://example.com"], "http://example.com")]:
        with ServerThread(create_app(engine, "t", allowed_origins=origins)) as thread:
            r = httpx.options(f"{thread.base_url}/v1/completions", headers=preflight)
            assert r.headers.get("access-control-allow-origin") == allowed
