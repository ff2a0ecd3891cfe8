"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncLLMEngine.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health,
GET /metrics. Every error has OpenAI's shape `{"error": {message, type, param, code}}`:
400 bad input (malformed JSON, non-UTF-8, invalid parameters, a prompt too long), 401 a
missing or wrong API key, 404 an unknown model or route, 413 a body over the limit, 500 an
engine fault, 503 an overloaded waiting queue or a server shutting down.

Streaming follows OpenAI's server-sent events: one `data: {chunk}` per committed step,
`data: [DONE]` at the end; a request that fails mid-stream gets `data: {"error": ...}`.
A client that disconnects (streamed or not) has its request aborted at once.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.server import api
from minivllm.server.async_engine import (
    AsyncLLMEngine,
    QueueFullError,
    RequestStream,
    ShuttingDownError,
)
from minivllm.server.metrics import ServerMetrics

logger = logging.getLogger("minivllm.server")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_WAITING_REQUESTS = 1024


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
        body = api.error_body(self.message, self.type, self.param, self.code)
        return JSONResponse(body, status_code=self.status)


def _bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# ---- body-size limit ----------------------------------------------------------------------


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


# ---- streaming response that always releases its request ---------------------------------


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that calls `on_close` however it ends (done, disconnect, cancel),
    even if the body iterator never started."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _sse(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


# ---- per-choice streaming state -------------------------------------------------------------


@dataclass
class _ChoiceState:
    """What one choice has sent so far, to turn cumulative outputs into deltas."""

    text_sent: int = 0  # characters of the cumulative text already sent
    tokens_sent: int = 0  # completion tokens whose logprobs were already sent
    started: bool = False  # the choice's first chunk (an echoed prompt) went out
    offset: int = 0  # characters sent before the completion's text (the echoed prompt)


def _text_delta(out: CompletionOutput, sent: int, hold_back: int) -> tuple[str, int]:
    """The new text of a cumulative output, and the new count of characters sent.

    While running, hold back the last `hold_back` characters (a stop string may be forming;
    the engine cuts it from the text once complete) and a trailing incomplete UTF-8
    character ('\\ufffd', completed by a later token)."""
    text = out.text
    end = len(text)
    if out.finish_reason is None:
        end -= hold_back
        while end > sent and text[end - 1] == "\ufffd":
            end -= 1
    end = max(end, sent)
    return text[sent:end], end


# ---- the app --------------------------------------------------------------------------------


class OpenAIServer:
    """The routes' logic, over one AsyncLLMEngine."""

    def __init__(
        self,
        engine: LLMEngine,
        served_model_name: str,
        api_key: str | None,
        max_waiting_requests: int | None,
    ) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.max_model_len
        self.metrics = ServerMetrics(lambda: self.async_engine.stats)
        self.async_engine = AsyncLLMEngine(
            engine, max_waiting_requests=max_waiting_requests, on_output=self.metrics.on_output
        )
        self._token_text: dict[int, str] = {}

    # ---- request handling --------------------------------------------------------------

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            raise APIError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                type="authentication_error",
                code="invalid_api_key",
            )

    async def parse(self, request: Request, model: type[api._SamplingRequest]) -> Any:
        self.check_auth(request)
        body = await request.body()
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _bad_request(f"the request body is not valid UTF-8: {exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise _bad_request(f"the request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise _bad_request("the request body must be a JSON object")
        try:
            parsed = model.model_validate(data)
        except ValidationError as exc:
            raise _validation_error(exc) from None
        if parsed.model is not None and parsed.model != self.served_model_name:
            raise APIError(
                404,
                f"the model {parsed.model!r} does not exist; this server serves "
                f"{self.served_model_name!r}",
                param="model",
                code="model_not_found",
            )
        return parsed

    def sampling_params(
        self, req: api._SamplingRequest, default_max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams:
        try:
            return req.sampling_params(default_max_tokens, logprobs)
        except ValueError as exc:
            raise _bad_request(str(exc), param=_param_of(str(exc))) from None

    def encode(self, prompt: str, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            raise _bad_request("this model has no tokenizer: send the prompt as token ids")
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise _bad_request("the prompt is empty: give at least one token", param="prompt")
        if self.max_model_len is not None and len(token_ids) >= self.max_model_len:
            raise _bad_request(
                f"the prompt has {len(token_ids)} tokens, but this model's max_model_len is "
                f"{self.max_model_len}: shorten the prompt",
                param="prompt",
            )

    async def start(
        self, request_id: str, prompts: list[list[int]], params: SamplingParams
    ) -> RequestStream:
        """Add n choices per prompt (seed + i for choice i when seeded)."""
        for prompt in prompts:
            self.check_prompt(prompt)
        choices = []
        for prompt in prompts:
            for i in range(params.n):
                seed = None if params.seed is None else params.seed + i
                choices.append((prompt, replace(params, n=1, seed=seed)))
        try:
            return await self.async_engine.add_request(request_id, choices)
        except QueueFullError as exc:
            raise APIError(503, str(exc), type="service_unavailable", code="overloaded") from None
        except ShuttingDownError as exc:
            raise APIError(
                503, str(exc), type="service_unavailable", code="shutting_down"
            ) from None
        except (ValueError, TypeError) as exc:
            raise _bad_request(str(exc), param=_param_of(str(exc))) from None

    async def collect(
        self, request: Request, stream: RequestStream, num_choices: int
    ) -> list[RequestOutput]:
        """The final output of every choice; aborts if the client disconnects first."""
        finals: list[RequestOutput | None] = [None] * num_choices

        async def drain() -> None:
            async for index, output in stream:
                if output.finished:
                    finals[index] = output

        drain_task = asyncio.ensure_future(drain())
        watch_task = asyncio.ensure_future(_until_disconnected(request))
        try:
            await asyncio.wait({drain_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch_task.cancel()
            if not drain_task.done():
                drain_task.cancel()
            stream.close()
        if not drain_task.done() or drain_task.cancelled():
            raise APIError(499, "the client disconnected", code="client_disconnected")
        drain_task.result()
        outputs = [f for f in finals if f is not None]
        for output in outputs:
            _raise_if_failed(output)
        return outputs

    def log_finished(
        self, request_id: str, prompt_tokens: int, completion_tokens: int, start: float, how: str
    ) -> None:
        logger.info(
            "request %s %s: prompt_tokens=%d completion_tokens=%d latency=%.3fs",
            request_id,
            how,
            prompt_tokens,
            completion_tokens,
            time.monotonic() - start,
        )

    # ---- logprobs -------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""
            if len(self._token_text) < 1 << 16:
                self._token_text[token_id] = text
        return text

    def completion_logprobs(
        self, out: CompletionOutput, start: int, offset: int
    ) -> api.CompletionLogprobs | None:
        if out.logprobs is None:
            return None
        return self.logprobs_of_tokens(out.token_ids[start:], out.logprobs[start:], offset)

    def logprobs_of_tokens(
        self, token_ids: list[int], scores: list[dict[int, float] | None], offset: int
    ) -> api.CompletionLogprobs:
        """OpenAI's completions logprobs of `token_ids`, the first at character `offset`; a
        None score (an echoed prompt's first token) has no logprobs."""
        result = api.CompletionLogprobs()
        for token_id, top in zip(token_ids, scores, strict=False):
            text = self.token_text(token_id)
            result.tokens.append(text)
            result.token_logprobs.append(None if top is None else top.get(token_id, -math.inf))
            result.top_logprobs.append(None if top is None else self.by_text(top))
            result.text_offset.append(offset)
            offset += len(text)
        return result

    def by_text(self, top: dict[int, float]) -> dict[str, float]:
        """Token id -> logprob as OpenAI's token text -> logprob, most likely first."""
        return {self.token_text(t): lp for t, lp in sorted(top.items(), key=lambda kv: -kv[1])}

    def echo_logprobs(self, output: RequestOutput) -> api.CompletionLogprobs:
        """OpenAI's logprobs of an echoed prompt: every prompt token, None for the first."""
        scores = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
        return self.logprobs_of_tokens(output.prompt_token_ids, scores, 0)

    def echo_text(self, prompt: str | list[int]) -> str:
        """What `echo` puts before the completion: the prompt string as given, token ids
        decoded."""
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(prompt) if self.tokenizer is not None else ""

    def chat_logprobs(
        self, out: CompletionOutput, start: int, num_top: int
    ) -> api.ChatLogprobs | None:
        if out.logprobs is None:
            return None
        content = []
        for token_id, top in zip(out.token_ids[start:], out.logprobs[start:], strict=False):
            text = self.token_text(token_id)
            best = sorted(top.items(), key=lambda kv: -kv[1])[:num_top]
            content.append(
                api.TokenLogprob(
                    token=text,
                    logprob=top.get(token_id, float("-inf")),
                    bytes=list(text.encode()),
                    top_logprobs=[
                        api.TopLogprob(
                            token=self.token_text(t),
                            logprob=lp,
                            bytes=list(self.token_text(t).encode()),
                        )
                        for t, lp in best
                    ],
                )
            )
        return api.ChatLogprobs(content=content)

    # ---- /v1/completions ------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        req: api.CompletionRequest = await self.parse(request, api.CompletionRequest)
        params = self.sampling_params(req, default_max_tokens=16, logprobs=req.logprobs)
        raw = req.prompt
        if isinstance(raw, str):
            raw_prompts: list[str | list[int]] = [raw]
        elif raw and all(isinstance(t, int) for t in raw):
            raw_prompts = [raw]  # type: ignore[list-item]
        else:
            raw_prompts = list(raw)  # type: ignore[arg-type]
        if not raw_prompts:
            raise _bad_request("the prompt is empty: give at least one token", param="prompt")
        prompts = []
        for p in raw_prompts:
            if isinstance(p, str):
                prompts.append(await asyncio.to_thread(self.encode, p, True))
            else:
                prompts.append(list(p))
        echo = [self.echo_text(p) for p in raw_prompts] if req.echo else None  # per prompt
        request_id = f"cmpl-{uuid.uuid4().hex}"
        start = time.monotonic()
        stream = await self.start(request_id, prompts, params)
        num_choices = len(prompts) * params.n
        prompt_tokens = sum(map(len, prompts))
        if req.stream:
            gen = self.stream_completion(
                request_id, stream, params, num_choices, prompt_tokens, req.include_usage, start,
                echo,
            )
            return _SSEResponse(gen, on_close=stream.close)
        try:
            outputs = await self.collect(request, stream, num_choices)
        except APIError as exc:
            self.log_finished(request_id, prompt_tokens, 0, start, f"failed ({exc.status})")
            raise
        choices = []
        for index, output in enumerate(outputs):
            out = output.outputs[0]
            text = out.text if echo is None else echo[index // params.n] + out.text
            logprobs = self.completion_logprobs(out, 0, len(text) - len(out.text))
            if echo is not None and logprobs is not None:  # the prompt's tokens come first
                prompt = self.echo_logprobs(output)
                logprobs = api.CompletionLogprobs(
                    tokens=prompt.tokens + logprobs.tokens,
                    token_logprobs=prompt.token_logprobs + logprobs.token_logprobs,
                    top_logprobs=prompt.top_logprobs + logprobs.top_logprobs,
                    text_offset=prompt.text_offset + logprobs.text_offset,
                )
            choices.append(
                api.CompletionChoice(
                    index=index, text=text, logprobs=logprobs, finish_reason=out.finish_reason
                )
            )
        usage = _usage(prompt_tokens, outputs)
        self.log_finished(request_id, prompt_tokens, usage.completion_tokens, start, "finished")
        body = api.CompletionResponse(
            id=request_id, model=self.served_model_name, choices=choices, usage=usage
        )
        return Response(body.model_dump_json(), media_type="application/json")

    async def stream_completion(
        self,
        request_id: str,
        stream: RequestStream,
        params: SamplingParams,
        num_choices: int,
        prompt_tokens: int,
        include_usage: bool,
        start: float,
        echo: list[str] | None,
    ) -> AsyncIterator[str]:
        def echo_chunk(index: int, output: RequestOutput) -> tuple[str, int]:
            """The echoed prompt, as the choice's first chunk, and its length."""
            assert echo is not None
            text = echo[index // params.n]
            logprobs = self.echo_logprobs(output) if params.logprobs is not None else None
            return choice(index, text, logprobs, None), len(text)

        def choice(index: int, delta: str, logprobs: Any, finish_reason: str | None) -> str:
            return _sse(api.CompletionResponse(
                id=request_id, model=self.served_model_name,
                choices=[api.CompletionChoice(index=index, text=delta, logprobs=logprobs,
                                              finish_reason=finish_reason)],
            ))

        def usage(usage: api.Usage) -> str:
            return _sse(api.CompletionResponse(
                id=request_id, model=self.served_model_name, choices=[], usage=usage
            ))

        async for line in self.stream_choices(
            request_id, stream, params, num_choices, prompt_tokens, start,
            logprobs_of=lambda out, state: self.completion_logprobs(
                out, state.tokens_sent, state.offset + state.text_sent),
            choice_chunk=choice,
            usage_chunk=usage if include_usage else None,
            first_chunk=echo_chunk if echo is not None else None,
        ):
            yield line

    async def stream_choices(
        self,
        request_id: str,
        stream: RequestStream,
        params: SamplingParams,
        num_choices: int,
        prompt_tokens: int,
        start: float,
        logprobs_of: Callable[[CompletionOutput, _ChoiceState], Any],
        choice_chunk: Callable[[int, str, Any, str | None], str],
        usage_chunk: Callable[[api.Usage], str] | None,
        preamble: tuple[str, ...] = (),
        first_chunk: Callable[[int, RequestOutput], tuple[str, int]] | None = None,
    ) -> AsyncIterator[str]:
        """The SSE lines of a streamed request, completions and chat alike: one chunk per
        committed step and choice (text deltas, held back at a possible stop string or an
        incomplete character), an error event if the request failed, usage, `[DONE]`."""
        states = [_ChoiceState() for _ in range(num_choices)]
        hold_back = max(map(len, params.stop_strings), default=1) - 1
        completion_tokens = 0
        how = "aborted (client disconnected)"
        try:
            for line in preamble:
                yield line
            async for index, output in stream:
                out = output.outputs[0]
                if out.finish_reason in ("error", "abort"):
                    how = "failed"
                    yield _sse(_error_of(output).model_dump())
                    yield "data: [DONE]\n\n"
                    return
                state = states[index]
                if first_chunk is not None and not state.started:
                    line, state.offset = first_chunk(index, output)
                    yield line
                state.started = True
                delta, end = _text_delta(out, state.text_sent, hold_back)
                logprobs = logprobs_of(out, state)
                state.text_sent, state.tokens_sent = end, len(out.token_ids)
                if output.finished:
                    completion_tokens += len(out.token_ids)
                if not delta and out.finish_reason is None and params.logprobs is None:
                    continue
                yield choice_chunk(index, delta, logprobs, out.finish_reason)
            if usage_chunk is not None:
                yield usage_chunk(api.Usage(
                    prompt_tokens=prompt_tokens,
                    completion_tokens=completion_tokens,
                    total_tokens=prompt_tokens + completion_tokens,
                ))
            how = "finished"
            yield "data: [DONE]\n\n"
        finally:
            self.log_finished(request_id, prompt_tokens, completion_tokens, start, how)

    # ---- /v1/chat/completions -------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        req: api.ChatCompletionRequest = await self.parse(request, api.ChatCompletionRequest)
        num_top = req.top_logprobs or 0
        if req.top_logprobs is not None and not req.logprobs:
            raise _bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        params = self.sampling_params(
            req, default_max_tokens=None, logprobs=num_top if req.logprobs else None
        )
        prompt = await asyncio.to_thread(self.chat_prompt, req)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        start = time.monotonic()
        stream = await self.start(request_id, [prompt], params)
        if req.stream:
            gen = self.stream_chat(
                request_id, stream, params, num_top, len(prompt), req.include_usage, start
            )
            return _SSEResponse(gen, on_close=stream.close)
        try:
            outputs = await self.collect(request, stream, params.n)
        except APIError as exc:
            self.log_finished(request_id, len(prompt), 0, start, f"failed ({exc.status})")
            raise
        choices = []
        for index, output in enumerate(outputs):
            out = output.outputs[0]
            choices.append(
                api.ChatChoice(
                    index=index,
                    message=api.ChatMessageOut(content=out.text),
                    logprobs=self.chat_logprobs(out, 0, num_top),
                    finish_reason=out.finish_reason,
                )
            )
        usage = _usage(len(prompt), outputs)
        self.log_finished(request_id, len(prompt), usage.completion_tokens, start, "finished")
        body = api.ChatCompletionResponse(
            id=request_id, model=self.served_model_name, choices=choices, usage=usage
        )
        return Response(body.model_dump_json(), media_type="application/json")

    def chat_prompt(self, req: api.ChatCompletionRequest) -> list[int]:
        """The prompt's token ids, through the model's chat template."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise _bad_request("this model has no chat template: use /v1/completions")
        try:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        except ValueError as exc:
            raise _bad_request(str(exc), param="messages") from None
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=req.add_generation_prompt
            )
        except Exception as exc:  # the template rejects the conversation (jinja errors)
            raise _bad_request(
                f"the chat template rejected the messages: {exc}", param="messages"
            ) from None
        return self.encode(text, add_special_tokens=False)

    async def stream_chat(
        self,
        request_id: str,
        stream: RequestStream,
        params: SamplingParams,
        num_top: int,
        prompt_tokens: int,
        include_usage: bool,
        start: float,
    ) -> AsyncIterator[str]:
        def chunk(choice: api.ChatChunkChoice) -> str:
            return _sse(api.ChatCompletionChunk(
                id=request_id, model=self.served_model_name, choices=[choice]
            ))

        def choice(index: int, delta: str, logprobs: Any, finish_reason: str | None) -> str:
            return chunk(api.ChatChunkChoice(index=index, delta=api.DeltaMessage(content=delta),
                                             logprobs=logprobs, finish_reason=finish_reason))

        def usage(usage: api.Usage) -> str:
            return _sse(api.ChatCompletionChunk(
                id=request_id, model=self.served_model_name, choices=[], usage=usage
            ))

        roles = tuple(
            chunk(api.ChatChunkChoice(index=i, delta=api.DeltaMessage(role="assistant",
                                                                      content="")))
            for i in range(params.n)
        )
        async for line in self.stream_choices(
            request_id, stream, params, params.n, prompt_tokens, start,
            logprobs_of=lambda out, state: self.chat_logprobs(out, state.tokens_sent, num_top),
            choice_chunk=choice,
            usage_chunk=usage if include_usage else None,
            preamble=roles,
        ):
            yield line


def _usage(prompt_tokens: int, outputs: list[RequestOutput]) -> api.Usage:
    completion = sum(len(o.outputs[0].token_ids) for o in outputs)
    return api.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
    )


def _error_of(output: RequestOutput) -> api.ErrorResponse:
    if output.outputs[0].finish_reason == "abort":
        info = api.ErrorInfo(
            message=output.error or "the request was aborted",
            type="service_unavailable",
            code="aborted",
        )
    else:
        info = api.ErrorInfo(
            message=f"the engine failed while running this request: {output.error}",
            type="internal_server_error",
            code="engine_error",
        )
    return api.ErrorResponse(error=info)


def _raise_if_failed(output: RequestOutput) -> None:
    reason = output.outputs[0].finish_reason
    if reason in ("error", "abort"):
        error = _error_of(output).error
        raise APIError(
            500 if reason == "error" else 503, error.message, error.type, code=error.code
        )


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _param_of(message: str) -> str | None:
    """The parameter a SamplingParams message names first ("top_p must be ...")."""
    word = message.split(" ", 1)[0]
    known = {f for f in SamplingParams.__dataclass_fields__} | {"prompt"}
    return word if word in known else None


def _validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(x) for x in e["loc"]) or "body"
        parts.append(f"{loc}: {e['msg']}")
    first = errors[0]["loc"] if errors else ()
    param = str(first[0]) if first else None
    return _bad_request("invalid request: " + "; ".join(parts), param=param)


def create_app(
    engine: LLMEngine,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS,
) -> FastAPI:
    """An OpenAI-compatible app serving `engine`. Its engine thread starts with the app's
    lifespan and stops with it; `app.state.server` is the OpenAIServer (tests read it)."""
    name = served_model_name or _default_name(engine)
    server = OpenAIServer(engine, name, api_key, max_waiting_requests)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.async_engine.start()
        try:
            yield
        finally:
            server.async_engine.shutdown()
            close = getattr(engine, "close", None)
            if close is not None:  # a tensor-parallel runner's worker processes
                close()

    app = FastAPI(title="minivllm", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _bad_request(f"invalid request: {exc.errors()}").response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return APIError(
            500, f"internal error: {type(exc).__name__}", type="internal_server_error"
        ).response()

    @app.get("/health")
    async def health() -> Response:
        if not server.async_engine.is_running:
            return APIError(503, "the engine loop is not running", "service_unavailable").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        server.check_auth(request)
        card = api.ModelCard(id=server.served_model_name, max_model_len=server.max_model_len)
        return Response(api.ModelList(data=[card]).model_dump_json(), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.chat_completions(request)

    return app


def _default_name(engine: LLMEngine) -> str:
    model = engine.config.model
    if model is None:
        return "SmolLM2-135M-Instruct"
    return str(model).rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf")
