"""`minivllm serve` stops cleanly: the real CLI in a subprocess on the tiny checkpoint.

The contract (minivllm/server/serve.py): on SIGTERM or SIGINT the listener closes at once,
requests in flight get `--shutdown-timeout` seconds to finish, the rest end with an error they
can read (an `aborted` error event, then `[DONE]`), and the process exits 0 with no traceback
and no process left behind in its process group.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from support.model_fixtures import LONG_CONTEXT

SHUTDOWN_TIMEOUT_S = 1.0
# Cannot finish within the grace period, even on a fast machine (at 0.5 ms a step it needs 4 s):
# it must get the error event. The checkpoint's context is stretched to hold it.
LONG_TOKENS = 8000
MAX_MODEL_LEN = LONG_CONTEXT
NUM_LONG = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class _StreamResult:
    events: list = field(default_factory=list)
    error: BaseException | None = None

    @property
    def finish(self) -> str | None:
        """ "length"/"stop" when it completed, "aborted" on the shutdown's error event."""
        for event in self.events:
            if isinstance(event, dict) and "error" in event:
                return event["error"]["code"]
        reasons = [
            c["finish_reason"]
            for e in self.events
            if isinstance(e, dict)
            for c in e.get("choices", [])
            if c["finish_reason"]
        ]
        return reasons[-1] if reasons else None


def _stream(base: str, max_tokens: int, out: _StreamResult, started: threading.Event) -> None:
    body = {
        "prompt": "The quick brown fox",
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: ") :]
                    out.events.append(data if data == "[DONE]" else json.loads(data))
                    started.set()
    except BaseException as exc:  # recorded, asserted by the test
        out.error = exc
        started.set()


def _start_server(model_dir: Path, port: int) -> subprocess.Popen:
    cli = Path(sys.executable).parent / "minivllm"
    cmd = [
        str(cli),
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--device",
        "cpu",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--num-kv-blocks",
        str((NUM_LONG + 1) * (MAX_MODEL_LEN // 16 + 1)),
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT_S),
    ]
    # Its own session, so that the test can signal (and then probe) the whole process group.
    # One intra-op thread: on a busy 2-core machine spinning OpenMP threads slow it 20x.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
    )


def _wait_healthy(proc: subprocess.Popen, base: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited early:\n{proc.stderr.read()}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("the server did not become healthy")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_stops_cleanly_on_signal(tiny_llama_long_dir: Path, sig: signal.Signals) -> None:
    """Under load, SIGTERM and Ctrl-C (SIGINT to the process group) both stop `serve`: a short
    in-flight request finishes, long ones get the `aborted` error event and `[DONE]`, new
    connections are refused, the exit code is 0, stderr has no traceback or error line, and
    no process of the server's group survives."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _start_server(tiny_llama_long_dir, port)
    try:
        _wait_healthy(proc, base)
        longs = [_StreamResult() for _ in range(NUM_LONG)]
        short = _StreamResult()
        threads = []
        for result, max_tokens in [*((r, LONG_TOKENS) for r in longs), (short, 3)]:
            started = threading.Event()
            t = threading.Thread(target=_stream, args=(base, max_tokens, result, started))
            t.start()
            assert started.wait(60), "no first event"
            threads.append(t)
        os.killpg(proc.pid, sig)
        signalled = time.monotonic()
        time.sleep(0.3)
        with pytest.raises(httpx.TransportError):  # the listener is closed at once
            httpx.get(f"{base}/health", timeout=2)
        for t in threads:
            t.join(30)
        rc = proc.wait(30)
        took = time.monotonic() - signalled
        stderr = proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert rc == 0, stderr
    assert "Traceback" not in stderr and " ERROR " not in stderr and "ERROR " not in stderr, stderr
    # the start said what it was doing as each phase began (minivllm/startup.py), for which model
    for what in ("importing torch", "loading the tokenizer", "loading the weights"):
        assert f"INFO minivllm.startup [{tiny_llama_long_dir.name}]: {what} ..." in stderr, stderr
    assert took < SHUTDOWN_TIMEOUT_S + 10, took
    assert not _group_alive(proc.pid), "a process of the server's group outlived it"
    assert short.error is None and short.finish == "length" and short.events[-1] == "[DONE]"
    for result in longs:
        assert result.error is None, result.error
        assert result.events[-1] == "[DONE]"
        assert result.finish in ("length", "aborted"), result.events[-3:]
    aborted = [r for r in longs if r.finish == "aborted"]
    assert aborted, "every long request finished within the grace period: raise LONG_TOKENS"
    message = next(e for e in aborted[0].events if isinstance(e, dict) and "error" in e)
    assert "shutting down" in message["error"]["message"]
