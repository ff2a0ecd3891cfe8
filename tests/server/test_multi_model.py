"""The multi-model server (`minivllm serve --model A --model B`) over real engine processes
on two tiny checkpoints: listing, loading on the first request, concurrent requests to both,
one model's engine crash, unknown names, the load/unload endpoints, LRU eviction and idle
unload. Two servers are shared by the module's tests (each load starts an engine process)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.server_helpers import scrape_metrics

from minivllm.server import ServerThread
from minivllm.server.model_registry import ModelRegistry, RegistryLimits
from minivllm.server.model_specs import ModelSpec
from minivllm.server.multi_app import create_multi_app

_OPTIONS = dict(device="cpu", dtype="float32", enforce_eager=True)  # no compile: faster loads


def _specs(llama: Path, qwen: Path) -> list[ModelSpec]:
    """Three names: llama-copy is llama's checkpoint again (a third model for eviction)."""
    llama_options = {**_OPTIONS, "model": str(llama), "max_model_len": 2048, "num_kv_blocks": 160}
    return [
        ModelSpec("llama", llama_options),
        ModelSpec("qwen", {**_OPTIONS, "model": str(qwen), "max_model_len": 512}),
        ModelSpec("llama-copy", llama_options),
    ]


@pytest.fixture(scope="module")
def server(tiny_llama_long_dir: Path, tiny_qwen3_dir: Path) -> Iterator[tuple[str, Any]]:
    """Three models, at most two loaded."""
    limits = RegistryLimits(max_loaded_models=2)
    app = create_multi_app(ModelRegistry(_specs(tiny_llama_long_dir, tiny_qwen3_dir), limits))
    with ServerThread(app) as thread:
        yield thread.base_url, app.state.server.registry


def _states(base: str) -> dict[str, str]:
    data = httpx.get(f"{base}/v1/models", timeout=10).json()["data"]
    return {card["id"]: card["status"]["value"] for card in data}


def _complete(base: str, model: str, max_tokens: int = 8) -> httpx.Response:
    body = {"model": model, "prompt": "hello there", "max_tokens": max_tokens, "ignore_eos": True}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=120)


def test_both_listed_and_loaded_on_first_request(server: tuple[str, Any]) -> None:
    """/v1/models lists both models with their state; a request for an unloaded model loads
    it (and only it) and is answered under its name."""
    base, _ = server
    for name in ("llama", "qwen"):
        httpx.post(f"{base}/models/unload", json={"model": name}, timeout=30)
    assert set(_states(base).values()) == {"unloaded"}
    r = _complete(base, "llama")
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "llama" and r.json()["usage"]["completion_tokens"] == 8
    assert _states(base) == {"llama": "loaded", "qwen": "unloaded", "llama-copy": "unloaded"}


def test_concurrent_requests_to_both_and_per_model_metrics(server: tuple[str, Any]) -> None:
    """Requests to both models at once (one of them loading meanwhile) all succeed, and the
    metrics carry vLLM's model_name label per model."""
    base, _ = server
    names = ["llama", "qwen"] * 4
    with ThreadPoolExecutor(len(names)) as pool:
        results = list(pool.map(lambda name: _complete(base, name), names))
    assert [r.status_code for r in results] == [200] * len(names)
    assert [r.json()["model"] for r in results] == names
    metrics = scrape_metrics(base)
    for name in ("llama", "qwen"):
        assert metrics[f'minivllm:generation_tokens_total{{model_name="{name}"}}'] >= 32
        assert f'vllm:num_requests_running{{model_name="{name}"}}' in metrics
        assert metrics[f'minivllm:model_state{{model_name="{name}",state="loaded"}}'] == 1
        assert metrics[f'minivllm:model_requests_waiting_for_load{{model_name="{name}"}}'] == 0


def test_a_model_crash_fails_only_its_own_requests(server: tuple[str, Any]) -> None:
    """llama's engine process killed mid-stream: its stream ends with an error event, a
    request to qwen meanwhile succeeds, and the next llama request loads it again."""
    base, registry = server
    assert _complete(base, "qwen").status_code == 200
    body = {"model": "llama", "prompt": "a", "max_tokens": 1800, "ignore_eos": True, "stream": True}
    events: list[Any] = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
            if len(events) == 3:
                os.kill(registry.entries["llama"].client._process.pid, signal.SIGKILL)
                assert _complete(base, "qwen").status_code == 200
    assert events[-1] == "[DONE]"
    assert any(isinstance(e, dict) and "error" in e for e in events)
    r = _complete(base, "llama")
    assert r.status_code == 200, r.text
    assert registry.entries["llama"].loads >= 2
    assert _states(base)["llama"] == "loaded"


def test_unknown_or_missing_model_is_a_client_error(server: tuple[str, Any]) -> None:
    """An unknown model is a 404 in OpenAI's shape listing the names; a body naming none is
    a 400; neither loads anything."""
    base, _ = server
    r = _complete(base, "gpt-4")
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'llama'" in error["message"] and "'qwen'" in error["message"]
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    r = httpx.post(f"{base}/models/load", json={"model": "nope"}, timeout=10)
    assert r.status_code == 404


@contextlib.contextmanager
def _busy(base: str, model: str) -> Iterator[None]:
    """A long streamed request in flight on `model` for the block's duration."""
    body = {"model": model, "prompt": "a", "max_tokens": 1800, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()  # kept: a dropped iterator closes the connection
        next(lines)
        yield


def test_a_busy_model_is_never_evicted(server: tuple[str, Any]) -> None:
    """Under --max-loaded-models 2, with llama (the least recently used) streaming and qwen
    idle, a third model evicts qwen, not llama."""
    base, _ = server
    assert _states(base) == {"llama": "loaded", "qwen": "loaded", "llama-copy": "unloaded"}
    with ThreadPoolExecutor(1) as pool:
        with _busy(base, "llama"):
            assert _complete(base, "qwen").status_code == 200  # llama is now the LRU model
            pending = pool.submit(_complete, base, "llama-copy")
            deadline = time.monotonic() + 60
            while _states(base)["qwen"] != "unloaded" and time.monotonic() < deadline:
                time.sleep(0.05)  # the victim is chosen (and detached) as the load starts
            assert _states(base)["llama"] == "loaded"
        assert pending.result().status_code == 200  # the stream gone, the load has the CPU
    assert _states(base) == {"llama": "loaded", "qwen": "unloaded", "llama-copy": "loaded"}


def test_load_and_unload_endpoints(server: tuple[str, Any]) -> None:
    """POST /models/load answers the loaded model's card, /models/unload unloads an idle
    model; a model with a request in flight is not unloaded (409)."""
    base, _ = server
    r = httpx.post(f"{base}/models/load", json={"model": "llama"}, timeout=60)
    assert r.status_code == 200 and r.json()["status"]["value"] == "loaded"
    assert r.json()["max_model_len"] == 2048
    with _busy(base, "llama"):
        r = httpx.post(f"{base}/models/unload", json={"model": "llama"}, timeout=10)
        assert r.status_code == 409 and r.json()["error"]["code"] == "model_busy"
    r = httpx.post(f"{base}/models/unload", json={"model": "llama-copy"}, timeout=30)
    assert r.status_code == 200 and r.json()["status"]["value"] == "unloaded"
    assert _states(base)["llama-copy"] == "unloaded"


def test_idle_model_is_unloaded(tiny_qwen3_dir: Path) -> None:
    """With --idle-unload-seconds 1 a model nobody uses is unloaded (and listed so)."""
    spec = ModelSpec("qwen", {**_OPTIONS, "model": str(tiny_qwen3_dir), "max_model_len": 512})
    app = create_multi_app(ModelRegistry([spec], RegistryLimits(idle_unload_s=1.0)))
    with ServerThread(app) as thread:
        base = thread.base_url
        assert _complete(base, "qwen").status_code == 200
        deadline = time.monotonic() + 10
        while _states(base)["qwen"] != "unloaded" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _states(base) == {"qwen": "unloaded"}
        assert scrape_metrics(base)['minivllm:model_loads_total{model_name="qwen"}'] == 1
