"""POST /v1/chat/completions: a conversation through the model's chat template, n choices,
streamed as role, content deltas and finish, or answered at once.

With `tools`, the answer's tool calls are read back (`tools.py`); with the server's
`--reasoning-parser`, its `<think>` part becomes `reasoning_content` (`reasoning.py`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from minivllm.engine.runtime.async_engine import RequestStream
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.server.errors import APIError, bad_request, bad_value
from minivllm.server.openai import protocol, response_models, tools
from minivllm.server.openai.reasoning import ReasoningStream, split_reasoning
from minivllm.server.openai.serving import OpenAIServer, json_response, usage_of
from minivllm.server.openai.streaming import SSEResponse, StreamFormat, sse, stream_choices


async def prepare_chat(
    server: OpenAIServer, req: protocol.ChatCompletionRequest, logprobs: int | None
) -> tuple[SamplingParams, tools.Mode, list[int]]:
    """What a chat request runs as (the Responses API's too): its sampling parameters (the
    default max_tokens fitted to the prompt), its tool mode and its prompt token ids."""
    params = await server.sampling_params(
        req, default_max_tokens=server.default_sampling.get("max_tokens"), logprobs=logprobs
    )
    try:
        mode = tools.mode_of(req.tools, req.tool_choice)
    except ValueError as exc:
        raise bad_value(exc) from None
    prompt = await asyncio.to_thread(chat_prompt, server, req, mode)
    return server.fit_default_max_tokens(req, params, len(prompt)), mode, prompt


async def create_chat_completion(server: OpenAIServer, request: Request) -> Response:
    req = await server.parse(request, protocol.ChatCompletionRequest)
    num_top = req.top_logprobs or 0
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    params, mode, prompt = await prepare_chat(server, req, num_top if req.logprobs else None)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    start = time.monotonic()
    stream = await server.start(request_id, [prompt], params, req.model)
    named = req.tool_choice.function.name if mode == "named" else None  # type: ignore[union-attr]
    call = _Call(server, request_id, stream, params, num_top, len(prompt), start, mode, named)
    if req.stream:
        return SSEResponse(_stream(call, req.include_usage), on_close=stream.close)
    try:
        outputs = await server.collect(request, stream, params.n)
    except APIError as exc:
        server.log_finished(request_id, len(prompt), 0, start, f"failed ({exc.status})")
        raise
    return json_response(_response(call, outputs))


def chat_prompt(
    server: OpenAIServer, req: protocol.ChatCompletionRequest, mode: tools.Mode
) -> list[int]:
    """The prompt's token ids, through the chat template (the server's --chat-template, else
    the model's), the tools and the template kwargs (the server's defaults, then the
    request's)."""
    try:
        messages = [m.template_dict() for m in req.messages]
    except ValueError as exc:
        raise bad_request(str(exc), param="messages") from None
    tool_dicts = tools.template_tools(req.tools, mode)
    template = server.chat_template or getattr(server.tokenizer, "chat_template", None)
    if tool_dicts and "tools" not in str(template or ""):
        messages, tool_dicts = tools.with_fallback_prompt(messages, tool_dicts), None
    text = server.chat_text(
        messages, req.add_generation_prompt, tool_dicts, req.chat_template_kwargs
    )
    return server.encode(text, add_special_tokens=False)


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
    mode: tools.Mode
    named: str | None  # the function tool_choice names

    def chunk(self, choices: list[response_models.ChatChunkChoice], **kw: Any) -> str:
        return sse(
            response_models.ChatCompletionChunk(
                id=self.request_id, model=self.server.served_model_name, choices=choices, **kw
            )
        )

    def message(self, text: str) -> tuple[response_models.ChatMessageOut, bool]:
        """A finished output as the assistant's message, and whether it calls tools."""
        reasoning = None
        if self.server.reasoning_parser is not None:
            reasoning, text = split_reasoning(self.server.reasoning_parser, text)
        content, calls = tools.parse_calls(text, self.mode, self.named)
        message = response_models.ChatMessageOut(
            content=content, reasoning_content=reasoning, tool_calls=calls
        )
        return message, bool(calls)


def finish_reason_of(engine_reason: str | None, has_calls: bool) -> str | None:
    """A choice's finish_reason: "tool_calls" when it calls tools, unless max_tokens cut it
    ("length": the client learns that the call's arguments may be incomplete)."""
    if has_calls and engine_reason != "length":
        return "tool_calls"
    return engine_reason


def _response(call: _Call, outputs: list[RequestOutput]) -> response_models.ChatCompletionResponse:
    choices = []
    for index, output in enumerate(outputs):
        out = output.outputs[0]
        message, has_calls = call.message(out.text)
        choices.append(
            response_models.ChatChoice(
                index=index,
                message=message,
                logprobs=call.server.logprobs.chat(out, 0, call.num_top),
                finish_reason=finish_reason_of(out.finish_reason, has_calls),
            )
        )
    usage = usage_of(call.prompt_tokens, outputs, call.params.n)
    call.server.log_finished(
        call.request_id, call.prompt_tokens, usage.completion_tokens, call.start, "finished"
    )
    return response_models.ChatCompletionResponse(
        id=call.request_id, model=call.server.served_model_name, choices=choices, usage=usage
    )


def _stream(call: _Call, include_usage: bool) -> AsyncIterator[str]:
    splitter = _DeltaSplitter(call)

    def choice(index: int, delta: str, logprobs: Any, finish_reason: str | None) -> str:
        message, has_calls = splitter.delta(index, delta, finish_reason is not None)
        if finish_reason is not None:
            finish_reason = finish_reason_of(finish_reason, has_calls)
        if message is None and finish_reason is None and logprobs is None:
            return ""  # everything held back this step
        return call.chunk(
            [
                response_models.ChatChunkChoice(
                    index=index,
                    delta=message or response_models.DeltaMessage(content=""),
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                )
            ]
        )

    roles = tuple(
        call.chunk(
            [
                response_models.ChatChunkChoice(
                    index=i, delta=response_models.DeltaMessage(role="assistant", content="")
                )
            ]
        )
        for i in range(call.params.n)
    )
    fmt = StreamFormat(
        logprobs_of=lambda out, state: call.server.logprobs.chat(
            out, state.tokens_sent, call.num_top
        ),
        choice_chunk=choice,
        usage_chunk=(lambda usage: call.chunk([], usage=usage)) if include_usage else None,
        preamble=roles,
    )
    return stream_choices(
        call.stream,
        call.params,
        call.params.n,
        call.prompt_tokens,
        fmt,
        on_end=lambda tokens, how: call.server.log_finished(
            call.request_id, call.prompt_tokens, tokens, call.start, how
        ),
        n=call.params.n,
    )


class _DeltaSplitter:
    """Per streamed choice: text deltas into reasoning, content and tool-call deltas."""

    def __init__(self, call: _Call) -> None:
        self.call = call
        self.reasoning: dict[int, ReasoningStream] = {}
        self.tools: dict[int, tools.ToolStream] = {}

    def delta(self, index: int, text: str, finished: bool) -> tuple[Any, bool]:
        """(a DeltaMessage, or None if nothing is to be sent; whether it calls tools)."""
        reasoning = ""
        parser = self.call.server.reasoning_parser
        if parser is not None:
            stream = self.reasoning.setdefault(index, ReasoningStream(parser))
            reasoning, text = stream.feed(text, finished)
        if self.call.mode != "none":
            stream_t = self.tools.setdefault(
                index, tools.ToolStream(self.call.mode, self.call.named)
            )
            text, calls = stream_t.feed(text, finished)
        else:
            calls = []
        if not (reasoning or text or calls):
            return None, False
        deltas = [
            response_models.DeltaToolCall(index=i, id=c.id, type="function", function=c.function)
            for i, c in enumerate(calls)
        ]
        return response_models.DeltaMessage(
            content=text or None, reasoning_content=reasoning or None, tool_calls=deltas or None
        ), bool(calls)
