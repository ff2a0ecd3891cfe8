"""The Engine Lab's web app: a JSON API over one `Lab`, and the static page that uses it.

`create_app(engine_factory)` takes the engine from outside, so tests run it on the fake
runner and `serve_lab` on the real model. Every error is `{"error": "..."}` with a 4xx
status, and a refused request never changes the lab's state.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

from fastapi import FastAPI, Query
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.lab.chapters import SCENARIOS, chapters
from minivllm.lab.experiment import MAX_LEARNER_TOKENS, EngineFactory, Experiment, LabError
from minivllm.lab.scenarios import MAX_BATCHED_TOKENS, MAX_KV_BLOCKS, MAX_NUM_SEQS, EngineShape
from minivllm.lab.snapshot import State
from minivllm.lab.source import SourceNotFound, function_source

STATIC_DIR = Path(__file__).resolve().parent / "static"


class ResetRequest(BaseModel):
    """The scenario, and optionally the engine options the learner sets (else the scenario's
    own); the experiment checks their ranges, with messages the page translates."""

    model_config = ConfigDict(extra="forbid")
    scenario: str = Field("seq8", description=f"one of {', '.join(SCENARIOS)}")
    max_num_batched_tokens: int | None = None
    num_kv_blocks: int | None = None
    max_num_seqs: int | None = None

    def shape(self, default: EngineShape) -> EngineShape:
        options = {
            "max_num_batched_tokens": (self.max_num_batched_tokens, MAX_BATCHED_TOKENS),
            "num_kv_blocks": (self.num_kv_blocks, MAX_KV_BLOCKS),
            "max_num_seqs": (self.max_num_seqs, MAX_NUM_SEQS),
        }
        chosen = {}
        for name, (value, most) in options.items():
            if value is None:
                continue
            if not 1 <= value <= most:
                raise LabError(
                    400, "option_range", f"{name} must be between 1 and {most}", name=name, max=most
                )
            chosen[name] = value
        return replace(default, **chosen)


class PredictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    answer: str = Field(..., max_length=40)


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

    def reset(self, body: ResetRequest) -> State:
        scenario = body.scenario
        if scenario not in SCENARIOS:
            known = ", ".join(SCENARIOS)
            raise LabError(
                400,
                "unknown_scenario",
                f"unknown scenario {scenario!r}; choose one of: {known}",
                name=scenario,
                known=known,
            )
        shape = body.shape(SCENARIOS[scenario].shape)
        with self._lock:
            # Built aside and swapped in only once set up: a failure keeps the old one.
            experiment = Experiment(SCENARIOS[scenario], self._factory, shape)
            self._experiment = experiment
            return self._with_lesson({**experiment.frames[-1], "frames": list(experiment.frames)})

    def _with_lesson(self, state: State) -> State:
        """Every answer carries the lesson as it stands now (None in chapter 03)."""
        return {**state, "lesson": self._current().lesson_state()}

    def state(self) -> State:
        with self._lock:
            return self._with_lesson(self._current().frames[-1])

    def history(self) -> State:
        with self._lock:
            return self._with_lesson({"frames": list(self._current().frames)})

    def plan(self) -> State:
        with self._lock:
            return self._with_lesson(self._current().plan())

    def commit(self) -> State:
        with self._lock:
            return self._with_lesson(self._current().commit())

    def step(self) -> State:
        with self._lock:
            return self._with_lesson(self._current().step())

    def add(self, prompt: str, max_tokens: int) -> State:
        with self._lock:
            return self._with_lesson(self._current().add_text(prompt, max_tokens))

    def predict(self, answer: str) -> State:
        with self._lock:
            self._current().predict(answer)
            return self._with_lesson({})


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


def scenario_list() -> dict[str, object]:
    """The scenarios in the order of the page's tabs, each with its chapter; the chapters with
    their "where to read the code" locations; the engine options a learner may set."""
    return {
        "scenarios": [{"name": s.name, "chapter": s.chapter} for s in SCENARIOS.values()],
        "chapters": chapters(),
        "limits": {
            "max_num_batched_tokens": MAX_BATCHED_TOKENS,
            "num_kv_blocks": MAX_KV_BLOCKS,
            "max_num_seqs": MAX_NUM_SEQS,
        },
    }


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
    def history() -> State:
        return lab.history()

    @app.get("/api/lab/scenarios")
    def scenarios() -> dict[str, object]:
        return scenario_list()

    @app.post("/api/lab/reset")
    def reset(body: ResetRequest | None = None) -> State:
        return lab.reset(body or ResetRequest())

    @app.post("/api/lab/predict")
    def predict(body: PredictRequest) -> State:
        """Lock the learner's prediction for the current scenario's question."""
        return lab.predict(body.answer)

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
