"""POST /v1/chat/completions: a conversation through the model's chat template, n choices,
streamed as role, content deltas and finish, or answered at once."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from minivllm.engine import requests
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.server import protocol, responses
from minivllm.server.async_engine import RequestStream
from minivllm.server.errors import APIError, bad_request
from minivllm.server.serving import OpenAIServer, json_response, usage_of
from minivllm.server.streaming import SSEResponse, StreamFormat, sse, stream_choices


async def create_chat_completion(server: OpenAIServer, request: Request) -> Response:
    req = await server.parse(request, protocol.ChatCompletionRequest)
    num_top = req.top_logprobs or 0
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    params = await server.sampling_params(
        req, default_max_tokens=None, logprobs=num_top if req.logprobs else None
    )
    prompt = await asyncio.to_thread(chat_prompt, server, req)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    start = time.monotonic()
    stream = await server.start(request_id, [prompt], params)
    call = _Call(server, request_id, stream, params, num_top, len(prompt), start)
    if req.stream:
        return SSEResponse(_stream(call, req.include_usage), on_close=stream.close)
    try:
        outputs = await server.collect(request, stream, params.n)
    except APIError as exc:
        server.log_finished(request_id, len(prompt), 0, start, f"failed ({exc.status})")
        raise
    return json_response(_response(call, outputs))


def chat_prompt(server: OpenAIServer, req: protocol.ChatCompletionRequest) -> list[int]:
    """The prompt's token ids, through the model's chat template."""
    try:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    except ValueError as exc:
        raise bad_request(str(exc), param="messages") from None
    try:
        return requests.chat_prompt(
            server.tokenizer, messages, add_generation_prompt=req.add_generation_prompt
        )
    except requests.NoChatTemplateError:
        raise bad_request("this model has no chat template: use /v1/completions") from None
    except ValueError as exc:
        raise bad_request(str(exc), param="messages") from None


@dataclass
class _Call:
    """One chat request in flight: what its response is built from."""

    server: OpenAIServer
    request_id: str
    stream: RequestStream
    params: SamplingParams
    num_top: int  # top_logprobs
    prompt_tokens: int
    start: float  # time.monotonic() at the add

    def chunk(self, choices: list[responses.ChatChunkChoice], **kw: Any) -> str:
        return sse(responses.ChatCompletionChunk(
            id=self.request_id, model=self.server.served_model_name, choices=choices, **kw
        ))


def _response(call: _Call, outputs: list[RequestOutput]) -> responses.ChatCompletionResponse:
    choices = []
    for index, output in enumerate(outputs):
        out = output.outputs[0]
        choices.append(responses.ChatChoice(
            index=index,
            message=responses.ChatMessageOut(content=out.text),
            logprobs=call.server.logprobs.chat(out, 0, call.num_top),
            finish_reason=out.finish_reason,
        ))
    usage = usage_of(call.prompt_tokens, outputs)
    call.server.log_finished(
        call.request_id, call.prompt_tokens, usage.completion_tokens, call.start, "finished"
    )
    return responses.ChatCompletionResponse(
        id=call.request_id, model=call.server.served_model_name, choices=choices, usage=usage
    )


def _stream(call: _Call, include_usage: bool) -> AsyncIterator[str]:
    def choice(index: int, delta: str, logprobs: Any, finish_reason: str | None) -> str:
        return call.chunk([responses.ChatChunkChoice(
            index=index, delta=responses.DeltaMessage(content=delta), logprobs=logprobs,
            finish_reason=finish_reason,
        )])

    roles = tuple(
        call.chunk([responses.ChatChunkChoice(
            index=i, delta=responses.DeltaMessage(role="assistant", content="")
        )])
        for i in range(call.params.n)
    )
    fmt = StreamFormat(
        logprobs_of=lambda out, state: call.server.logprobs.chat(
            out, state.tokens_sent, call.num_top),
        choice_chunk=choice,
        usage_chunk=(lambda usage: call.chunk([], usage=usage)) if include_usage else None,
        preamble=roles,
    )
    return stream_choices(
        call.stream, call.params, call.params.n, call.prompt_tokens, fmt,
        on_end=lambda tokens, how: call.server.log_finished(
            call.request_id, call.prompt_tokens, tokens, call.start, how),
    )
