"""The Engine Lab's web app: a JSON API over one `Lab`, and the static page that uses it.

`create_app(engine_factory)` takes the engine from outside, so tests run it on the fake
runner and `serve_lab` on the real model. Every error is `{"error": "..."}` with a 4xx
status, and a refused request never changes the lab's state.
"""

from __future__ import annotations

import threading
from pathlib import Path

from fastapi import FastAPI, Query
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.lab.experiment import MAX_LEARNER_TOKENS, EngineFactory, Experiment, LabError
from minivllm.lab.scenarios import SCENARIOS
from minivllm.lab.snapshot import State
from minivllm.lab.source import SourceNotFound, function_source

STATIC_DIR = Path(__file__).resolve().parent / "static"


class ResetRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scenario: str = Field("seq8", description=f"one of {', '.join(SCENARIOS)}")


class AddRequest(BaseModel):
    """Types only: the experiment checks the values, with messages the page translates."""

    model_config = ConfigDict(extra="forbid")
    prompt: str
    max_tokens: int = Field(8, description=f"1 .. {MAX_LEARNER_TOKENS}")


class Lab:
    """The current experiment behind one lock: HTTP requests may arrive concurrently."""

    def __init__(self, factory: EngineFactory, default_scenario: str = "seq8") -> None:
        self._factory = factory
        self._default = default_scenario
        self._lock = threading.Lock()
        self._experiment: Experiment | None = None

    def _current(self) -> Experiment:
        if self._experiment is None:
            self._experiment = Experiment(SCENARIOS[self._default], self._factory)
        return self._experiment

    def reset(self, scenario: str) -> State:
        if scenario not in SCENARIOS:
            known = ", ".join(SCENARIOS)
            raise LabError(400, "unknown_scenario", f"unknown scenario {scenario!r}; choose one "
                           f"of: {known}", name=scenario, known=known)
        with self._lock:
            # Built aside and swapped in only once set up: a failure keeps the old one.
            experiment = Experiment(SCENARIOS[scenario], self._factory)
            self._experiment = experiment
            return {**experiment.frames[-1], "frames": list(experiment.frames)}

    def state(self) -> State:
        with self._lock:
            return self._current().frames[-1]

    def history(self) -> list[State]:
        with self._lock:
            return list(self._current().frames)

    def plan(self) -> State:
        with self._lock:
            return self._current().plan()

    def commit(self) -> State:
        with self._lock:
            return self._current().commit()

    def step(self) -> State:
        with self._lock:
            return self._current().step()

    def add(self, prompt: str, max_tokens: int) -> State:
        with self._lock:
            return self._current().add_text(prompt, max_tokens)


def _install_error_handlers(app: FastAPI) -> None:
    """Every error the lab answers is `LabError.to_dict()`: a code the page translates."""

    @app.exception_handler(LabError)
    def _lab_error(_request, exc: LabError) -> JSONResponse:
        return JSONResponse(exc.to_dict(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    def _bad_request(_request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        detail = "; ".join(parts)
        error = LabError(400, "bad_request", f"bad request: {detail}", detail=detail)
        return JSONResponse(error.to_dict(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    def _http_error(_request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else "http_error"
        error = LabError(exc.status_code, code, str(exc.detail), detail=str(exc.detail))
        return JSONResponse(error.to_dict(), status_code=exc.status_code)


def create_app(engine_factory: EngineFactory) -> FastAPI:
    """The lab app on engines built by `engine_factory(shape, tracer)`."""
    lab = Lab(engine_factory)
    app = FastAPI(title="minivllm Engine Lab", docs_url=None, redoc_url=None)
    app.state.lab = lab

    _install_error_handlers(app)

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
        """The scenario names, in the order of the page's tabs."""
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
            raise LabError(404, "no_source", str(exc), detail=str(exc)) from exc

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

