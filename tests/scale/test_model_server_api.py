"""What the routers and gateways in front of several `minivllm serve` processes read from each
one: /health, /v1/models, vLLM's metric names for queue length and KV usage, and request
bodies as those routers re-send them. Fast: one tiny checkpoint, one server for the module.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from support.server_helpers import scrape_metrics, wait_idle

from minivllm.engine.llm_engine import LLMEngine
from minivllm.server import ServerThread, create_app

MODEL = "tiny-llama"
API_KEY = "router-key"


@pytest.fixture(scope="module")
def base_url(tiny_llama_long_dir: Path) -> Iterator[str]:
    engine = LLMEngine.from_options(
        model=str(tiny_llama_long_dir),
        max_model_len=4096,
        num_kv_blocks=256,
        block_size=16,
        max_num_seqs=8,
        device="cpu",
        dtype="float32",
    )
    app = create_app(engine, MODEL, api_key=API_KEY)
    with ServerThread(app) as thread:
        yield thread.base_url


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def test_health_needs_no_key_and_models_names_the_model(base_url: str) -> None:
    """Routers probe /health without credentials before sending any traffic, and discover the
    model through /v1/models (which, like every API route, needs the key)."""
    health = httpx.get(f"{base_url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert httpx.get(f"{base_url}/v1/models").status_code == 401
    models = httpx.get(f"{base_url}/v1/models", headers=_auth()).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 4096


def test_vllm_metric_names_alias_ours(base_url: str) -> None:
    """vllm:num_requests_running / _waiting / kv_cache_usage_perc (labelled with model_name, as
    vLLM labels them) carry the same values as the minivllm: gauges, while a request runs and
    after it ends; the prefix-cache counters too."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0)
    started = threading.Event()
    done = threading.Event()

    def stream() -> None:
        chunks = client.completions.create(
            model=MODEL,
            prompt="a long running request",
            max_tokens=3000,
            stream=True,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        for _ in chunks:
            started.set()
            if done.is_set():
                break
        chunks.close()

    worker = threading.Thread(target=stream)
    worker.start()
    try:
        assert started.wait(60)
        busy = scrape_metrics(base_url)
    finally:
        done.set()
        worker.join(60)
    label = f'{{model_name="{MODEL}"}}'
    assert busy[f"vllm:num_requests_running{label}"] == 1
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert busy[f"vllm:{name}{label}"] == busy[f"minivllm:{name}"], name
    assert busy[f"vllm:kv_cache_usage_perc{label}"] > 0
    idle = wait_idle(base_url, 30)
    assert idle[f"vllm:num_requests_running{label}"] == 0
    assert idle[f"vllm:kv_cache_usage_perc{label}"] == idle["minivllm:kv_cache_usage_perc"]
    for name in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions"):
        assert idle[f"vllm:{name}_total{label}"] == idle[f"minivllm:{name}_total"], name
    assert idle[f"vllm:prefix_cache_queries_total{label}"] > 0


# The bodies vllm-router forwards (captured from vllm-router 0.1.17 in front of a recording
# server): the client's fields plus SGLang's and vLLM's extras at their defaults.
ROUTER_CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hello"}],
    "stream": False,
    "max_tokens": 5,
    "logprobs": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "include_reasoning": True,
}
ROUTER_COMPLETION = {
    "model": MODEL,
    "prompt": "hello",
    "max_tokens": 5,
    "stream": False,
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}
# Before forwarding a chat request, its cache-aware policy asks the worker for its tokens.
ROUTER_TOKENIZE = {
    "model": MODEL,
    "continue_final_message": False,
    "messages": [{"role": "user", "content": "hello"}],
}


def test_requests_as_the_routers_forward_them(base_url: str) -> None:
    """Chat, streamed chat, completion and tokenize bodies exactly as vllm-router sends them
    are served (not a 400 for the extras it adds)."""
    with httpx.Client(base_url=base_url, headers=_auth(), timeout=60) as http:
        chat = http.post("/v1/chat/completions", json=ROUTER_CHAT)
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["completion_tokens"] > 0
        streamed = http.post("/v1/chat/completions", json={**ROUTER_CHAT, "stream": True})
        assert streamed.status_code == 200, streamed.text
        assert streamed.text.rstrip().endswith("data: [DONE]")
        completion = http.post("/v1/completions", json=ROUTER_COMPLETION)
        assert completion.status_code == 200, completion.text
        tokens = http.post("/tokenize", json=ROUTER_TOKENIZE)
        assert tokens.status_code == 200, tokens.text
        assert tokens.json()["count"] == len(tokens.json()["tokens"]) > 0


@pytest.mark.parametrize(
    "field,value",
    [
        ("no_stop_trim", True),
        ("continue_final_message", True),
        ("return_hidden_states", True),
        ("separate_reasoning", False),
        ("no_stop_trim", 0),
    ],
)
def test_router_fields_off_their_default_are_refused(
    base_url: str, field: str, value: object
) -> None:
    """A router extra at any value but the one this server implements is a 400 naming it,
    not an answer that silently differs from what was asked."""
    r = httpx.post(
        f"{base_url}/v1/chat/completions",
        headers=_auth(),
        json={**ROUTER_CHAT, field: value},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]
