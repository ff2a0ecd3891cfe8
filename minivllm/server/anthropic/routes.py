"""POST /v1/messages and POST /v1/messages/count_tokens over the server's chat path.

A request is validated as Anthropic's (`protocol.py`), translated into a chat completion
request (`convert.py`) and prepared by chat's own `prepare_chat`: one chat template, one tool
parser, one structured-output path. Every error of these routes, the shared steps' included
(a bad key, an unknown model, a full queue), is answered in Anthropic's error shape.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import ValidationError

from minivllm.server.anthropic.convert import chat_body
from minivllm.server.anthropic.output import Turn, message_of
from minivllm.server.anthropic.protocol import (
    CountTokensRequest,
    Message,
    MessagesRequest,
    TokenCount,
    Usage,
    error_body,
)
from minivllm.server.anthropic.stream import events
from minivllm.server.errors import APIError, bad_value, validation_error
from minivllm.server.openai import protocol, tools
from minivllm.server.openai.chat import chat_prompt, prepare_chat
from minivllm.server.openai.serving import OpenAIServer, json_response
from minivllm.server.openai.streaming import SSEResponse

logger = logging.getLogger("minivllm.server")


def error_response(exc: APIError) -> JSONResponse:
    """`exc` in Anthropic's shape: a full waiting queue is its 529 overloaded_error. The shape
    has no `param`, so the message names the field where it does not already."""
    status = 529 if exc.code == "overloaded" else exc.status
    message = exc.message
    if exc.param is not None and exc.param not in message:
        message = f"{exc.param}: {message}"
    return JSONResponse(error_body(status, message), status_code=status)


class AnthropicRoute(APIRoute):
    """A route whose errors are answered in Anthropic's shape, not the app's OpenAI one."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as exc:
                return error_response(exc)
            except Exception as exc:
                logger.exception("unhandled error")
                message = f"internal error: {type(exc).__name__}"
                return JSONResponse(error_body(500, message), status_code=500)

        return guarded


def anthropic_routes(server: OpenAIServer) -> APIRouter:
    """Anthropic's Messages API over `server`."""
    router = APIRouter(route_class=AnthropicRoute)

    @router.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await create_message(server, request)

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        req = await server.parse(request, CountTokensRequest)
        chat_req = _chat_request(req)
        mode = _mode(chat_req)
        prompt = await asyncio.to_thread(chat_prompt, server, chat_req, mode)
        return json_response(TokenCount(input_tokens=len(prompt)))

    return router


async def create_message(server: OpenAIServer, request: Request) -> Response:
    req = await server.parse(request, MessagesRequest)
    chat_req = _chat_request(req)
    params, mode, prompt = await prepare_chat(server, chat_req, logprobs=None)
    named = chat_req.tool_choice.function.name if mode == "named" else None  # type: ignore[union-attr]
    message = Message(
        model=server.served_model_name, usage=Usage(input_tokens=len(prompt), output_tokens=0)
    )
    single = chat_req.parallel_tool_calls is False
    turn = Turn(server, message, prompt, params, mode, named, single, time.monotonic())
    stream = await server.start(message.id, [prompt], params, req.model)  # an adapter's name too
    if req.stream:
        return SSEResponse(events(turn, stream), on_close=stream.close)
    try:
        [output] = await server.collect(request, stream, 1)
    except APIError as exc:
        server.log_finished(message.id, len(prompt), 0, turn.start, f"failed ({exc.status})")
        raise
    return json_response(message_of(turn, output))


def _chat_request(req: CountTokensRequest) -> protocol.ChatCompletionRequest:
    """The chat completion request `req` means; 400 naming the field it cannot honour."""
    try:
        body = chat_body(req)
    except ValueError as exc:
        raise bad_value(exc) from None
    try:
        return protocol.ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _mode(chat_req: protocol.ChatCompletionRequest) -> tools.Mode:
    try:
        return tools.mode_of(chat_req.tools, chat_req.tool_choice)
    except ValueError as exc:
        raise bad_value(exc) from None
