"""Errors the client sees, in OpenAI's shape `{"error": {message, type, param, code}}`, and
the app's exception handlers that turn every failure into one."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.engine.sequence import FinishReason
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger("minivllm.server")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return ErrorResponse(
        error=ErrorInfo(message=message, type=type, param=param, code=code)
    ).model_dump()


class APIError(Exception):
    """An error the client sees, in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def response(self) -> JSONResponse:
        body = error_body(self.message, self.type, self.param, self.code)
        return JSONResponse(body, status_code=self.status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def bad_value(exc: Exception) -> APIError:
    """A 400 from a ValueError/TypeError whose message names the parameter first."""
    param = getattr(exc, "param", None) or param_of(str(exc))  # constraints.FieldError's
    return bad_request(str(exc), param=param)


def param_of(message: str) -> str | None:
    """The parameter a SamplingParams message names first ("top_p must be ...")."""
    word = message.split(" ", 1)[0]
    known = set(SamplingParams.__dataclass_fields__) | {"prompt"}
    return word if word in known else None


def validation_error(exc: ValidationError) -> APIError:
    """A 400 listing (the first five of) pydantic's complaints, naming the first field."""
    errors = exc.errors(include_url=False)
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(x) for x in e["loc"]) or "body"
        parts.append(f"{loc}: {e['msg']}")
    first = errors[0]["loc"] if errors else ()
    param = str(first[0]) if first else None
    return bad_request("invalid request: " + "; ".join(parts), param=param)


def error_of(output: RequestOutput) -> ErrorResponse:
    """The error body of a request that ended with finish_reason "abort" or "error"."""
    if output.outputs[0].finish_reason == FinishReason.ABORT:
        info = ErrorInfo(
            message=output.error or "the request was aborted",
            type="service_unavailable",
            code="aborted",
        )
    else:
        info = ErrorInfo(
            message=f"the engine failed while running this request: {output.error}",
            type="internal_server_error",
            code="engine_error",
        )
    return ErrorResponse(error=info)


def is_failed(output: RequestOutput) -> bool:
    return output.outputs[0].finish_reason in (FinishReason.ERROR, FinishReason.ABORT)


def raise_if_failed(output: RequestOutput) -> None:
    """503 for an aborted request (shutdown), 500 for an engine fault."""
    if is_failed(output):
        error = error_of(output).error
        status = 500 if output.outputs[0].finish_reason == FinishReason.ERROR else 503
        raise APIError(status, error.message, error.type, code=error.code)


def install_error_handlers(app: FastAPI) -> None:
    """Every failure as OpenAI's error body: ours, Starlette's (404), and the unexpected."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return bad_request(f"invalid request: {exc.errors()}").response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return APIError(
            500, f"internal error: {type(exc).__name__}", type="internal_server_error"
        ).response()
