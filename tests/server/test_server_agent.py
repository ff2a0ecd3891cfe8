"""An agent library no one here wrote, pydantic-ai, runs its tool loop against a live server:
it sends its function tools and its output tool with `tool_choice: "required"`, runs the
tools the model calls, and stops at a valid output. On the tiny random model every step
parses only because the server enforces the tools' schemas."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field

from minivllm.engine.llm_engine import LLMEngine
from minivllm.server import ServerThread, create_app

pydantic_ai = pytest.importorskip("pydantic_ai")
from pydantic_ai.models.openai import OpenAIChatModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402
from pydantic_ai.usage import UsageLimits  # noqa: E402


class Forecast(BaseModel):
    city: str = Field(max_length=8)
    sky: Literal["sun", "rain"]


def test_pydantic_ai_tool_loop(tiny_llama_long_dir: Path) -> None:
    engine = LLMEngine.from_options(
        model=str(tiny_llama_long_dir), max_model_len=4096, device="cpu"
    )
    calls: list[str] = []
    with ServerThread(create_app(engine, "tiny")) as thread:
        provider = OpenAIProvider(base_url=f"{thread.base_url}/v1", api_key="x")
        model = OpenAIChatModel("tiny", provider=provider)
        for seed in range(6):
            agent = pydantic_ai.Agent(
                model,
                output_type=Forecast,
                model_settings={"temperature": 1.0, "max_tokens": 200, "seed": seed},
            )

            @agent.tool_plain
            def get_weather(city: Annotated[str, Field(max_length=8)]) -> str:
                """The weather in a city."""
                calls.append(city)
                return "sunny"

            result = agent.run_sync(
                "Forecast for Paris?", usage_limits=UsageLimits(request_limit=8)
            )
            assert isinstance(result.output, Forecast)
    assert calls, "no run called the tool: the loop was never exercised"
