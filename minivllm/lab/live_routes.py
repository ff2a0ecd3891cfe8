"""The live lab's routes on the server's own port (`minivllm serve --lab`), read-only:

- GET /lab: the page (live.html); its files at GET /lab/static/<name>.
- GET /lab/api/live: the latest frame as docs/lab.md's JSON (`LiveRecorder.live`).
- GET /lab/api/frames?after=N: the frames recorded after frame N, which the page polls.

A server of several models (`minivllm serve --model A --model B --lab`) records each loaded
model apart: its routes take `?model=NAME` (the page passes its own on), and the page offers
the names of GET /lab/api/models as a picker (`model_live_routes`).

The API obeys the server's API key like /v1 (`check_auth`, a 401 in OpenAI's error shape);
the page itself holds no data, so it loads without one and sends the key its user types.
The server passes its check in, so the lab imports nothing from the server.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.exceptions import HTTPException

from minivllm.lab.live import LiveRecorder

STATIC_DIR = Path(__file__).resolve().parent / "static"
# The files the live page loads (lab.css and state.css: the lab's colours, cards and chips).
PAGE_FILES = {
    "state.css": "text/css",
    "live.js": "text/javascript",
    "live-i18n.js": "text/javascript",
    "live-charts.js": "text/javascript",
    "dom.js": "text/javascript",
    "live.css": "text/css",
    "lab.css": "text/css",
}
_NO_STORE = {"Cache-Control": "no-store"}


RecorderOf = Callable[[Request], LiveRecorder]


def live_routes(recorder: LiveRecorder, check_auth: Callable[[Request], None]) -> APIRouter:
    """The live lab's router over `recorder`; `check_auth(request)` raises for a bad key."""
    return _routes(lambda _request: recorder, check_auth)


def model_live_routes(
    recorder_of: RecorderOf,
    check_auth: Callable[[Request], None],
    models: Callable[[], list[dict[str, str]]],
) -> APIRouter:
    """The live lab of a server of several models: `recorder_of(request)` is the recorder of
    the model the request's `?model=` names (it raises a 4xx for one it cannot watch), and
    GET /lab/api/models lists `models()` ({"name", "state"} each) for the page's picker."""
    router = _routes(recorder_of, check_auth)

    @router.get("/lab/api/models")
    async def model_list(request: Request) -> Response:
        check_auth(request)
        return JSONResponse({"models": models()}, headers=_NO_STORE)

    return router


def _routes(recorder_of: RecorderOf, check_auth: Callable[[Request], None]) -> APIRouter:
    router = APIRouter()

    @router.get("/lab", include_in_schema=False)
    async def page() -> Response:
        return FileResponse(STATIC_DIR / "live.html", media_type="text/html", headers=_NO_STORE)

    @router.get("/lab/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        media_type = PAGE_FILES.get(name)
        if media_type is None:
            raise HTTPException(404, f"the live lab has no file {name!r}")
        return FileResponse(STATIC_DIR / name, media_type=media_type, headers=_NO_STORE)

    @router.get("/lab/api/live")
    async def live(request: Request) -> Response:
        check_auth(request)
        return JSONResponse(recorder_of(request).live(), headers=_NO_STORE)

    @router.get("/lab/api/frames")
    async def frames(request: Request, after: int = Query(-1, ge=-1)) -> Response:
        check_auth(request)
        return JSONResponse(recorder_of(request).frames_after(after), headers=_NO_STORE)

    return router
