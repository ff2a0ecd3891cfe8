"""POST /v1/responses, GET and DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel:
OpenAI's Responses API over the chat completions machinery.

A request becomes a chat completion request (`protocol.chat_body`): its prompt
is the chat template's, its tools and tool_choice are enforced as chat enforces them, its
`text.format` is chat's `response_format`. The output is split into items as chat splits
its message (`stream.py`). Stored responses (`store`, the default) live in this
process's bounded store (`store.py`); `previous_response_id` continues one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from minivllm.engine.runtime.async_engine import RequestStream
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.server.errors import APIError, bad_value, error_of, is_failed, validation_error
from minivllm.server.openai import protocol, tools
from minivllm.server.openai.chat import prepare_chat
from minivllm.server.openai.serving import OpenAIServer, json_response
from minivllm.server.openai.streaming import SSEResponse, text_delta
from minivllm.server.responses.protocol import (
    IncompleteDetails,
    InputTokensDetails,
    OutputTokensDetails,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    chat_body,
    input_messages,
    new_id,
    response_of,
)
from minivllm.server.responses.store import ResponseStore, StoredResponse, StoreOptions
from minivllm.server.responses.stream import EventWriter, assistant_message, output_items


@dataclass
class _Running:
    """A response being generated: what cancel needs."""

    stream: RequestStream
    response: ResponseObject  # the turn's, filled in by its handler when it ends
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Future[Any] | None = None  # a non-streamed response's collection


@dataclass
class _Turn:
    """One response in the making: the request, its prompt and where its output goes."""

    req: ResponsesRequest
    response: ResponseObject
    conversation: list[dict[str, Any]]  # earlier turns and this input, as chat messages
    prompt: list[int]
    params: SamplingParams
    mode: tools.Mode
    named: str | None
    start: float


class ResponsesAPI:
    """The Responses endpoints over one OpenAIServer, with their store."""

    def __init__(self, server: OpenAIServer, options: StoreOptions | None = None) -> None:
        self.server = server
        self.store = ResponseStore(options or StoreOptions())
        self.running: dict[str, _Running] = {}

    def routes(self) -> APIRouter:
        router = APIRouter()

        @router.post("/v1/responses")
        async def create(request: Request) -> Response:
            return await self.create(request)

        @router.get("/v1/responses/{response_id}")
        async def retrieve(response_id: str, request: Request) -> Response:
            self.server.check_auth(request)
            return json_response(self._stored(response_id).response)

        @router.delete("/v1/responses/{response_id}")
        async def delete(response_id: str, request: Request) -> Response:
            self.server.check_auth(request)
            self._stored(response_id)
            self.store.delete(response_id)
            return JSONResponse({"id": response_id, "object": "response", "deleted": True})

        @router.post("/v1/responses/{response_id}/cancel")
        async def cancel(response_id: str, request: Request) -> Response:
            self.server.check_auth(request)
            return json_response(await self.cancel(response_id))

        return router

    def _stored(self, response_id: str) -> StoredResponse:
        entry = self.store.get(response_id)
        if entry is None:
            raise APIError(
                404,
                f"no response {response_id!r} in this server's store: unknown, "
                "deleted, evicted (the store is bounded and in memory) or not stored",
                param="response_id",
                code="response_not_found",
            )
        return entry

    async def cancel(self, response_id: str) -> ResponseObject:
        running = self.running.get(response_id)
        if running is None:
            entry = self._stored(response_id)
            if entry.response.status != "cancelled":
                raise APIError(
                    400,
                    f"response {response_id!r} is not in progress (its status "
                    f"is {entry.response.status}): only a running one can be "
                    "cancelled",
                    param="response_id",
                )
            return entry.response
        running.cancelled.set()
        running.stream.close()
        if running.task is not None:
            running.task.cancel()
        for _ in range(200):  # until its handler has written the cancelled response
            if response_id not in self.running:
                break
            await asyncio.sleep(0.01)
        return running.response

    async def create(self, request: Request) -> Response:
        server = self.server
        req = await server.parse(request, ResponsesRequest)
        turn = await self._prepare(req)
        stream = await server.start(turn.response.id, [turn.prompt], turn.params, req.model)
        running = _Running(stream, turn.response)
        self.running[turn.response.id] = running
        self._save(turn, [])
        if req.stream:
            return SSEResponse(
                self._events(turn, running), on_close=lambda: self._closed(turn, running)
            )
        try:
            running.task = asyncio.ensure_future(server.collect(request, stream, 1))
            try:
                [output] = await running.task
            except asyncio.CancelledError:
                if not running.cancelled.is_set():
                    raise
                self._finish(turn, None, "cancelled")
                return json_response(turn.response)
            except APIError as exc:
                self._finish(
                    turn,
                    None,
                    "failed",
                    ResponseError(code=exc.code or "server_error", message=exc.message),
                )
                raise
            self._finish(turn, output, None)
            return json_response(turn.response)
        finally:
            self.running.pop(turn.response.id, None)

    async def _prepare(self, req: ResponsesRequest) -> _Turn:
        """The request's prompt, sampling params and in-progress response; 4xx if invalid."""
        server = self.server
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            entry = self.store.get(req.previous_response_id)
            if entry is None:
                raise APIError(
                    404,
                    f"previous_response_id {req.previous_response_id!r} is not in this "
                    "server's store: unknown, deleted, evicted (the store is bounded and in "
                    "memory) or stored with store: false",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            if entry.response.status not in ("completed", "incomplete"):
                raise APIError(
                    400,
                    f"previous_response_id {req.previous_response_id!r} is "
                    f"{entry.response.status}: only a finished response can be "
                    "continued",
                    param="previous_response_id",
                )
            history = entry.messages
        try:
            conversation = history + input_messages(req.input)
            body = chat_body(req, conversation)
        except ValueError as exc:
            raise bad_value(exc) from None
        try:
            chat_req = protocol.ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc) from None
        params, mode, prompt = await prepare_chat(server, chat_req, logprobs=None)
        named = chat_req.tool_choice.function.name if mode == "named" else None  # type: ignore[union-attr]
        response = response_of(req, new_id("resp"), server.served_model_name)
        return _Turn(req, response, conversation, prompt, params, mode, named, time.monotonic())

    def _usage(
        self, turn: _Turn, output: RequestOutput | None, reasoning: str | None
    ) -> ResponseUsage:
        out_tokens = len(output.outputs[0].token_ids) if output is not None else 0
        cached = output.num_cached_prompt_tokens if output is not None else 0
        reasoning_tokens = len(self.server.encode(reasoning, False)) if reasoning else 0
        return ResponseUsage(
            input_tokens=len(turn.prompt),
            input_tokens_details=InputTokensDetails(
                cached_tokens=cached, cache_write_tokens=len(turn.prompt) - cached
            ),
            output_tokens=out_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
            total_tokens=len(turn.prompt) + out_tokens,
        )

    def _finish(
        self,
        turn: _Turn,
        output: RequestOutput | None,
        status: str | None,
        error: ResponseError | None = None,
        items: list[Any] | None = None,
        reasoning: str | None = None,
    ) -> None:
        """Fill in the final response (from `output`, or `items` when streamed), log it and
        store it; `status` given: the response ended without an output (cancelled, failed)."""
        response = turn.response
        if status is None and output is not None:
            out = output.outputs[0]
            cut = out.finish_reason == "length"
            if items is None:
                items, reasoning = output_items(
                    out.text, self.server.reasoning_parser, turn.mode, turn.named, cut
                )
            status = "incomplete" if cut else "completed"
            if cut:
                response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        response.status = status  # type: ignore[assignment]
        response.error = error
        response.output = items or []
        response.usage = self._usage(turn, output, reasoning)
        self.server.log_finished(
            response.id,
            len(turn.prompt),
            response.usage.output_tokens,
            turn.start,
            status or "finished",
        )
        self._save(turn, response.output)

    def _save(self, turn: _Turn, items: list[Any]) -> None:
        if turn.req.store:
            self.store.put(
                turn.response.model_copy(deep=True),
                turn.conversation + ([assistant_message(items)] if items else []),
            )

    def _closed(self, turn: _Turn, running: _Running) -> None:
        """A streamed response's end, however it came (done, disconnect)."""
        running.stream.close()
        self.running.pop(turn.response.id, None)
        if turn.response.status == "in_progress":  # the client left mid-stream
            self._finish(turn, None, "cancelled")

    async def _events(self, turn: _Turn, running: _Running) -> AsyncIterator[str]:
        writer = EventWriter(
            turn.response.model_copy(deep=True), self.server.reasoning_parser, turn.mode, turn.named
        )
        for line in writer.start():
            yield line
        hold_back = max(map(len, turn.params.stop_strings), default=1) - 1
        sent, final = 0, None
        async for output in _until_cancelled(running):
            if is_failed(output):
                info = error_of(output).error
                self._finish(
                    turn,
                    None,
                    "failed",
                    ResponseError(code=info.code or "server_error", message=info.message),
                )
                writer.response = turn.response
                yield writer.end()
                return
            out = output.outputs[0]
            delta, sent = text_delta(out, sent, hold_back)
            finished = out.finish_reason is not None
            for line in writer.feed(delta, finished, cut=out.finish_reason == "length"):
                yield line
            if finished:
                final = output
        if final is None:  # cancelled
            self._finish(turn, None, "cancelled")
        else:
            self._finish(
                turn, final, None, items=writer.items, reasoning=writer.reasoning_text or None
            )
        self.running.pop(turn.response.id, None)
        writer.response = turn.response
        yield writer.end()


async def _until_cancelled(running: _Running) -> AsyncIterator[RequestOutput]:
    """The stream's outputs until it ends or the response is cancelled."""
    stop = asyncio.ensure_future(running.cancelled.wait())
    try:
        while True:
            step = asyncio.ensure_future(running.stream.__anext__())
            done, _ = await asyncio.wait({step, stop}, return_when=asyncio.FIRST_COMPLETED)
            if step not in done:
                step.cancel()
                return
            try:
                _, output = step.result()
            except StopAsyncIteration:
                return
            yield output
    finally:
        stop.cancel()
