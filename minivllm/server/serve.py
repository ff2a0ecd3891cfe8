"""Running the server: `run_server` for `minivllm serve`, `ServerThread` for tests and tools.

Both bind 127.0.0.1 unless told otherwise, and both stop the same way (`GracefulServer`):
on SIGTERM or SIGINT (or `ServerThread.stop`) the listener closes and new requests get 503;
requests in flight get `graceful_shutdown_s` to finish, then the engine ends the rest with
finish_reason "abort" (a streamed request reads an error event and `[DONE]`, a non-streamed
one a 503); the process exits 0. A second Ctrl-C quits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn

from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.runtime.cpu_share import share_the_cpu_with_http
from minivllm.engine.runtime.engine_process import EngineProcess, EngineStarting
from minivllm.server.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING_REQUESTS, create_app
from minivllm.server.openai.serving import ChatOptions
from minivllm.server.responses.store import DEFAULT_MAX_BYTES, DEFAULT_MAX_RESPONSES, StoreOptions

logger = logging.getLogger("minivllm.server")

# After the grace period the aborted requests' last events still have to go out.
_FLUSH_S = 5.0


class GracefulServer(uvicorn.Server):
    """uvicorn's server with minivllm's shutdown (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, graceful_shutdown_s: float) -> None:
        super().__init__(config)
        self.graceful_shutdown_s = graceful_shutdown_s

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            # uvicorn re-raises the stop signal after shutting down, so SIGTERM would end the
            # process as "killed by signal"; the shutdown was asked for and clean: exit 0.
            self._captured_signals.clear()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        engine = _engine_client_of(self.config.app)
        timer = None
        if engine is not None:
            engine.stop_accepting()
            timer = asyncio.get_running_loop().call_later(
                self.graceful_shutdown_s, engine.abort_all
            )
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()


def _engine_client_of(app: Any) -> Any:
    server = getattr(getattr(app, "state", None), "server", None)
    return getattr(server, "engine", None)


def _uvicorn_config(app: Any, graceful_shutdown_s: float, **kwargs: Any) -> uvicorn.Config:
    # uvicorn takes whole seconds; round up so the drain is never cut short
    grace = math.ceil(graceful_shutdown_s + _FLUSH_S)
    return uvicorn.Config(app, timeout_graceful_shutdown=grace, **kwargs)


def serve(
    args: argparse.Namespace,
    engine_options: dict[str, Any],
    starting: EngineStarting | None = None,
) -> int:
    """`minivllm serve`: the server flags from `args` (host, port, api_key,
    served_model_name, and optionally max_waiting_requests, max_body_bytes, lab), the engine's
    from `engine_options` (its process already `starting` on them, if given)."""
    run_server(
        engine_options,
        starting=starting,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_body_bytes=getattr(args, "max_body_bytes", None) or DEFAULT_MAX_BODY_BYTES,
        max_waiting_requests=getattr(args, "max_waiting_requests", None)
        or DEFAULT_MAX_WAITING_REQUESTS,
        graceful_shutdown_s=_or(getattr(args, "shutdown_timeout", None), 5.0),
        lab=bool(getattr(args, "lab", False)),
        chat=chat_options(args),
        allowed_origins=getattr(args, "allowed_origins", None),
        engine_process=getattr(args, "engine_process", True),
        response_store=response_store_options(args),
    )
    return 0


def response_store_options(args: argparse.Namespace) -> StoreOptions:
    """--response-store-max-responses N, --response-store-max-bytes B, --no-response-store,
    where the CLI has them."""
    if getattr(args, "no_response_store", False):
        return StoreOptions(max_responses=0)
    count = getattr(args, "response_store_max_responses", None)
    size = getattr(args, "response_store_max_bytes", None)
    return StoreOptions(
        max_responses=DEFAULT_MAX_RESPONSES if count is None else count,
        max_bytes=DEFAULT_MAX_BYTES if size is None else size,
    )


def chat_options(args: argparse.Namespace) -> ChatOptions:
    """--chat-template FILE (or an inline template), --chat-template-kwargs JSON,
    --reasoning-parser NAME, where the CLI has them."""
    template = getattr(args, "chat_template", None)
    if template is not None and Path(template).is_file():
        template = Path(template).read_text()
    kwargs = getattr(args, "chat_template_kwargs", None)
    if isinstance(kwargs, str):
        try:
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"--chat-template-kwargs is not valid JSON: {exc}") from None
        if not isinstance(kwargs, dict):
            raise SystemExit("--chat-template-kwargs must be a JSON object")
    return ChatOptions(template, dict(kwargs or {}), getattr(args, "reasoning_parser", None))


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def run_server(
    engine_options: dict[str, Any],
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS,
    graceful_shutdown_s: float = 5.0,
    lab: bool = False,
    chat: ChatOptions | None = None,
    allowed_origins: list[str] | None = None,
    engine_process: bool = True,
    response_store: StoreOptions | None = None,
    starting: EngineStarting | None = None,
) -> None:
    """Build an engine from `engine_options` (LLMEngine.from_options) and serve it until
    SIGINT or SIGTERM. In-flight requests get `graceful_shutdown_s` to finish; the rest end
    with an error (event or status). `lab` adds the live Engine Lab page at /lab.
    `engine_process`: the engine loop in a process of its own (EngineProcess), except with
    `lab`, whose recorder watches an engine of this process; else a thread of this one.
    `starting`: that process, started already on `engine_options`."""
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)  # one line per finished request
    engine: LLMEngine | EngineProcess
    if engine_process and not lab:
        engine = EngineProcess(engine_options, starting=starting)
    else:
        engine = LLMEngine.from_options(**engine_options)
        share_the_cpu_with_http(engine)
    app = create_app(
        engine,
        served_model_name=served_model_name,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        max_waiting_requests=max_waiting_requests,
        lab=lab,
        chat=chat,
        allowed_origins=allowed_origins,
        response_store=response_store,
    )
    name = app.state.server.served_model_name
    logger.info("serving %r on http://%s:%d/v1", name, host, port)
    if lab:
        logger.info("live Engine Lab on http://%s:%d/lab", host, port)
    config = _uvicorn_config(app, graceful_shutdown_s, host=host, port=port, log_level="warning")
    GracefulServer(config, graceful_shutdown_s).run()
    logger.info("server stopped")


class ServerThread:
    """A live uvicorn server on a free loopback port, in a background thread.

    `with ServerThread(app) as server: ... server.base_url ...`; leaving the block shuts it
    down (the app's lifespan stops the engine thread)."""

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        log_level: str = "warning",
        graceful_shutdown_s: float = 2.0,
    ) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.host, self.port = self.sock.getsockname()[:2]
        config = _uvicorn_config(app, graceful_shutdown_s, log_level=log_level)
        self.server = GracefulServer(config, graceful_shutdown_s)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start within {timeout}s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
