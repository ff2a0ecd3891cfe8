"""The multi-model server's registry (`minivllm.server.model_registry`) on fake engines, in
milliseconds: which model is evicted, who waits and who fails. (The HTTP server over real
engine processes: test_multi_model.py.)"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from minivllm.server.model_registry import (
    ModelBusyError,
    ModelRegistry,
    ModelState,
    ModelUnavailableError,
    RegistryLimits,
    UnknownModelError,
)
from minivllm.server.model_specs import ModelSpec, model_specs


class FakeClient:
    """An engine that is running until shut down (or `die()`d)."""

    def __init__(self, spec: ModelSpec) -> None:
        self.name = spec.name
        self.is_running = True
        self.stats: dict[str, float] = {}

    def shutdown(self, timeout: float = 10.0) -> None:
        self.is_running = False

    def close(self) -> None:
        self.is_running = False

    def stop_accepting(self) -> None: ...

    def abort_all(self) -> None: ...


class Starter:
    """Starts FakeClients, each load held until `gate` opens; records the loads' order."""

    def __init__(self, fail: set[str] | None = None) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.loads: list[str] = []
        self.fail = fail or set()

    def __call__(self, spec: ModelSpec) -> Any:
        self.gate.wait(5)
        self.loads.append(spec.name)
        if spec.name in self.fail:
            raise RuntimeError(f"{spec.name} is broken")
        return FakeClient(spec)


def _registry(names: str, starter: Starter, **limits: Any) -> ModelRegistry:
    specs = [ModelSpec(n, {"model": None}) for n in names]
    return ModelRegistry(specs, RegistryLimits(**limits), start_client=starter)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_lru_idle_model_is_evicted_never_a_busy_one() -> None:
    """Under max_loaded_models=2 a third model evicts the least recently used idle model; a
    model holding a lease is skipped even when it was loaded first."""

    async def main() -> None:
        starter = Starter()
        reg = _registry("abc", starter, max_loaded_models=2)
        await reg.start()
        busy = await reg.acquire("a")  # a: oldest, but in flight
        (await reg.acquire("b")).release()
        (await reg.acquire("c")).release()
        states = {n: e.state for n, e in reg.entries.items()}
        assert states == {"a": ModelState.LOADED, "b": ModelState.UNLOADED, "c": ModelState.LOADED}
        busy.release()  # a's last use is its release: c is now the least recently used
        (await reg.acquire("b")).release()
        assert reg.entries["c"].state is ModelState.UNLOADED
        assert reg.entries["a"].state is ModelState.LOADED
        assert starter.loads == ["a", "b", "c", "b"]
        await reg.shutdown()

    run(main())


def test_load_waits_for_room_and_times_out_when_none_frees() -> None:
    """With every loaded model busy a load waits; it proceeds once one is released, and
    fails with ModelUnavailableError (not a hang) when none is within the timeout."""

    async def main() -> None:
        reg = _registry("ab", Starter(), max_loaded_models=1, load_timeout_s=0.3)
        await reg.start()
        lease = await reg.acquire("a")
        with pytest.raises(ModelUnavailableError, match="did not load within 0.3 s"):
            await reg.acquire("b")
        await asyncio.sleep(0.05)
        assert reg.entries["b"].state is ModelState.UNLOADED
        assert "no room" in (reg.entries["b"].error or "")
        waiter = asyncio.create_task(reg.acquire("b"))
        await asyncio.sleep(0.05)
        lease.release()
        (await waiter).release()
        assert reg.entries["b"].state is ModelState.LOADED
        await reg.shutdown()

    run(main())


def test_requests_wait_for_a_loading_model_and_count_as_waiting() -> None:
    """Requests for a model being loaded share its one load and are counted as waiting;
    another model's requests are served meanwhile."""

    async def main() -> None:
        starter = Starter()
        reg = _registry("ab", starter)
        await reg.start()
        (await reg.acquire("b")).release()
        starter.gate.clear()
        waiters = [asyncio.create_task(reg.acquire("a")) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert reg.entries["a"].state is ModelState.LOADING
        assert reg.entries["a"].waiting == 3
        (await reg.acquire("b")).release()  # not held up by a's load
        starter.gate.set()
        for lease in await asyncio.gather(*waiters):
            lease.release()
        assert starter.loads == ["b", "a"]
        await reg.shutdown()

    run(main())


def test_a_failed_load_fails_only_its_model_and_is_retried() -> None:
    """A load that raises fails its own requests (ModelUnavailableError, state failed with
    the reason); the other model is unaffected; the next request tries again."""

    async def main() -> None:
        starter = Starter(fail={"a"})
        reg = _registry("ab", starter)
        await reg.start()
        with pytest.raises(ModelUnavailableError, match="a is broken"):
            await reg.acquire("a")
        assert reg.entries["a"].state is ModelState.FAILED
        assert "a is broken" in (reg.entries["a"].error or "")
        (await reg.acquire("b")).release()
        starter.fail.clear()
        (await reg.acquire("a")).release()
        assert reg.entries["a"].state is ModelState.LOADED
        await reg.shutdown()

    run(main())


def test_dead_engine_is_failed_then_reloaded() -> None:
    """A loaded model whose engine stopped running is marked failed and loaded again by the
    next request."""

    async def main() -> None:
        starter = Starter()
        reg = _registry("a", starter)
        await reg.start()
        lease = await reg.acquire("a")
        lease.release()
        lease.client.is_running = False  # type: ignore[misc]
        (await reg.acquire("a")).release()
        assert starter.loads == ["a", "a"]
        await reg.shutdown()

    run(main())


def test_idle_unload_memory_budget_unknown_names_and_busy_unload() -> None:
    """An idle model is unloaded after idle_unload_s; the memory budget evicts like the
    count; an unknown name lists the names; unloading a busy model is refused."""

    async def main() -> None:
        reg = _registry("ab", Starter(), idle_unload_s=0.2, memory_bytes=100)
        for entry in reg.entries.values():
            entry.measured_bytes = 60  # two do not fit in 100
        await reg.start()
        (await reg.acquire("a")).release()
        lease = await reg.acquire("b")
        assert reg.entries["a"].state is ModelState.UNLOADED
        with pytest.raises(ModelBusyError):
            await reg.unload("b")
        lease.release()
        await asyncio.sleep(0.6)
        assert reg.entries["b"].state is ModelState.UNLOADED
        with pytest.raises(UnknownModelError, match=r"\['a', 'b'\]"):
            await reg.acquire("nope")
        await reg.shutdown()

    run(main())


def test_models_dir_names_files_and_reads_models_json(tmp_path: Path) -> None:
    """--models-dir: a .gguf is named by its stem, an HF directory by its name; a models.json
    lists the models instead, with their own engine options over the command line's; a
    duplicate name and bad options are errors that say what to change."""
    (tmp_path / "small.gguf").write_bytes(b"x" * 10)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("")
    specs = model_specs([], str(tmp_path), {"max_model_len": 64})
    assert [(s.name, s.engine_options["model"]) for s in specs] == [
        ("hf", str(tmp_path / "hf")),
        ("small", str(tmp_path / "small.gguf")),
    ]
    assert specs[1].estimated_bytes() == 10
    with pytest.raises(ValueError, match="two models are named 'small'"):
        model_specs([str(tmp_path / "small.gguf")], str(tmp_path), {})
    listing = {"chat": {"path": "small.gguf", "max_model_len": 128}, "other": "hf"}
    (tmp_path / "models.json").write_text(json.dumps(listing))
    specs = model_specs([], str(tmp_path), {"max_model_len": 64, "seed": 3})
    assert [s.name for s in specs] == ["chat", "other"]
    assert specs[0].engine_options["max_model_len"] == 128
    assert specs[0].engine_options["seed"] == 3
    (tmp_path / "models.json").write_text(json.dumps({"x": {"path": "hf", "bogus": 1}}))
    with pytest.raises(ValueError, match="'x'.*bogus"):
        model_specs([], str(tmp_path), {})


def test_cli_one_model_is_todays_server_several_are_the_multi_model_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`minivllm serve --model A` still reaches the one-model server with model=A (a string);
    `--model A --model B` and `--models-dir` reach the multi-model server, with its limits."""
    import importlib

    from minivllm import cli
    from minivllm.server import multi_serve

    serve = importlib.import_module("minivllm.server.serve")  # the package exports a `serve`

    from minivllm.engine.runtime import engine_process

    class Starting:  # the engine process `minivllm serve` starts first, not started here
        closed = False

        def close(self) -> None:
            self.closed = True

    started: list[Starting] = []
    monkeypatch.setattr(
        engine_process,
        "start_engine_process",
        lambda options: started.append(Starting()) or started[-1],
    )
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(
        serve,
        "serve",
        lambda args, options, starting: calls.append(("one", options)) or starting is started[-1],
    )
    monkeypatch.setattr(
        multi_serve, "serve_models", lambda args, options: calls.append(("multi", args))
    )
    parser = cli.build_parser()
    for argv in (["serve", "--model", "a.gguf"], ["serve", "a.gguf"], ["serve"]):
        args = parser.parse_args(argv)
        args.func(args)
    assert calls == [("one", {"model": "a.gguf"}), ("one", {"model": "a.gguf"}), ("one", {})]
    assert len(started) == 3 and all(s.closed for s in started)  # none left behind
    calls.clear()
    argv = "serve --model a.gguf --model b.gguf --max-loaded-models 1 --models-memory-gb 2"
    args = parser.parse_args(argv.split())
    args.func(args)
    ((kind, got),) = calls
    assert kind == "multi" and got.model == ["a.gguf", "b.gguf"]
    assert len(started) == 3  # the multi-model server starts its engines itself
    limits = multi_serve.registry_limits(got)
    assert limits.max_loaded_models == 1 and limits.memory_bytes == 2_000_000_000
