"""LoRA over HTTP, with the openai SDK: a request's `model` naming an adapter routes to it,
/v1/models lists the adapters under the base model, and adapters load and unload (vLLM's
endpoints) while another request streams; with the engine in the server's process and in a
process of its own (the server's default)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from support.lora_adapters import random_lora, write_peft_files

from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.runtime.engine_process import EngineProcess
from minivllm.server import ServerThread, create_app

SHAPES = {
    "model.layers.0.self_attn.q_proj": (64, 64),
    "model.layers.1.self_attn.v_proj": (64, 32),
    "model.layers.1.mlp.down_proj": (128, 64),
}
PROMPT = [1, 17, 42, 99, 7, 3, 250, 64, 12, 5]


@pytest.fixture(scope="module", params=["in-process", "engine-process"])
def live(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple]:
    root = tmp_path_factory.mktemp("lora_server")
    path = write_peft_files(root / "qv", random_lora(SHAPES, 4, 7), 4, 8)
    options = {
        "model": str(tiny_llama_dir),
        "max_model_len": 256,
        "device": "cpu",
        "dtype": "float32",
        "enable_lora": True,
        "lora_modules": (f"qv={path}",),
    }
    if request.param == "engine-process":
        engine: LLMEngine | EngineProcess = EngineProcess(options)
    else:
        engine = LLMEngine.from_options(**options)
    app = create_app(engine, "tiny")
    with ServerThread(app) as thread:
        client = openai.OpenAI(base_url=thread.base_url + "/v1", api_key="x", max_retries=0)
        yield thread.base_url, client, path
        client.close()


def _logprobs(client: openai.OpenAI, model: str) -> tuple[str, list[float]]:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0.0, logprobs=1
    )
    return out.choices[0].text, list(out.choices[0].logprobs.token_logprobs)


def test_models_lists_the_adapters_under_the_base_model(live) -> None:
    """/v1/models: the base model, then each adapter with `parent` the base (vLLM's shape)."""
    _, client, path = live
    cards = {m.id: m for m in client.models.list()}
    assert cards["qv"].model_extra["parent"] == "tiny"
    assert cards["qv"].model_extra["root"] == str(path)
    assert cards["tiny"].model_extra["parent"] is None


def test_model_naming_an_adapter_routes_to_it(live) -> None:
    """The adapter changes the answer; an unknown model is still a 404."""
    _, client, _ = live
    assert _logprobs(client, "qv")[1] != _logprobs(client, "tiny")[1]
    with pytest.raises(openai.NotFoundError):
        _logprobs(client, "nope")


def _stream(client: openai.OpenAI) -> tuple[Any, Iterator[Any]]:
    """A 40-token greedy stream of the base model, its first chunk already read."""
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=40, temperature=0.0, stream=True
    )
    chunks = iter(stream)
    return next(chunks), chunks


def test_load_and_unload_while_another_request_streams(live) -> None:
    """An adapter loaded mid-stream serves at once (the same files: the same answer as the
    start-up one); unloaded mid-stream, its name is a 404; the streams run to their end
    untouched."""
    base_url, client, path = live
    first, chunks = _stream(client)
    loaded = httpx.post(
        f"{base_url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(path)}
    )
    assert loaded.status_code == 200, loaded.text
    assert _logprobs(client, "late")[0] == _logprobs(client, "qv")[0]  # served mid-stream
    rest = list(chunks)
    # Scores compared exactly with nothing else running: beside the stream the two requests may
    # be batched differently with its steps, and fp32 rounding then differs (~2e-7).
    assert _logprobs(client, "late") == _logprobs(client, "qv")
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0.0)
    text = first.choices[0].text + "".join(c.choices[0].text for c in rest if c.choices)
    assert text == whole.choices[0].text

    first, chunks = _stream(client)
    done = threading.Event()
    rest = []

    def drain() -> None:
        rest.extend(chunks)
        done.set()

    threading.Thread(target=drain).start()
    gone = httpx.post(f"{base_url}/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert gone.status_code == 200, gone.text
    with pytest.raises(openai.NotFoundError):
        _logprobs(client, "late")
    assert done.wait(60)
    text = first.choices[0].text + "".join(c.choices[0].text for c in rest if c.choices)
    assert text == whole.choices[0].text


@pytest.mark.parametrize(
    ("route", "body", "status", "message"),
    [
        ("load", {"lora_name": "x", "lora_path": "/no/such/dir"}, 400, "no such file"),
        ("load", {"lora_name": "qv", "lora_path": "/tmp"}, 400, "already loaded"),
        ("load", {"lora_name": "x"}, 400, "lora_path"),
        ("unload", {"lora_name": "nope"}, 404, "no LoRA adapter"),
    ],
)
def test_bad_load_and_unload_requests_are_openai_errors(live, route, body, status, message) -> None:
    """A bad path, a taken name, a missing field or an unknown adapter: 4xx in OpenAI's shape."""
    base_url, _, _ = live
    r = httpx.post(f"{base_url}/v1/{route}_lora_adapter", json=body)
    assert r.status_code == status
    assert message in r.json()["error"]["message"]


def test_responses_and_messages_route_to_an_adapter_as_chat_does(live) -> None:
    """The Responses API and Anthropic's Messages run under the adapter a request's `model`
    names: greedy, each answers what chat completions answers under that adapter."""
    import anthropic

    base_url, client, _ = live
    question = "hello there"
    chat = {
        model: client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            max_tokens=8,
            temperature=0.0,
        )
        .choices[0]
        .message.content
        for model in ("qv", "tiny")
    }
    assert chat["qv"] != chat["tiny"], "the adapter must change this answer for the test to hold"
    for model in ("qv", "tiny"):
        response = client.responses.create(
            model=model, input=question, max_output_tokens=8, temperature=0.0
        )
        assert response.output_text == chat[model], model
    messages = anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0)
    for model in ("qv", "tiny"):
        message = messages.messages.create(
            model=model,
            max_tokens=8,
            messages=[{"role": "user", "content": question}],
            extra_body={"temperature": 0.0},  # this SDK version types no temperature
        )
        assert message.content[0].text == chat[model], model
    messages.close()
