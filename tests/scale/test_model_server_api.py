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
        model=str(tiny_llama_long_dir), max_model_len=4096, num_kv_blocks=256, block_size=16,
        max_num_seqs=8, device="cpu", dtype="float32",
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
            model=MODEL, prompt="a long running request", max_tokens=3000, stream=True,
            temperature=0, extra_body={"ignore_eos": True},
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
