"""The `anthropic` SDK against the default model (SmolLM2-135M-Instruct, its real chat
template): create, stream, count_tokens, a forced tool streamed, a two-turn tool loop and a
stop sequence. Slow (the model loads and compiles in about a minute on 2 busy cores); the
fast protocol tests on the tiny model are test_anthropic.py's.
"""

from __future__ import annotations

import anthropic
import pytest

from minivllm.engine.llm_engine import LLMEngine
from minivllm.server import ServerThread, create_app

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
TOOLS = [
    {
        "name": "get_weather",
        "description": "The current weather in a city",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    }
]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.slow
@pytest.mark.default_model
def test_the_sdk_runs_against_the_default_model() -> None:
    engine = LLMEngine.from_options(max_model_len=2048, num_kv_blocks=512)
    with ServerThread(create_app(engine)) as thread:
        c = anthropic.Anthropic(base_url=thread.base_url, api_key="x", max_retries=0, timeout=300)
        m = c.messages.create(model=MODEL, max_tokens=40, messages=ASK, system="Be terse.")
        assert m.content[0].text and m.stop_reason in ("end_turn", "max_tokens")
        with c.messages.stream(model=MODEL, max_tokens=40, messages=ASK) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text == final.content[0].text and "Paris" in text
        counted = c.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
        assert final.usage.input_tokens + final.usage.cache_read_input_tokens == counted
        with c.messages.stream(
            model=MODEL,
            max_tokens=60,
            messages=WEATHER,
            tools=TOOLS,
            tool_choice={"type": "tool", "name": "get_weather"},
        ) as stream:
            forced = stream.get_final_message()
        assert forced.stop_reason == "tool_use" and isinstance(forced.content[0].input["city"], str)
        first = c.messages.create(
            model=MODEL,
            max_tokens=60,
            messages=WEATHER,
            tools=TOOLS,
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
        )
        [use] = first.content
        result = {"type": "tool_result", "tool_use_id": use.id, "content": "21 C and sunny"}
        second = c.messages.create(
            model=MODEL,
            max_tokens=40,
            tools=TOOLS,
            messages=[
                *WEATHER,
                {"role": "assistant", "content": first.content},
                {"role": "user", "content": [result]},
            ],
        )
        assert second.stop_reason in ("end_turn", "max_tokens", "tool_use") and second.content
        assert second.usage.cache_read_input_tokens > 0
        stopped = c.messages.create(
            model=MODEL, max_tokens=40, messages=ASK, stop_sequences=["Paris"]
        )
        assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "Paris")
        c.close()
