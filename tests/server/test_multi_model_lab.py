"""The live lab of a multi-model server (`minivllm serve --model A --model B --lab`), over
HTTP on two tiny checkpoints loaded into engines of the server's process: each loaded model
is watched apart (`/lab/api/frames?model=NAME`), a model that is not loaded or not served is
a clear 4xx, the picker lists every model, the API obeys the key, and the command line
accepts --lab with several models."""

from __future__ import annotations

import argparse
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from minivllm.server import ServerThread
from minivllm.server.model_registry import ModelRegistry
from minivllm.server.model_specs import ModelSpec
from minivllm.server.multi_app import create_multi_app
from minivllm.server.multi_lab import LiveModels
from minivllm.server.multi_serve import serve_models

KEY = "lab-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
_OPTIONS = dict(device="cpu", dtype="float32", enforce_eager=True, max_model_len=256)


@pytest.fixture(scope="module")
def base(tiny_llama_dir: Path, tiny_qwen3_dir: Path) -> Iterator[str]:
    """Two models with different pools (32 and 48 blocks), neither loaded at first."""
    live = LiveModels()
    specs = [
        ModelSpec("llama", {**_OPTIONS, "model": str(tiny_llama_dir), "num_kv_blocks": 32}),
        ModelSpec("qwen", {**_OPTIONS, "model": str(tiny_qwen3_dir), "num_kv_blocks": 48}),
    ]
    app = create_multi_app(ModelRegistry(specs, start_client=live.start), api_key=KEY, live=live)
    with ServerThread(app) as thread:
        yield thread.base_url


def _frames(base: str, model: str | None, after: int = -1) -> httpx.Response:
    query = f"after={after}" + (f"&model={model}" if model is not None else "")
    return httpx.get(f"{base}/lab/api/frames?{query}", headers=AUTH, timeout=10)


def _complete(base: str, model: str) -> dict[str, Any]:
    body = {"model": model, "prompt": "hello there", "max_tokens": 6, "ignore_eos": True}
    r = httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_each_loaded_model_is_watched_apart(base: str) -> None:
    """Before a model loads, watching it is a 409 (watching never loads it); after a request
    each model's frames are its own engine's (its pool size, its request's tokens); after an
    unload it is a 409 again."""
    r = _frames(base, "qwen")
    assert r.status_code == 409 and r.json()["error"]["code"] == "model_not_loaded"
    assert "POST /models/load" in r.json()["error"]["message"]
    _complete(base, "llama")
    llama = _frames(base, "llama").json()
    assert llama["num_blocks"] == 32 and llama["frames"], llama
    assert any(req["num_tokens"] > 0 for f in llama["frames"] for req in f["requests"])
    assert _frames(base, "qwen").status_code == 409  # llama's load did not load qwen
    _complete(base, "qwen")
    qwen = _frames(base, "qwen").json()
    assert qwen["num_blocks"] == 48 and qwen["frames"]
    last = llama["frames"][-1]["index"]
    assert _frames(base, "llama", after=last).json()["frames"] == []  # qwen's steps: not llama's
    r = httpx.post(f"{base}/models/unload", json={"model": "llama"}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert _frames(base, "llama").status_code == 409


def test_bad_names_and_the_key(base: str) -> None:
    """No ?model= is a 400 naming the models, an unknown one a 404 listing them, both in
    OpenAI's error shape; without the key the API is a 401 while the page itself loads."""
    r = _frames(base, None)
    assert r.status_code == 400 and "?model=NAME" in r.json()["error"]["message"]
    r = _frames(base, "nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "'llama'" in r.json()["error"]["message"]
    assert httpx.get(f"{base}/lab/api/frames?model=llama", timeout=10).status_code == 401
    assert httpx.get(f"{base}/lab/api/models", timeout=10).status_code == 401
    page = httpx.get(f"{base}/lab?model=llama", timeout=10)
    assert page.status_code == 200 and 'id="model-select"' in page.text


def test_the_picker_lists_every_model_with_its_state(base: str) -> None:
    """GET /lab/api/models: every served model, loaded or not, in the server's order."""
    _complete(base, "qwen")
    r = httpx.get(f"{base}/lab/api/models", headers=AUTH, timeout=10)
    assert r.status_code == 200
    models = {m["name"]: m["state"] for m in r.json()["models"]}
    assert list(models) == ["llama", "qwen"] and models["qwen"] == "loaded"


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages", "/v1/responses/resp_1"])
def test_one_model_apis_say_so(base: str, path: str) -> None:
    """The APIs that serve one model answer a 404 that says so, in OpenAI's shape."""
    r = httpx.post(f"{base}{path}", json={"model": "llama"}, headers=AUTH, timeout=10)
    assert r.status_code == 404
    assert "serves one model" in r.json()["error"]["message"]


def test_serve_refuses_flags_it_cannot_honour_with_several_models() -> None:
    """--lab is accepted with several models now; the flags that still serve one model stop
    the command with a message naming the flag (never silently ignored)."""
    args = argparse.Namespace(
        model=["a", "b"], models_dir=None, lab=True, served_model_name="x", engine_process=True
    )
    with pytest.raises(SystemExit, match="--served-model-name serves one model"):
        serve_models(args, {})


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium (skipped without it, as the lab's own page tests are)."""
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(chromium).exists():
        pytest.skip(f"chromium not found at {chromium}")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium, args=["--headless", "--no-sandbox", "--disable-gpu"]
        )
        yield browser
        browser.close()


def test_the_page_moves_to_a_loaded_model_and_its_picker_switches(base: str, browser) -> None:
    """The page opened without ?model= moves to the first loaded model once the key is in;
    its picker lists both models and choosing one reloads the page on it, whose poll then
    shows that model's frames (its own pool size; no error banner, no page error)."""
    from playwright.sync_api import expect

    _complete(base, "llama")
    _complete(base, "qwen")
    context = browser.new_context(viewport={"width": 1440, "height": 1000})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        page.goto(f"{base}/lab")
        page.get_by_test_id("key-input").fill(KEY)
        page.get_by_test_id("key-apply").click()
        page.wait_for_url("**/lab?model=llama")
        select = page.get_by_test_id("model-select")
        expect(page.get_by_test_id("model-pick")).to_be_visible()
        expect(select).to_have_value("llama")
        expect(page.get_by_test_id("live-free")).to_have_text(re.compile(r" / 32$"))  # llama's pool
        assert select.locator("option").all_inner_texts() == ["llama (loaded)", "qwen (loaded)"]
        select.select_option("qwen")
        page.wait_for_url("**/lab?model=qwen")
        expect(page.get_by_test_id("model-select")).to_have_value("qwen")
        expect(page.get_by_test_id("live-free")).to_have_text(re.compile(r" / 48$"))  # qwen's
        expect(page.get_by_test_id("banner")).to_be_hidden()
    finally:
        context.close()
    assert errors == []
