"""ModelRegistry: the models one server may serve, each loaded on demand into an engine of
its own (an EngineProcess by default) and unloaded when it makes room or sits idle.

The rules (docs/multi-model.md):
- A model is unloaded, loading, loaded or failed. A request for a model that is not loaded
  loads it; requests for a model that is loading wait for it (up to `load_timeout_s`), and a
  load only ever fails the requests of its own model.
- At most `max_loaded_models` engines (loading ones count), and at most `memory_bytes` of
  them: to make room, the least recently used IDLE model (no request in flight, none
  waiting) is unloaded; a model with requests in flight is never evicted, so a load waits
  for one to become idle (up to `load_timeout_s`).
- A loaded model nobody used for `idle_unload_s` is unloaded.
- A loaded model whose engine died is failed: its own requests have ended with an error, and
  the next request loads it again.

Everything here runs on the server's event loop; the blocking parts (starting an engine,
stopping one) run on worker threads, so other models' requests go on meanwhile. Nothing here
knows HTTP: `acquire` returns a Lease, the caller releases it when the request ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from minivllm.engine.runtime.engine_client import EngineClient
from minivllm.server.model_specs import ModelSpec

logger = logging.getLogger("minivllm.server")


class ModelState(str, enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    FAILED = "failed"


class UnknownModelError(LookupError):
    """A name the registry does not hold; `names` lists the ones it does."""

    def __init__(self, name: object, names: list[str]) -> None:
        super().__init__(f"the model {name!r} does not exist; this server serves {names}")
        self.names = names


class ModelUnavailableError(RuntimeError):
    """The model could not be made ready for a request (its load failed, or timed out)."""


class ModelBusyError(RuntimeError):
    """An explicit unload of a model with requests in flight."""


@dataclass(eq=False)
class ModelEntry:
    """A model's runtime state; the registry alone writes it."""

    spec: ModelSpec
    state: ModelState = ModelState.UNLOADED
    client: EngineClient | None = None
    error: str | None = None  # why the last load failed, or the engine died
    in_flight: int = 0  # leases not yet released
    waiting: int = 0  # requests waiting for this model to load
    last_used: float = 0.0  # time.monotonic() of the last acquire or release
    loads: int = 0  # completed loads since the server started
    last_load_s: float | None = None  # seconds the last completed load took
    measured_bytes: int | None = None  # weights + KV pool, read from the engine once loaded
    holds_slot: bool = False  # counts against the limits: loaded, or loading past _make_room
    load_task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def idle(self) -> bool:
        return self.in_flight == 0 and self.waiting == 0

    @property
    def memory_bytes(self) -> int:
        if self.measured_bytes is not None:
            return self.measured_bytes
        return self.spec.estimated_bytes()


class Lease:
    """One request's hold on a loaded model: the model is not evicted until it is released
    (idempotent)."""

    def __init__(self, registry: ModelRegistry, entry: ModelEntry) -> None:
        assert entry.client is not None
        self.client: EngineClient = entry.client
        self.name = entry.name
        self._registry = registry
        self._entry = entry
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._registry._release(self._entry)


StartClient = Callable[[ModelSpec], EngineClient]


def start_engine_process(spec: ModelSpec) -> EngineClient:
    """The default way to load a model: an EngineProcess with its loop started."""
    from minivllm.engine.runtime.engine_process import EngineProcess

    client = EngineProcess(spec.engine_options)
    client.start()
    return client


@dataclass(frozen=True)
class RegistryLimits:
    """`minivllm serve`'s --max-loaded-models, --models-memory-gb, --idle-unload-seconds and
    --model-load-timeout (None: no limit)."""

    max_loaded_models: int | None = None
    memory_bytes: int | None = None
    idle_unload_s: float | None = None
    load_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_loaded_models is not None and self.max_loaded_models < 1:
            raise ValueError(f"max_loaded_models must be >= 1, got {self.max_loaded_models}")
        for name in ("memory_bytes", "idle_unload_s", "load_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")


class ModelRegistry:
    """The models a server serves and their engines (see the module docstring)."""

    def __init__(
        self,
        specs: Iterable[ModelSpec],
        limits: RegistryLimits | None = None,
        start_client: StartClient = start_engine_process,
    ) -> None:
        self.entries: dict[str, ModelEntry] = {}
        for spec in specs:
            if spec.name in self.entries:
                raise ValueError(f"two models are named {spec.name!r}: give each its own name")
            self.entries[spec.name] = ModelEntry(spec)
        if not self.entries:
            raise ValueError("no models to serve")
        self.limits = limits or RegistryLimits()
        self._start_client = start_client
        self._changed = asyncio.Event()  # replaced by a fresh one each time it is set
        self._watcher: asyncio.Task[None] | None = None
        self._accepting = True
        # Called with (name, client) after each load and before each unload (the HTTP side
        # builds and drops its per-model state there).
        self.on_loaded: Callable[[str, EngineClient], None] | None = None
        self.on_unloaded: Callable[[str], None] | None = None

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    def entry(self, name: object) -> ModelEntry:
        """The model named `name`; UnknownModelError if there is none."""
        if not isinstance(name, str) or name not in self.entries:
            raise UnknownModelError(name, self.names)
        return self.entries[name]

    # ---- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Start watching for idle models and dead engines (on the running event loop)."""
        self._watcher = asyncio.create_task(self._watch())

    async def shutdown(self) -> None:
        """Unload every model (requests still in flight end with finish_reason "abort")."""
        if self._watcher is not None:
            self._watcher.cancel()
        for entry in self.entries.values():
            if entry.load_task is not None:
                entry.load_task.cancel()
        clients = [self._detach(e, ModelState.UNLOADED) for e in self.entries.values()]
        await asyncio.gather(*(self._stop(c) for c in clients if c is not None))

    def stop_accepting(self) -> None:
        """Refuse new requests on every loaded model (graceful shutdown); none is loaded."""
        self._accepting = False
        for client in self._clients():
            client.stop_accepting()

    def abort_all(self) -> None:
        for client in self._clients():
            client.abort_all()

    def _clients(self) -> list[EngineClient]:
        return [e.client for e in self.entries.values() if e.client is not None]

    # ---- requests ---------------------------------------------------------------------

    async def acquire(self, name: object) -> Lease:
        """A lease on the loaded model `name`, loading it first if need be (waiting at most
        `load_timeout_s`). UnknownModelError, or ModelUnavailableError if it cannot load."""
        entry = self.entry(name)
        if not self._accepting:
            raise ModelUnavailableError("the server is shutting down")
        deadline = time.monotonic() + self.limits.load_timeout_s
        entry.waiting += 1
        try:
            while not self._check_alive(entry):
                task = self._ensure_loading(entry)
                remaining = deadline - time.monotonic()
                try:
                    await asyncio.wait_for(asyncio.shield(task), max(remaining, 0.0))
                except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
                    raise ModelUnavailableError(
                        f"the model {entry.name!r} did not load within "
                        f"{self.limits.load_timeout_s:g} s"
                    ) from None
                except Exception as exc:
                    raise ModelUnavailableError(
                        f"the model {entry.name!r} could not be loaded: {exc}"
                    ) from None
        finally:
            entry.waiting -= 1
        entry.in_flight += 1
        entry.last_used = time.monotonic()
        return Lease(self, entry)

    def _release(self, entry: ModelEntry) -> None:
        entry.in_flight -= 1
        entry.last_used = time.monotonic()
        self._notify()

    async def load(self, name: object) -> ModelEntry:
        """Load `name` (explicitly, POST /models/load) and leave it loaded and idle."""
        lease = await self.acquire(name)
        lease.release()
        return self.entries[lease.name]

    async def unload(self, name: object) -> ModelEntry:
        """Unload `name` now (POST /models/unload); ModelBusyError if requests use it."""
        entry = self.entry(name)
        if entry.state is ModelState.LOADING or not entry.idle:
            raise ModelBusyError(
                f"the model {entry.name!r} is {entry.state.value} with {entry.in_flight} "
                f"requests in flight and {entry.waiting} waiting: unload it when it is idle"
            )
        await self._stop(self._detach(entry, ModelState.UNLOADED))
        return entry

    # ---- loading and eviction ---------------------------------------------------------

    def _check_alive(self, entry: ModelEntry) -> bool:
        """Whether `entry` is loaded with a running engine; a dead one is marked failed."""
        if entry.state is not ModelState.LOADED:
            return False
        assert entry.client is not None
        if entry.client.is_running:
            return True
        logger.error("the engine of model %r died: it will be loaded again", entry.name)
        client = self._detach(entry, ModelState.FAILED, "its engine exited")
        if client is not None:
            client.close()
        return False

    def _ensure_loading(self, entry: ModelEntry) -> asyncio.Task[None]:
        if entry.load_task is None or entry.load_task.done():
            entry.state = ModelState.LOADING
            entry.error = None
            entry.load_task = asyncio.create_task(self._load(entry))
        return entry.load_task

    async def _load(self, entry: ModelEntry) -> None:
        try:
            await self._make_room(entry)
            start = time.monotonic()
            logger.info("loading model %r", entry.name)
            client = await asyncio.to_thread(self._start_client, entry.spec)
        except BaseException as exc:
            # No room is not the model's fault: it stays unloaded, the next request retries.
            no_room = isinstance(exc, ModelUnavailableError)
            entry.state = ModelState.UNLOADED if no_room else ModelState.FAILED
            entry.holds_slot = False
            entry.error = str(exc) or type(exc).__name__
            logger.error("model %r failed to load: %s", entry.name, entry.error)
            self._notify()
            raise
        entry.client = client
        entry.state = ModelState.LOADED
        entry.loads += 1
        entry.last_load_s = time.monotonic() - start
        entry.last_used = time.monotonic()
        stats = client.stats
        if "model_weights_bytes" in stats:
            entry.measured_bytes = int(stats["model_weights_bytes"] + stats["kv_cache_bytes"])
        logger.info("model %r loaded in %.2f s", entry.name, entry.last_load_s)
        if self.on_loaded is not None:
            self.on_loaded(entry.name, client)
        self._notify()

    async def _make_room(self, entry: ModelEntry) -> None:
        """Take a slot for `entry`, unloading least recently used idle models until it fits;
        wait (bounded by the load timeout) while the ones in the way are busy."""
        deadline = time.monotonic() + self.limits.load_timeout_s
        while True:
            victims = self._victims(entry)
            if victims is not None:
                clients = [self._detach(v, ModelState.UNLOADED) for v in victims]
                entry.holds_slot = True  # before awaiting: a concurrent load sees it
                await asyncio.gather(*(self._stop(c) for c in clients))
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ModelUnavailableError(
                    "no room: every loaded model is busy (raise --max-loaded-models or "
                    "--models-memory-gb)"
                )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    def _victims(self, entry: ModelEntry) -> list[ModelEntry] | None:
        """The idle models to unload, least recently used first, for `entry` to fit; None
        if evicting every idle one would not be enough."""
        resident = [e for e in self.entries.values() if e.holds_slot and e is not entry]
        idle = sorted(
            (e for e in resident if e.state is ModelState.LOADED and e.idle),
            key=lambda e: e.last_used,
        )
        victims: list[ModelEntry] = []
        while not self._fits(entry, [e for e in resident if e not in victims]):
            if not idle:
                return None
            victims.append(idle.pop(0))
        return victims

    def _fits(self, entry: ModelEntry, resident: list[ModelEntry]) -> bool:
        limits = self.limits
        if limits.max_loaded_models is not None and len(resident) + 1 > limits.max_loaded_models:
            return False
        if limits.memory_bytes is None or not resident:
            return True  # a model bigger than the budget alone still loads, by itself
        used = sum(e.memory_bytes for e in resident)
        return used + entry.memory_bytes <= limits.memory_bytes

    def _detach(
        self, entry: ModelEntry, state: ModelState, error: str | None = None
    ) -> EngineClient | None:
        """Take `entry`'s engine away (the caller stops it) and set its state; at once, so
        that no request acquires it meanwhile."""
        client, entry.client = entry.client, None
        entry.state, entry.error, entry.holds_slot = state, error, False
        if client is not None and self.on_unloaded is not None:
            self.on_unloaded(entry.name)
        self._notify()
        return client

    async def _stop(self, client: EngineClient | None) -> None:
        if client is not None:
            await asyncio.to_thread(client.shutdown)

    def _notify(self) -> None:
        """Wake the loads waiting for room (a model went idle or away)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def _watch(self) -> None:
        """Unload models idle for `idle_unload_s`; mark dead engines failed."""
        idle_s = self.limits.idle_unload_s
        period = min(1.0, idle_s / 4) if idle_s is not None else 1.0
        while True:
            await asyncio.sleep(period)
            try:
                await self._unload_idle(idle_s)
            except Exception:  # the watcher outlives one bad round
                logger.exception("watching the models failed")

    async def _unload_idle(self, idle_s: float | None) -> None:
        now = time.monotonic()
        for entry in list(self.entries.values()):
            if not self._check_alive(entry) or not entry.idle or idle_s is None:
                continue
            if now - entry.last_used >= idle_s:
                logger.info("model %r idle for %g s: unloading", entry.name, idle_s)
                await self._stop(self._detach(entry, ModelState.UNLOADED))
