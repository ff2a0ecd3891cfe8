"""The Engine Lab's web app: a JSON API over one `Lab`, and the static page that uses it.

`create_app(engine_factory)` takes the engine from outside, so tests run it on the fake
runner and `serve_lab` on the real model. Every error is `{"error": "..."}` with a 4xx
status, and a refused request never changes the lab's state.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fastapi import FastAPI, Query
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.lab.scenarios import SCENARIOS
from minivllm.lab.session import MAX_LEARNER_TOKENS, EngineFactory, Lab, LabError, State
from minivllm.lab.source import SourceNotFound, function_source

STATIC_DIR = Path(__file__).resolve().parent / "static"


class ResetRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scenario: str = Field("seq8", description=f"one of {', '.join(SCENARIOS)}")


class AddRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(..., min_length=1, max_length=2000)
    max_tokens: int = Field(8, ge=1, le=MAX_LEARNER_TOKENS)


def create_app(engine_factory: EngineFactory) -> FastAPI:
    """The lab app on engines built by `engine_factory(shape, tracer)`."""
    lab = Lab(engine_factory)
    app = FastAPI(title="minivllm Engine Lab", docs_url=None, redoc_url=None)
    app.state.lab = lab

    @app.exception_handler(LabError)
    def _lab_error(_request, exc: LabError) -> JSONResponse:
        return JSONResponse({"error": exc.message}, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    def _bad_request(_request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        return JSONResponse({"error": "bad request: " + "; ".join(parts)}, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    def _http_error(_request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)

    @app.get("/")
    def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/api/lab/state")
    def state() -> State:
        return lab.state()

    @app.get("/api/lab/history")
    def history() -> dict[str, list[State]]:
        return {"frames": lab.history()}

    @app.get("/api/lab/scenarios")
    def scenarios() -> dict[str, list[str]]:
        return {"scenarios": list(SCENARIOS)}

    @app.post("/api/lab/reset")
    def reset(body: ResetRequest | None = None) -> State:
        return lab.reset((body or ResetRequest()).scenario)

    @app.post("/api/lab/plan")
    def plan() -> State:
        return lab.plan()

    @app.post("/api/lab/commit")
    def commit() -> State:
        return lab.commit()

    @app.post("/api/lab/step")
    def step() -> State:
        return lab.step()

    @app.post("/api/lab/add")
    def add(body: AddRequest) -> State:
        return lab.add(body.prompt, body.max_tokens)

    @app.get("/api/lab/source")
    def source(location: str = Query(..., max_length=300)) -> dict[str, object]:
        try:
            return function_source(location)
        except SourceNotFound as exc:
            raise LabError(404, str(exc)) from exc

    return app


# ---- the `minivllm lab` command ------------------------------------------------------------


def serve_lab(
    host: str = "127.0.0.1", port: int = 8765, model: str | None = None, block_size: int = 4
) -> None:
    """Load the model, then serve the lab until interrupted."""
    import uvicorn

    from minivllm.lab.engines import default_engines

    if block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size}")
    factory = default_engines(model, block_size)
    app = create_app(factory)
    print(
        f"minivllm lab: http://{host}:{port}/  (model: {model or 'default'}, "
        f"block_size {block_size}; Ctrl-C to stop)",
        flush=True,
    )
    uvicorn.run(app, host=host, port=port, log_level="warning")


def add_lab_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `lab` to the CLI's subcommands; the parsed args carry `func=run_lab`."""
    parser = subparsers.add_parser(
        "lab", help="serve the Engine Lab: the request state machine, live, in the browser"
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s)"
    )
    parser.add_argument("--port", type=int, default=8765, help="port (default: %(default)s)")
    parser.add_argument(
        "--model",
        default=None,
        help="HF model directory or .gguf file (default: the default model)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=4,
        help="tokens per KV block; small so block tables stay visible (default: %(default)s)",
    )
    parser.set_defaults(func=run_lab)
    return parser


def run_lab(args: argparse.Namespace) -> int:
    serve_lab(args.host, args.port, args.model, args.block_size)
    return 0
