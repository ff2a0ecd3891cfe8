"""The HTTP side of a multi-model server: the OpenAI routes over a ModelRegistry
(model_registry.py), each request routed by its `model` field to that model's OpenAIServer.

Routes: GET /v1/models (every model with its state, llama-server's `status: {value}`), POST
/v1/completions, /v1/chat/completions, /tokenize, /detokenize (routed by `route`), POST
/models/load and /models/unload ({"model": NAME}), GET /health, /metrics (multi_metrics.py),
/version. An unknown model is a 404 listing the names; a model that cannot be loaded a 503;
an unload of a busy model a 409; all in OpenAI's error shape (errors.py). With `live` (a
multi_lab.LiveModels, `--lab`) the live lab too: GET /lab?model=NAME and its API. The
Responses API and Anthropic's /v1/messages serve one model: here they answer a 404 saying so.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from minivllm.engine.runtime.engine_client import EngineClient
from minivllm.server.app import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_WAITING_REQUESTS,
    _version,
    new_app,
)
from minivllm.server.errors import APIError, bad_request
from minivllm.server.middleware import check_auth
from minivllm.server.model_registry import (
    Lease,
    ModelBusyError,
    ModelEntry,
    ModelRegistry,
    ModelUnavailableError,
    UnknownModelError,
)
from minivllm.server.multi_lab import LiveModels
from minivllm.server.multi_metrics import MultiModelCollector
from minivllm.server.openai.chat import create_chat_completion
from minivllm.server.openai.completions import create_completion
from minivllm.server.openai.response_models import ModelCard
from minivllm.server.openai.serving import ChatOptions, OpenAIServer
from minivllm.server.openai.streaming import SSEResponse
from minivllm.server.openai.tokenize import detokenize, tokenize

Handler = Callable[[OpenAIServer, Request], Awaitable[Response]]


class ModelRouter:
    """The per-model OpenAIServers of the loaded models, and `route`, the one place a
    request's `model` picks an engine. `engine` is the registry (the graceful shutdown stops
    and aborts every model through it)."""

    def __init__(
        self,
        registry: ModelRegistry,
        api_key: str | None,
        max_waiting_requests: int | None,
        chat: ChatOptions | None,
        live: LiveModels | None = None,
    ) -> None:
        self.engine = self.registry = registry
        self.live = live
        self.api_key = api_key
        self.max_waiting_requests = max_waiting_requests
        self.chat = chat
        self.servers: dict[str, OpenAIServer] = {}
        registry.on_loaded = self._loaded
        registry.on_unloaded = self._unloaded

    def _loaded(self, name: str, client: EngineClient) -> None:
        self.servers[name] = OpenAIServer(
            client, name, self.api_key, self.max_waiting_requests, self.chat
        )

    def _unloaded(self, name: str) -> None:
        self.servers.pop(name, None)
        if self.live is not None:
            self.live.forget(name)

    def metric_registries(self) -> dict[str, CollectorRegistry]:
        return {name: server.metrics.registry for name, server in self.servers.items()}

    async def route(self, request: Request, handler: Handler) -> Response:
        """Run `handler` on the OpenAIServer of the model the body names, loading it first
        if need be; the model stays pinned (never evicted) until the response ends."""
        check_auth(request, self.api_key)
        lease = await self.lease(await _model_of(request))
        try:
            response = await handler(self.servers[lease.name], request)
        except BaseException:
            lease.release()
            raise
        if isinstance(response, SSEResponse):  # released when the stream ends, however
            on_close = response.on_close

            def close() -> None:
                on_close()
                lease.release()

            response.on_close = close
        else:
            lease.release()
        return response

    async def lease(self, name: object) -> Lease:
        try:
            return await self.registry.acquire(name)
        except UnknownModelError as exc:
            raise APIError(404, str(exc), param="model", code="model_not_found") from None
        except ModelUnavailableError as exc:
            raise APIError(503, str(exc), "service_unavailable", code="model_unavailable") from None

    def card(self, entry: ModelEntry) -> dict[str, Any]:
        """A model's /v1/models entry: OpenAI's card plus llama-server's `status`."""
        server = self.servers.get(entry.name)
        max_len = server.max_model_len if server else entry.spec.engine_options.get("max_model_len")
        card = ModelCard(id=entry.name, max_model_len=max_len).model_dump()
        status: dict[str, Any] = {"value": entry.state.value}
        if entry.error is not None:
            status["error"] = entry.error
        return {**card, "status": status}


async def _model_of(request: Request) -> str:
    """The `model` field of the request's JSON body (Starlette keeps the body for the
    endpoint, which parses and checks it in full)."""
    try:
        data = json.loads(await request.body())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    name = data.get("model")
    if not isinstance(name, str):
        raise bad_request("this server serves several models: name one in `model`", "model")
    return name


def create_multi_app(
    registry: ModelRegistry,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS,
    chat: ChatOptions | None = None,
    allowed_origins: list[str] | None = None,
    live: LiveModels | None = None,
) -> FastAPI:
    """An OpenAI-compatible app serving the models of `registry`, loaded on demand; the
    registry starts with the app's lifespan and unloads every model when it ends.
    `app.state.server` is the ModelRouter. `live`: the live lab, whose `start` must be the
    registry's `start_client` (multi_lab.py)."""
    router = ModelRouter(registry, api_key, max_waiting_requests, chat, live)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await registry.start()
        try:
            yield
        finally:
            await registry.shutdown()

    app = new_app(router, lifespan, max_body_bytes, allowed_origins)
    app.include_router(_routes(router))
    if live is not None:
        app.include_router(live.routes(registry, lambda request: check_auth(request, api_key)))
    return app


def _routes(router: ModelRouter) -> APIRouter:
    routes = APIRouter()
    registry = router.registry
    metrics = CollectorRegistry()
    metrics.register(MultiModelCollector(registry, router.metric_registries))
    routed: dict[str, Handler] = {
        "/v1/completions": create_completion,
        "/v1/chat/completions": create_chat_completion,
        "/tokenize": tokenize,
        "/detokenize": detokenize,
    }
    for path, handler in routed.items():
        routes.add_api_route(path, _routed(router, handler), methods=["POST"])

    one_model = {"/v1/responses": "The Responses API", "/v1/messages": "Anthropic's API"}
    for prefix, api in one_model.items():
        routes.add_api_route(
            prefix + "{rest:path}", _one_model_only(api), methods=["GET", "POST", "DELETE"]
        )

    @routes.get("/v1/models")
    async def models(request: Request) -> Response:
        check_auth(request, router.api_key)
        cards = [router.card(entry) for entry in registry.entries.values()]
        return JSONResponse({"object": "list", "data": cards})

    @routes.post("/models/load")
    async def load(request: Request) -> Response:
        check_auth(request, router.api_key)
        lease = await router.lease(await _model_of(request))
        lease.release()
        return JSONResponse(router.card(registry.entries[lease.name]))

    @routes.post("/models/unload")
    async def unload(request: Request) -> Response:
        check_auth(request, router.api_key)
        try:
            entry = await registry.unload(await _model_of(request))
        except UnknownModelError as exc:
            raise APIError(404, str(exc), param="model", code="model_not_found") from None
        except ModelBusyError as exc:
            raise APIError(409, str(exc), param="model", code="model_busy") from None
        return JSONResponse(router.card(entry))

    @routes.get("/health")
    async def health() -> Response:
        states = {e.name: e.state.value for e in registry.entries.values()}
        return JSONResponse({"status": "ok", "models": states})

    @routes.get("/metrics")
    async def metrics_route() -> Response:
        return Response(generate_latest(metrics), media_type=CONTENT_TYPE_LATEST)

    @routes.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": _version()})

    return routes


def _one_model_only(api: str) -> Callable[[], Awaitable[Response]]:
    """A clear 404 for an API this server does not offer yet (its stored state is one
    model's), rather than a bare "Not Found"."""

    async def endpoint() -> Response:
        message = f"{api} serves one model: start `minivllm serve` with one --model for it"
        raise APIError(404, message, code="not_served_with_several_models")

    return endpoint


def _routed(router: ModelRouter, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await router.route(request, handler)

    return endpoint
