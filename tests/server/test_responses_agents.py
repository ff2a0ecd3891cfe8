"""The Responses API under clients no one here wrote, on the default model (SmolLM2-135M):
the OpenAI Agents SDK runs an agent with one function tool through OpenAIResponsesModel
(call, tool output sent back as items, answer), and a conversation continued by
`previous_response_id` reads its earlier turn from the prefix cache."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, Literal

import openai
import pytest

from minivllm.engine.llm_engine import LLMEngine
from minivllm.server import ServerThread, create_app

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    # as test_server.py's default_server: fp32, so that greedy answers do not depend on
    # whether a prompt's tokens came from the prefix cache
    engine = LLMEngine.from_options(model=None, max_model_len=1024, device="cpu", dtype="float32")
    with ServerThread(create_app(engine, MODEL)) as thread:
        yield thread.base_url


@pytest.mark.default_model
def test_openai_agents_runs_a_function_tool_loop(base_url: str) -> None:
    agents = pytest.importorskip("agents")
    from agents.models.openai_responses import OpenAIResponsesModel

    agents.set_tracing_disabled(True)  # traces would go to OpenAI's servers
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    agent = agents.Agent(
        name="weather",
        instructions="Answer in one short sentence.",
        tools=[get_weather],
        model=OpenAIResponsesModel(MODEL, openai_client=client),
        # the first turn must call the tool; the SDK then resets tool_choice to auto
        model_settings=agents.ModelSettings(
            tool_choice="get_weather", temperature=0, max_tokens=80
        ),
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert calls, "the tool was never called"
    assert isinstance(result.final_output, str) and result.final_output
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert kinds[-1] == "message_output_item"


@pytest.mark.default_model
def test_openai_agents_streams_a_forced_tool_call(base_url: str) -> None:
    """Runner.run_streamed reads our semantic events (the tool call arrives as
    function_call_arguments deltas) and runs the tool."""
    agents = pytest.importorskip("agents")
    from agents.models.openai_responses import OpenAIResponsesModel

    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    agent = agents.Agent(
        name="weather",
        tools=[get_weather],
        tool_use_behavior="stop_on_first_tool",
        model=OpenAIResponsesModel(MODEL, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="get_weather", max_tokens=40),
    )

    async def run() -> Any:
        result = agents.Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=2)
        kinds = [event.type async for event in result.stream_events()]
        assert "raw_response_event" in kinds
        return result

    result = asyncio.run(run())
    assert calls and result.final_output == "sunny"


@pytest.mark.default_model
def test_a_continued_conversation_reads_its_earlier_turn_from_the_cache(base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    first = client.responses.create(
        model=MODEL,
        input="Name three colours.",
        instructions="You are terse.",
        max_output_tokens=30,
        temperature=0,
    )
    second = client.responses.create(
        model=MODEL,
        input="And three fruits?",
        instructions="You are terse.",
        max_output_tokens=20,
        temperature=0,
        previous_response_id=first.id,
    )
    assert first.output_text and second.output_text
    cached = second.usage.input_tokens_details.cached_tokens
    # the first turn's prompt, at least in whole blocks, comes from the cache
    assert cached >= first.usage.input_tokens - 16, (cached, first.usage)
