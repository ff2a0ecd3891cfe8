"""The live lab of a multi-model server (`minivllm serve --model A --model B --lab`).

The lab's recorder photographs an engine of this process between steps (`lab/live.py`), so
with --lab each model loads into an engine stepped by a thread of the server's process, as
`minivllm serve --lab` does for one model, instead of into an engine process of its own: a
crash of one model's engine then fails its own requests (its loop ends with an error) but a
hard crash of the process takes every model with it. Each load gets a fresh recorder; an
unload drops it. The page and its API take `?model=NAME`; GET /lab/api/models lists the
names and states for the page's picker.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request

from minivllm.engine.runtime.engine_client import EngineClient, client_for
from minivllm.server.errors import APIError, bad_request
from minivllm.server.model_registry import ModelRegistry, ModelState, UnknownModelError
from minivllm.server.model_specs import ModelSpec

if TYPE_CHECKING:
    from minivllm.lab.live import LiveRecorder


class LiveModels:
    """The recorders of the loaded models, and `start`, the registry's way to load a model
    into an engine of this process with a recorder on it:
    `ModelRegistry(specs, limits, start_client=live.start)`, then `routes(registry, ...)`."""

    def __init__(self) -> None:
        self.registry: ModelRegistry | None = None
        self.recorders: dict[str, LiveRecorder] = {}
        self._lock = threading.Lock()  # `start` runs on the registry's worker threads

    def start(self, spec: ModelSpec) -> EngineClient:
        """Load `spec` into an LLMEngine of this process, stepped by a thread that records
        it (the registry's `start_client`)."""
        from minivllm.engine.llm_engine import LLMEngine
        from minivllm.engine.runtime.cpu_share import share_the_cpu_with_http
        from minivllm.lab.live import LiveRecorder

        engine = LLMEngine.from_options(**spec.engine_options)
        share_the_cpu_with_http(engine)
        recorder = LiveRecorder.for_engine(engine)
        client = client_for(engine, recorder)
        client.start()
        with self._lock:
            self.recorders[spec.name] = recorder
        return client

    def forget(self, name: str) -> None:
        """Drop an unloaded (or failed) model's recorder."""
        with self._lock:
            self.recorders.pop(name, None)

    def recorder_of(self, request: Request) -> LiveRecorder:
        """The recorder of the model `?model=` names: a 400 without one, a 404 for a name
        the server does not serve, a 409 for a model that is not loaded (watching never
        loads a model: send it a request or POST /models/load)."""
        assert self.registry is not None, "routes() sets the registry"
        name = request.query_params.get("model")
        if not name:
            names = self.registry.names
            raise bad_request(f"name the model to watch: ?model=NAME (one of {names})", "model")
        try:
            entry = self.registry.entry(name)
        except UnknownModelError as exc:
            raise APIError(404, str(exc), param="model", code="model_not_found") from None
        with self._lock:
            recorder = self.recorders.get(name)
        if recorder is None or entry.state is not ModelState.LOADED:
            raise APIError(
                409,
                f"the model {name!r} is {entry.state.value}: the lab watches a loaded model "
                "(send it a request or POST /models/load)",
                param="model",
                code="model_not_loaded",
            )
        return recorder

    def models(self) -> list[dict[str, str]]:
        assert self.registry is not None, "routes() sets the registry"
        return [{"name": e.name, "state": e.state.value} for e in self.registry.entries.values()]

    def routes(self, registry: ModelRegistry, check_auth: Callable[[Request], None]) -> APIRouter:
        """The lab's page and API over the models of `registry` (whose engines `start`
        loads)."""
        from minivllm.lab.live_routes import model_live_routes

        self.registry = registry
        return model_live_routes(self.recorder_of, check_auth, self.models)
