"""The OpenAI-compatible HTTP server: the app factory and its routes over an EngineClient.

Routes: GET /v1/models (with the LoRA adapters), POST /v1/completions, POST /v1/chat/completions,
POST /v1/embeddings (`openai/embeddings.py`), POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (`openai/lora_routes.py`), the Responses API
(POST /v1/responses, GET, DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel,
`responses/`), Anthropic's POST /v1/messages and /v1/messages/count_tokens (`anthropic/`,
errors in Anthropic's shape), POST /tokenize,
POST /detokenize, GET /version (vLLM's), GET /health, GET /metrics, and with `lab=True` the
live Engine Lab (GET /lab, /lab/api/*: the engine recorded between steps,
`minivllm/lab/live.py`). Every error has OpenAI's shape `{"error": {message, type, param,
code}}`: 400 bad input (malformed JSON, non-UTF-8, invalid parameters, a prompt too long),
401 a missing or wrong API key, 404 an unknown model or route, 413 a body over the limit, 500
an engine fault, 503 an overloaded waiting queue or a server shutting down.

Streaming follows OpenAI's server-sent events (`openai/streaming.py`). A client that disconnects
(streamed or not) has its request aborted at once.

Where things live: one package per API (`openai/`: request and response models, the shared
request steps in `serving.py`, the endpoints, logprob formatting, SSE; `responses/`;
`anthropic/`); here, what they share: errors in `errors.py`, the body limit and API key in
`middleware.py`, metrics in `metrics.py`. The engine is reached through the runtime's
`EngineClient` only (`minivllm/engine/runtime/`).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.runtime.engine_client import EngineClient, client_for
from minivllm.server.anthropic import anthropic_routes
from minivllm.server.errors import APIError, install_error_handlers
from minivllm.server.middleware import BodySizeLimitMiddleware
from minivllm.server.openai import response_models
from minivllm.server.openai.chat import create_chat_completion
from minivllm.server.openai.completions import create_completion
from minivllm.server.openai.embeddings import create_embedding
from minivllm.server.openai.lora_routes import adapter_cards, lora_routes
from minivllm.server.openai.serving import ChatOptions, OpenAIServer, json_response
from minivllm.server.openai.tokenize import detokenize, tokenize
from minivllm.server.responses.routes import ResponsesAPI
from minivllm.server.responses.store import StoreOptions

if TYPE_CHECKING:
    from minivllm.lab.live import LiveRecorder

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_WAITING_REQUESTS = 1024


def create_app(
    engine: LLMEngine | EngineClient,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS,
    lab: bool = False,
    chat: ChatOptions | None = None,
    allowed_origins: list[str] | None = None,
    response_store: StoreOptions | None = None,
) -> FastAPI:
    """An OpenAI-compatible app serving `engine` (an LLMEngine, stepped by a thread of this
    process, or an EngineClient such as an EngineProcess). Its engine loop starts with the
    app's lifespan and stops with it; `app.state.server` is the OpenAIServer (tests read it).
    `lab`: record the engine between steps and serve the live lab page at /lab (without it
    nothing is recorded and /lab is 404). `chat`: the server's chat template, template kwargs
    and reasoning parser. `allowed_origins`: the browser origins CORS lets in (["*"]: any).
    `response_store`: the Responses API store's bounds (`app.state.responses` holds it).
    """
    recorder = _live_recorder(engine) if lab else None
    client = client_for(engine, recorder)
    name = served_model_name or _default_name(client)
    server = OpenAIServer(client, name, api_key, max_waiting_requests, chat)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client.start()
        try:
            yield
        finally:
            client.shutdown()
            client.close()  # a tensor-parallel runner's worker processes

    app = new_app(server, lifespan, max_body_bytes, allowed_origins)
    app.include_router(openai_routes(server))
    app.state.responses = ResponsesAPI(server, response_store)
    app.include_router(app.state.responses.routes())
    app.include_router(anthropic_routes(server))
    app.include_router(lora_routes(server))
    if recorder is not None:
        from minivllm.lab.live_routes import live_routes

        app.include_router(live_routes(recorder, server.check_auth))
    return app


def openai_routes(server: OpenAIServer) -> APIRouter:
    """The OpenAI-compatible endpoints plus health and metrics."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        if not server.engine.is_running:
            return APIError(503, "the engine loop is not running", "service_unavailable").response()
        return JSONResponse({"status": "ok"})

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @router.get("/v1/models")
    async def models(request: Request) -> Response:
        server.check_auth(request)
        card = response_models.ModelCard(
            id=server.served_model_name, max_model_len=server.max_model_len
        )
        return json_response(response_models.ModelList(data=[card, *adapter_cards(server)]))

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(server, request)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(server, request)

    @router.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await create_embedding(server, request)

    @router.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await tokenize(server, request)

    @router.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await detokenize(server, request)

    @router.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": _version()})

    return router


def _version() -> str:
    try:
        return importlib.metadata.version("minivllm")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "0+unknown"


def _live_recorder(engine: LLMEngine | EngineClient) -> LiveRecorder:
    """The live lab's recorder, which photographs an engine of this process between steps."""
    from minivllm.lab.live import LiveRecorder

    if not isinstance(engine, LLMEngine):
        raise ValueError(
            "the live lab records an engine of this process: serve it without an engine process"
        )
    return LiveRecorder.for_engine(engine)


def _default_name(client: EngineClient) -> str:
    model = client.config.model
    if model is None:
        return "SmolLM2-135M-Instruct"
    return str(model).rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf")


def new_app(
    server: Any,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]],
    max_body_bytes: int,
    allowed_origins: list[str] | None,
) -> FastAPI:
    """The FastAPI app both servers start from (one model or several): `server` as
    `app.state.server`, the body-size limit, CORS for `allowed_origins`, and the error handlers
    that answer in OpenAI's shape."""
    app = FastAPI(title="minivllm", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes)
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"]
        )
    install_error_handlers(app)
    return app
