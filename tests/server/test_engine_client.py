"""The server's one seam to an engine: `EngineClient`. The app serves any object with the
protocol's members alone (no LLMEngine, no isinstance on the engine kind), and the live lab,
which photographs an engine of this process, refuses a client."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from support.fake_runner import FakeModelRunner

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.runtime.async_engine import AsyncLLMEngine
from minivllm.engine.runtime.engine_client import EngineClient
from minivllm.server.app import create_app

MEMBERS = (
    "config",
    "loras",
    "tokenizer",
    "default_sampling_params",
    "vocab_size",
    "stats",
    "is_running",
    "start",
    "shutdown",
    "close",
    "stop_accepting",
    "abort_all",
    "add_request",
)
SETTABLE = ("on_output", "max_waiting_requests")


class ProtocolOnly:
    """An EngineClient that exposes the protocol's members and nothing else: a server that
    reached past the protocol (model_runner, scheduler, ...) fails on it."""

    def __init__(self, inner: AsyncLLMEngine) -> None:
        object.__setattr__(self, "_inner", inner)

    def __getattr__(self, name: str) -> object:
        if name not in MEMBERS + SETTABLE:
            raise AttributeError(f"{name!r} is not an EngineClient member")
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: object) -> None:
        if name not in SETTABLE:
            raise AttributeError(f"{name!r} is not a settable EngineClient member")
        setattr(self._inner, name, value)


def _client(vocab_size: int = 1000) -> ProtocolOnly:
    config = EngineConfig(block_size=4, max_model_len=64)
    return ProtocolOnly(AsyncLLMEngine(LLMEngine(config, FakeModelRunner(16, 4, vocab_size))))


def test_the_protocol_names_what_the_wrapper_exposes() -> None:
    declared = {n for n in vars(EngineClient) if not n.startswith("_")}
    declared |= set(EngineClient.__annotations__)
    assert declared == set(MEMBERS + SETTABLE)


def test_the_server_runs_on_the_protocol_alone() -> None:
    """Token-id prompts complete, and the vocabulary bound comes from the client."""
    client: EngineClient = _client(vocab_size=500)  # type: ignore[assignment]
    with TestClient(create_app(client, "fake")) as http:
        ok = http.post(
            "/v1/completions",
            json={"model": "fake", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0},
        )
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 3
        bad = http.post(
            "/v1/completions",
            json={"model": "fake", "prompt": [1, 2, 3], "max_tokens": 3, "logit_bias": {"700": 1}},
        )
        assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]
        assert http.get("/health").status_code == 200


def test_the_live_lab_needs_an_engine_of_this_process() -> None:
    with pytest.raises(ValueError, match="engine of this process"):
        create_app(_client(), "fake", lab=True)  # type: ignore[arg-type]
