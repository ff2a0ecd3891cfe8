"""vllm-router (cache-aware policy) in front of two `minivllm serve` processes, on loopback:
requests that share a long prefix go to the worker that cached it (its `cached_tokens` show
the hit), requests with other prefixes spread over both. Marked `scale`: `make test-scale`.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from support.server_helpers import scrape_metrics

pytestmark = pytest.mark.scale

MODEL = "tiny-llama"
ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
SHARED = "System: you are a careful assistant who answers with numbers only. " * 6
OTHERS = [
    "Once upon a time there was a tiny language model that loved numbers. " * 6,
    "The quick brown fox jumps over the lazy dog while counting 0 1 2 3 4 5. " * 6,
    "Hello world, this prompt starts with something else entirely, 9 8 7 6. " * 6,
    "Numbers only: 5 4 3 2 1 0, then a tiny model says hello to the world. " * 6,
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, procs: list[subprocess.Popen], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            assert p.poll() is None, f"{p.args[:2]} exited with {p.returncode}"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} not ready in {timeout}s"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster(tiny_llama_long_dir: Path) -> Iterator[tuple[str, list[str]]]:
    """(the router's URL, the two workers' URLs)."""
    if not Path(ROUTER).exists():
        pytest.skip("vllm-router is not installed (pip install 'minivllm[routers]')")
    procs: list[subprocess.Popen] = []
    workers = []
    try:
        for _ in range(2):
            port = _free_port()
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "minivllm.cli",
                        "serve",
                        str(tiny_llama_long_dir),
                        "--port",
                        str(port),
                        "--served-model-name",
                        MODEL,
                        "--device",
                        "cpu",
                        "--dtype",
                        "float32",
                        "--max-model-len",
                        "4096",
                        "--num-kv-blocks",
                        "512",
                        "--block-size",
                        "16",
                        "--enforce-eager",
                    ]
                )
            )
            workers.append(f"http://127.0.0.1:{port}")
        for url in workers:
            _wait_ready(f"{url}/health", procs)
        port = _free_port()
        procs.append(
            subprocess.Popen(
                [
                    ROUTER,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--policy",
                    "cache_aware",
                    "--worker-urls",
                    *workers,
                    "--log-level",
                    "warning",
                    # its own /metrics listener, on a free port (the default one may be taken)
                    "--prometheus-host",
                    "127.0.0.1",
                    "--prometheus-port",
                    str(_free_port()),
                ],
                stdout=subprocess.DEVNULL,
            )
        )
        router = f"http://127.0.0.1:{port}"
        _wait_ready(f"{router}/v1/models", procs)
        yield router, workers
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def _served(workers: list[str]) -> list[float]:
    return [scrape_metrics(w)["minivllm:e2e_request_latency_seconds_count"] for w in workers]


def _post(router: str, prompt: str, max_tokens: int) -> dict:
    r = httpx.post(
        f"{router}/v1/completions",
        timeout=120,
        json={
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def _complete(router: str, workers: list[str], prompt: str) -> tuple[int, int]:
    """Send one completion through the router: (the worker that served it, cached_tokens)."""
    before = _served(workers)
    usage = _post(router, prompt, 4)["usage"]
    after = _served(workers)
    [index] = [i for i, (a, b) in enumerate(zip(before, after)) if b > a]
    return index, usage["prompt_tokens_details"]["cached_tokens"]


def test_shared_prefix_sticks_and_other_prefixes_spread(
    cluster: tuple[str, list[str]],
) -> None:
    """The cache-aware policy: a prompt that matches more than half of what a worker was sent
    goes there; one that matches nothing goes to the worker with the fewest requests in
    flight (the first, on a tie), so concurrent new prefixes spread over both."""
    router, workers = cluster
    shared = [_complete(router, workers, f"{SHARED}Question {i}: ") for i in range(4)]
    home = shared[0][0]
    assert all(worker == home for worker, _ in shared), shared
    # The first request filled the prefix cache; each later one reads the shared prefix back.
    assert shared[0][1] == 0
    assert all(cached >= 16 for _, cached in shared[1:]), shared
    before = _served(workers)
    with ThreadPoolExecutor(len(OTHERS)) as pool:
        list(pool.map(lambda prompt: _post(router, prompt, 64), OTHERS))
    after = _served(workers)
    assert all(b > a for a, b in zip(before, after)), (before, after)
