"""`minivllm serve --lab` end to end: a live server on the tiny random Llama, under load from the
official openai client, its /lab/api JSON, and the live page in headless Chromium.

The KV pool is tiny (16 blocks of 4 tokens for up to 4 running requests of ~40 tokens), so
the load preempts. The browser tests skip when Debian's chromium is missing, unless
MINIVLLM_REQUIRE_BROWSER=1; MINIVLLM_LAB_SCREENSHOT=1 refreshes docs/live_lab.png.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from support.fake_runner import FakeModelRunner
from support.server_helpers import scrape_metrics

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.lab.live import REQUEST_FIELDS, TIMELINE_FIELDS
from minivllm.paging import blocks_for
from minivllm.server import ServerThread, create_app

KEY = "live-key"
MODEL = "tiny-llama"
BLOCK_SIZE = 4
PROMPTS = ["The quick brown fox", "Hello, world!", "Once upon a time"]
DOCS_SHOT = Path(__file__).resolve().parents[2] / "docs" / "live_lab.png"


class PacedRunner:
    """The real runner, `pace` seconds slower per step (0 unless a test slows the engine so
    that what it compares stays still for a while)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.num_kv_blocks = runner.num_kv_blocks
        self.vocab_size = runner.vocab_size
        self.pace = 0.0

    def run(self, batch, token_bitmask=None):
        if self.pace:
            time.sleep(self.pace)
        return self.runner.run(batch, token_bitmask)


@dataclass
class LiveServer:
    base_url: str
    client: openai.OpenAI
    runner: PacedRunner

    def get(self, path: str, key: str | None = KEY) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(f"{self.base_url}{path}", headers=headers, timeout=30)

    @contextlib.contextmanager
    def load(self, concurrency: int, max_tokens: int = 30) -> Iterator[list[int]]:
        """`concurrency` clients sending completions back to back until the block ends;
        yields the list of finished-request counts (one shared counter)."""
        stop = threading.Event()
        done = [0]

        def client(i: int) -> None:
            while not stop.is_set():
                self.client.completions.create(
                    model=MODEL,
                    prompt=PROMPTS[i % len(PROMPTS)],
                    max_tokens=max_tokens + i,
                    extra_body={"ignore_eos": True},
                )
                done[0] += 1

        threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
        for t in threads:
            t.start()
        try:
            yield done
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)


@pytest.fixture(scope="module")
def live(tiny_llama_dir: Path) -> Iterator[LiveServer]:
    base = LLMEngine.from_options(
        model=str(tiny_llama_dir),
        max_model_len=64,
        num_kv_blocks=16,
        block_size=BLOCK_SIZE,
        max_num_seqs=4,
        device="cpu",
    )
    runner = PacedRunner(base.model_runner)
    engine = LLMEngine(base.config, runner, base.tokenizer)
    app = create_app(engine, MODEL, api_key=KEY, lab=True)
    with ServerThread(app) as thread:
        client = openai.OpenAI(
            base_url=f"{thread.base_url}/v1", api_key=KEY, max_retries=0, timeout=60
        )
        yield LiveServer(thread.base_url, client, runner)
        client.close()


def check_snapshot(snap: dict) -> None:
    """The issue's shape, and the state machine's invariants for every request."""
    assert set(snap) == {"step", "requests", "kv_cache", "num_preemptions", "timeline"}
    assert set(snap["kv_cache"]) == {"num_blocks", "num_free_blocks"}
    for r in snap["requests"]:
        assert tuple(r) == REQUEST_FIELDS
        assert r["status"] in ("WAITING", "RUNNING"), r
        assert 0 <= r["num_cached_tokens"] <= r["num_tokens"], r
        assert r["num_scheduled_tokens"] + r["num_cached_tokens"] <= r["num_tokens"], r
        assert r["num_prompt_tokens"] <= r["num_tokens"], r
        assert len(r["block_table"]) >= blocks_for(r["num_cached_tokens"], BLOCK_SIZE), r
        if r["status"] == "WAITING":
            assert r["block_table"] == [] and r["num_cached_tokens"] == 0, r
    held = {b for r in snap["requests"] for b in r["block_table"]}
    assert len(held) <= snap["kv_cache"]["num_blocks"] - snap["kv_cache"]["num_free_blocks"]
    for entry in snap["timeline"]:
        assert tuple(entry) == TIMELINE_FIELDS
        assert entry["num_seqs"] >= 1 and entry["seconds"] > 0
        assert entry["num_prefill_tokens"] + entry["num_decode_tokens"] >= entry["num_seqs"]
    steps = [e["step"] for e in snap["timeline"]]
    assert steps == list(range(snap["step"] - len(steps) + 1, snap["step"] + 1))


def test_without_lab_nothing_is_served() -> None:
    """Without --lab, /lab and its API are 404 (OpenAI's error shape) and nothing records."""
    config = EngineConfig(block_size=4, max_model_len=64)
    app = create_app(LLMEngine(config, FakeModelRunner(8, 4)), "fake", api_key=KEY)
    client = TestClient(app)
    for path in ("/lab", "/lab/api/live", "/lab/api/frames", "/lab/static/live.js"):
        r = client.get(path, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path
    assert app.state.server.engine.recorder is None


def test_the_api_obeys_the_key(live: LiveServer) -> None:
    """No key or a wrong key: 401 in OpenAI's shape; the page itself (no data) loads."""
    for key in (None, "wrong"):
        for path in ("/lab/api/live", "/lab/api/frames?after=-1"):
            r = live.get(path, key)
            assert r.status_code == 401, (path, key)
            assert r.json()["error"]["type"] == "authentication_error"
    assert live.get("/lab/api/live").status_code == 200
    page = live.get("/lab", None)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert live.get("/lab/static/live.js", None).status_code == 200
    assert live.get("/lab/static/../app.py", None).status_code == 404
    assert live.get("/lab/api/frames?after=x").status_code == 400


def test_snapshots_keep_the_invariants_and_show_preemption(live: LiveServer) -> None:
    """Under load on a tiny pool, every snapshot keeps the invariants; a preemption shows in
    the timeline (the request it hit) and in that request's history: RUNNING, then WAITING
    with nothing cached and no blocks, then RUNNING again."""
    before = live.get("/lab/api/live").json()["num_preemptions"]
    with live.load(concurrency=6) as done:
        deadline = time.monotonic() + 60
        while done[0] < 12 and time.monotonic() < deadline:
            check_snapshot(live.get("/lab/api/live").json())
            time.sleep(0.01)
        frames = live.get("/lab/api/frames?after=-1").json()["frames"]
    snap = live.get("/lab/api/live").json()
    check_snapshot(snap)
    assert snap["num_preemptions"] > before
    hit = next((f for f in frames[1:] if f["timeline"] and f["timeline"]["preempted"]), None)
    assert hit is not None, "no preemption in the recorded steps"
    victim = hit["timeline"]["preempted"][0]
    history = [next((r for r in f["requests"] if r["request_id"] == victim), None) for f in frames]
    at = frames.index(hit)
    assert history[at - 1]["status"] == "RUNNING" and history[at - 1]["num_cached_tokens"] > 0
    assert history[at]["status"] == "WAITING"
    assert history[at]["num_cached_tokens"] == 0 and history[at]["block_table"] == []
    assert any(r and r["status"] == "RUNNING" for r in history[at + 1 :]) or at == len(frames) - 1


def test_cli_serve_lab(tiny_llama_dir: Path) -> None:
    """The real `minivllm serve --lab --api-key` in a subprocess: the page and the API on the
    server's own port, the key enforced; SIGTERM stops it cleanly."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cli = Path(sys.executable).parent / "minivllm"
    cmd = [
        str(cli),
        "serve",
        "--lab",
        "--api-key",
        KEY,
        "--model",
        str(tiny_llama_dir),
        "--served-model-name",
        MODEL,
        "--port",
        str(port),
        "--device",
        "cpu",
        "--num-kv-blocks",
        "32",
        "--max-model-len",
        "64",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stderr.read()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not become healthy"
            time.sleep(0.1)
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}
        r = httpx.post(f"{base}/v1/completions", json=body, headers=auth, timeout=60)
        assert r.status_code == 200
        assert httpx.get(f"{base}/lab").status_code == 200
        assert httpx.get(f"{base}/lab/api/live").status_code == 401
        snap = httpx.get(f"{base}/lab/api/live", headers=auth).json()
        check_snapshot(snap)
        assert snap["step"] >= 3 and snap["requests"] == []
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert f"live Engine Lab on http://127.0.0.1:{port}/lab" in err


# ---- the page in headless Chromium --------------------------------------------------------

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser():
    problem = None if Path(CHROMIUM).exists() else f"chromium not found at {CHROMIUM}"
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        problem = "python playwright is not installed"
    if problem is not None:
        if os.environ.get("MINIVLLM_REQUIRE_BROWSER") == "1":
            pytest.fail(f"MINIVLLM_REQUIRE_BROWSER=1 but {problem}")
        pytest.skip(problem)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"]
        )
        yield browser
        browser.close()


@contextlib.contextmanager
def open_page(browser, live: LiveServer, key: str, locale: str = "en-US"):
    context = browser.new_context(locale=locale, viewport={"width": 1440, "height": 1000})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{live.base_url}/lab")
    page.wait_for_selector('body[data-ready="1"]')
    page.get_by_test_id("key-input").fill(key)
    page.get_by_test_id("key-apply").click()
    try:
        yield page
    finally:
        context.close()  # its poll stops before the server does
    assert errors == []


def _count(page, test_id: str) -> int:
    return int(page.get_by_test_id(test_id).inner_text())


def test_page_counts_agree_with_metrics(live: LiveServer, browser) -> None:
    """Under load, the running and waiting counts the page shows are /metrics' counts (read
    while /metrics holds still; each step is slowed to 30 ms so that happens)."""
    live.runner.pace = 0.03
    try:
        with live.load(concurrency=6), open_page(browser, live, KEY) as page:
            deadline = time.monotonic() + 30
            agreed = None
            while agreed is None and time.monotonic() < deadline:
                m1 = scrape_metrics(live.base_url)
                shown = (_count(page, "live-running"), _count(page, "live-waiting"))
                m2 = scrape_metrics(live.base_url)
                counts = [
                    (m["minivllm:num_requests_running"], m["minivllm:num_requests_waiting"])
                    for m in (m1, m2)
                ]
                if counts[0] == counts[1] == shown and shown[0] > 0:
                    agreed = shown
                time.sleep(0.05)
            assert agreed is not None, f"the page never showed /metrics' counts {counts}"
    finally:
        live.runner.pace = 0.0


def test_page_shows_a_preemption_and_follows_its_request(live: LiveServer, browser) -> None:
    """A preemption is a red mark on the timeline; clicking it pauses there and opens that
    request's history, whose row says it was preempted. The zh switch relabels the page."""
    from playwright.sync_api import expect

    with open_page(browser, live, KEY) as page:
        shot = os.environ.get("MINIVLLM_LAB_SCREENSHOT") == "1"
        with live.load(concurrency=6):
            expect(page.get_by_test_id("preempt-mark").first).to_be_attached(timeout=30_000)
            while shot and int(page.get_by_test_id("live-step").inner_text()) < 80:
                time.sleep(0.1)  # the picture for the README: a longer timeline
            page.get_by_test_id("btn-pause").click()
        mark = page.get_by_test_id("preempt-mark").first
        victim = mark.get_attribute("data-requests").split()[0]
        mark.dispatch_event("click")
        expect(page.get_by_test_id("mode")).to_have_text("paused")
        expect(page.get_by_test_id("history-id")).to_have_text(victim)
        expect(
            page.locator('[data-testid="history-row"][data-event="ev_preempted"]')
        ).not_to_have_count(0)
        expect(page.get_by_test_id("history-preempt").first).to_be_attached()
        expect(page.get_by_test_id("timeline").locator(".col.at")).to_have_count(1)
        if shot:
            marks = page.get_by_test_id("preempt-mark")
            marks.nth(marks.count() // 2).dispatch_event("click")
            page.screenshot(path=str(DOCS_SHOT), full_page=True)
        page.get_by_test_id("lang-toggle").click()
        expect(page.get_by_test_id("mode")).to_have_text("已暂停")
        expect(page.locator("h2").first).to_have_text("步骤时间线")
        page.get_by_test_id("lang-toggle").click()


def test_page_with_a_wrong_key_shows_the_401(live: LiveServer, browser) -> None:
    """A wrong key in the page: the server's 401 message in a banner, no data shown."""
    from playwright.sync_api import expect

    with open_page(browser, live, "not-the-key") as page:
        banner = page.get_by_test_id("banner")
        expect(banner).to_be_visible()
        expect(banner).to_contain_text(re.compile("missing or wrong API key"))
        expect(page.get_by_test_id("live-step")).to_have_text("0")
