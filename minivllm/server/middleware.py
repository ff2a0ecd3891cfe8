"""What every request passes before a route: the body-size limit (413) and the API key (401)."""

from __future__ import annotations

import hmac

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minivllm.server.errors import APIError


class _BodyTooLarge(Exception):
    pass


class BodySizeLimitMiddleware:
    """413 for a request body over `max_bytes`: by Content-Length before reading, or as soon
    as a chunked body crosses the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = APIError(
            413,
            f"the request body is over the limit of {self.max_bytes} bytes",
            code="request_too_large",
        ).response()
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await too_large(scope, receive, send)
                return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await too_large(scope, receive, send)


def check_auth(request: Request, api_key: str | None) -> None:
    """401 unless the request carries `Authorization: Bearer <api_key>` or, as Anthropic's
    clients send it, `x-api-key: <api_key>` (when one is set)."""
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    bearer = token.strip() if scheme.lower() == "bearer" else None
    if not any(
        hmac.compare_digest(key.encode(), api_key.encode())
        for key in (bearer, request.headers.get("x-api-key"))
        if key is not None
    ):
        raise APIError(
            401,
            "missing or wrong API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
            type="authentication_error",
            code="invalid_api_key",
        )
