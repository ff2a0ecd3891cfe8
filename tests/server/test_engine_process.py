"""The engine in a process of its own (`minivllm.engine.runtime.engine_process`): what only a second
process can do wrong. (The endpoints run against it in test_server.py; `minivllm serve`'s
shutdown, which uses it by default, in test_reliability_shutdown.py.)"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.engine_checks import run_to_completion

from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.runtime import tokenizer_load
from minivllm.engine.runtime.engine_process import EngineProcess, start_engine_process
from minivllm.sampling_params import SamplingParams
from minivllm.server import ServerThread, create_app


def _options(model_dir: Path) -> dict:
    return dict(
        model=str(model_dir),
        max_model_len=2048,
        num_kv_blocks=256,
        block_size=16,
        device="cpu",
        dtype="float32",
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def live(tiny_llama_long_dir: Path) -> Iterator[tuple[str, EngineProcess]]:
    engine = EngineProcess(_options(tiny_llama_long_dir))
    app = create_app(engine, "tiny")
    with ServerThread(app) as thread:
        yield thread.base_url, engine
    assert not engine.is_running
    assert engine._process.poll() is not None, "the engine process outlived the server"


def test_outputs_equal_the_engine_run_in_this_process(tiny_llama_long_dir: Path) -> None:
    """Greedy fp32 completions through the engine process are the texts an LLMEngine of this
    process generates for the same prompts (n=2 choices and a batch of prompts included)."""
    prompts = [[1, 5, 9, 2], [7, 7, 3], [4, 8, 15, 16, 23]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    local = LLMEngine.from_options(**_options(tiny_llama_long_dir))
    for i, prompt in enumerate(prompts):
        local.add_request(prompt, params, request_id=str(i))
    finals = run_to_completion(local, check=False)  # its text through an OutputProcessor
    want = [finals[str(i)].outputs[0].text for i in range(len(prompts))]

    engine = EngineProcess(_options(tiny_llama_long_dir))
    with ServerThread(create_app(engine, "tiny")) as thread:
        body = {
            "model": "tiny",
            "prompt": prompts,
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "n": 2,
        }
        r = httpx.post(f"{thread.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in choices] == [text for text in want for _ in range(2)]
    assert all(c["finish_reason"] == "length" for c in choices)


def test_a_dead_engine_process_ends_requests_with_an_error(live) -> None:
    """The engine process killed mid-stream: the stream ends with an error event and [DONE]
    (no hang), /health turns 503, and a new request gets a 503 with an OpenAI error body."""
    base, engine = live
    body = {
        "model": "tiny",
        "prompt": "The quick brown fox",
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    events = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
            if len(events) == 3:
                os.kill(engine._process.pid, signal.SIGKILL)
    assert events[-1] == "[DONE]"
    error = next(e for e in events if isinstance(e, dict) and "error" in e)
    assert "engine process exited" in error["error"]["message"]
    assert httpx.get(f"{base}/health", timeout=5).status_code == 503
    r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_an_engine_that_cannot_start_says_why(tmp_path: Path) -> None:
    """A model that does not load: the constructor raises the engine's own exception (a bad
    input, the same as an engine built in this process would: the CLI then exits 2 with its
    one line), and no engine process is left behind."""
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        EngineProcess({"model": str(tmp_path / "no-such-model"), "device": "cpu"})


def test_a_process_started_early_is_taken_over_or_killed(tiny_llama_long_dir: Path) -> None:
    """`minivllm serve` starts the engine process before the HTTP side imports its stack: an
    EngineProcess takes that process over and serves with it; one nothing took over (the
    server failed first) is killed by `close`, not left loading a model."""
    starting = start_engine_process(_options(tiny_llama_long_dir))
    engine = EngineProcess(_options(tiny_llama_long_dir), starting=starting)
    try:
        assert engine._process is starting.process
        with ServerThread(create_app(engine, "tiny")) as thread:
            body = {"model": "tiny", "prompt": [1, 5, 9], "max_tokens": 4, "temperature": 0}
            reply = httpx.post(f"{thread.base_url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    finally:
        engine.shutdown()
    assert starting.process.poll() is not None
    orphan = start_engine_process(_options(tiny_llama_long_dir))
    orphan.close()
    assert orphan.process.poll() is not None


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread priority is Linux's")
def test_this_sides_tokenizer_loads_behind_the_engine(monkeypatch, tmp_path: Path) -> None:
    """The HTTP side's tokenizer loads at the lowest CPU priority, on a thread of its own (the
    engine's load, beside it on a 2-core CPU, is what the start-up waits for); this thread's
    priority stays, and the load's own failure reaches the caller."""
    import threading

    from minivllm import tokenizer

    seen = {}

    def load(model_dir):
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        if model_dir.name == "broken":
            raise ValueError("no tokenizer files")
        return "a tokenizer"

    monkeypatch.setattr(tokenizer, "load_tokenizer", load)
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert tokenizer_load.load_tokenizer_behind_the_engine(tmp_path) == "a tokenizer"
    assert seen["nice"] == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
    with pytest.raises(ValueError, match="no tokenizer files"):
        tokenizer_load.load_tokenizer_behind_the_engine(tmp_path / "broken")


def test_this_side_foresees_the_directory_of_a_converted_gguf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the engine will name a directory this side can find without torch (a model
    directory, a GGUF converted at an earlier start), its tokenizer starts loading with the
    engine process; used only if the engine names that directory."""
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    assert tokenizer_load.predicted_model_dir(str(model)) is None  # no config.json
    (model / "config.json").write_text("{}")
    assert tokenizer_load.predicted_model_dir(str(model)) == model
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert tokenizer_load.predicted_model_dir(str(gguf)) is None  # never converted
    converted = tokenizer_load.gguf_cached_dir(gguf)
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")
    assert tokenizer_load.predicted_model_dir(str(gguf)) == converted
    assert tokenizer_load.predicted_model_dir(None) is None  # the default model
    assert tokenizer_load.predicted_model_dir(str(tmp_path / "missing")) is None

    loaded = []
    monkeypatch.setattr("minivllm.tokenizer.load_tokenizer", lambda d: loaded.append(d) or d)
    early = tokenizer_load.TokenizerLoad(converted)
    assert early.serves(converted) and not early.serves(model)
    assert early.result() == converted and loaded == [converted]


def test_this_side_loads_the_tokenizer_the_engine_resolved(tmp_path: Path, tiny_llama_long_dir):
    """The engine names its model's directory first and this side loads the tokenizer from it
    while the engine builds: it encodes as the engine's own does. A model whose directory
    resolves but whose weights are missing still fails with the engine's own exception."""
    import shutil

    engine = EngineProcess(_options(tiny_llama_long_dir))
    try:
        local = LLMEngine.from_options(**_options(tiny_llama_long_dir))
        text = "The quick brown fox, 12 x 7 = 84."
        assert engine.tokenizer.encode(text) == local.tokenizer.encode(text)
    finally:
        engine.shutdown()
    broken = tmp_path / "no-weights"
    shutil.copytree(tiny_llama_long_dir, broken)
    for weights in broken.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises((FileNotFoundError, RuntimeError, ValueError), match="safetensors|weights"):
        EngineProcess(_options(broken))


def test_the_engine_process_stops_when_the_server_dies(tiny_llama_long_dir: Path) -> None:
    """An HTTP process killed outright (SIGKILL: no shutdown ran) leaves no engine process
    behind: it sees its end of the pipe close and exits."""
    script = textwrap.dedent(f"""
        import sys, time
        from minivllm.engine.runtime.engine_process import EngineProcess
        engine = EngineProcess({_options(tiny_llama_long_dir)!r})
        engine.start()
        print(engine._process.pid, flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(proc.stdout.readline())
        assert _alive(engine_pid)
        proc.kill()
        proc.wait()
        assert _wait_gone(engine_pid, 20), "the engine process outlived its server"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_cpu_engine_process_does_not_load_triton(tiny_llama_long_dir: Path) -> None:
    """torch's compiler imports triton wherever it is installed; the CPU engine process, which
    compiles its decode step (bf16) and never runs a Triton kernel, leaves it unloaded."""
    if not Path("/proc/self/maps").exists():
        pytest.skip("reads /proc/PID/maps")
    pytest.importorskip("triton")
    engine = EngineProcess({**_options(tiny_llama_long_dir), "dtype": "bfloat16"})
    try:
        with ServerThread(create_app(engine, "tiny")) as thread:
            body = {"model": "tiny", "prompt": "x", "max_tokens": 3, "temperature": 0}
            r = httpx.post(f"{thread.base_url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            maps = Path(f"/proc/{engine._process.pid}/maps").read_text()
    finally:
        engine.close()
    assert "libtorch_cpu" in maps
    assert "libtriton" not in maps


def test_the_engine_process_logs_at_this_sides_level(
    tiny_llama_long_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """`minivllm -v serve`: the engine process's INFO lines (its memory line) show at this
    process's level; without it only the start-up phases do (minivllm/startup.py), each
    naming its model."""
    root = logging.getLogger()
    before = root.level
    for level, shown in ((logging.INFO, True), (logging.WARNING, False)):
        root.setLevel(level)
        try:
            EngineProcess(_options(tiny_llama_long_dir)).close()
        finally:
            root.setLevel(before)
        err = capfd.readouterr().err
        named = f"[{tiny_llama_long_dir.name}]:"
        assert (f"minivllm.engine.model_runner {named} memory:" in err) is shown, err
        assert f"INFO minivllm.startup {named} loading the weights ..." in err, err
