"""POST /v1/completions: one prompt or a batch (strings or token ids), n choices each, with
`echo` (the prompt, and its logprobs, before the completion), streamed or not."""

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
from minivllm.engine.runtime.async_engine import RequestStream
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.server.errors import APIError, bad_request
from minivllm.server.openai import protocol, response_models
from minivllm.server.openai.serving import OpenAIServer, json_response, usage_of
from minivllm.server.openai.streaming import SSEResponse, StreamFormat, sse, stream_choices


async def create_completion(server: OpenAIServer, request: Request) -> Response:
    """One straight pipeline: parse -> submit -> stream -> format."""
    call = await _parse(server, request)
    stream = await server.start(call.request_id, call.prompts, call.params, call.model)
    if call.streamed:
        return SSEResponse(_stream(call, stream), on_close=stream.close)
    try:
        outputs = await server.collect(request, stream, call.num_choices)
    except APIError as exc:
        server.log_finished(
            call.request_id, call.prompt_tokens, 0, call.start, f"failed ({exc.status})"
        )
        raise
    return json_response(_format(call, outputs))


@dataclass
class _Call:
    """One completions request, parsed: what it runs as and what its response is built from."""

    server: OpenAIServer
    request_id: str
    params: SamplingParams
    prompts: list[list[int]]  # token ids per prompt
    echo: list[str] | None  # per prompt, with echo
    streamed: bool
    include_usage: bool  # a streamed request's usage chunk
    start: float  # time.monotonic() when parsed
    model: str | None  # the request's `model`: a LoRA adapter's name routes to it

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def num_choices(self) -> int:  # prompts x n
        return len(self.prompts) * self.n

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    def response(self, choices: list[response_models.CompletionChoice], **kw: Any) -> Any:
        return response_models.CompletionResponse(
            id=self.request_id, model=self.server.served_model_name, choices=choices, **kw
        )


async def _parse(server: OpenAIServer, request: Request) -> _Call:
    """The body, its sampling parameters and its prompts as token ids; 400 if any is bad."""
    req = await server.parse(request, protocol.CompletionRequest)
    params = await server.sampling_params(req, default_max_tokens=16, logprobs=req.logprobs)
    raw_prompts = requests.as_prompt_list(req.prompt)
    if not raw_prompts:
        raise bad_request("the prompt is empty: give at least one token", param="prompt")
    prompts = []
    for p in raw_prompts:
        if isinstance(p, str):
            prompts.append(await asyncio.to_thread(server.encode, p, True))
        else:  # the protocol admits text or token ids only, never a prompt dict
            assert isinstance(p, list)
            prompts.append(list(p))
    echo = [_echo_text(server, p) for p in raw_prompts] if req.echo else None
    return _Call(
        server,
        f"cmpl-{uuid.uuid4().hex}",
        params,
        prompts,
        echo,
        bool(req.stream),
        req.include_usage,
        time.monotonic(),
        req.model,
    )


def _format(call: _Call, outputs: list[RequestOutput]) -> response_models.CompletionResponse:
    """The finished choices as one CompletionResponse (echo, logprobs, usage)."""
    formatter = call.server.logprobs
    choices = []
    for index, output in enumerate(outputs):
        out = output.outputs[0]
        text = out.text if call.echo is None else call.echo[index // call.n] + out.text
        offset = len(text) - len(out.text)
        if call.echo is None:
            logprobs = formatter.completion(out, 0, offset)
        else:  # the prompt's tokens come first
            logprobs = formatter.echo_and_completion(output, offset)
        choices.append(
            response_models.CompletionChoice(
                index=index, text=text, logprobs=logprobs, finish_reason=out.finish_reason
            )
        )
    usage = usage_of(call.prompt_tokens, outputs, call.n)
    call.server.log_finished(
        call.request_id, call.prompt_tokens, usage.completion_tokens, call.start, "finished"
    )
    return call.response(choices, usage=usage)


def _stream(call: _Call, stream: RequestStream) -> AsyncIterator[str]:
    formatter, params = call.server.logprobs, call.params

    def choice(index: int, delta: str, logprobs: Any, finish_reason: str | None) -> str:
        return sse(
            call.response(
                [
                    response_models.CompletionChoice(
                        index=index, text=delta, logprobs=logprobs, finish_reason=finish_reason
                    )
                ]
            )
        )

    def echo_chunk(index: int, output: RequestOutput) -> tuple[str, int]:
        """The echoed prompt, as the choice's first chunk, and its length."""
        assert call.echo is not None
        text = call.echo[index // call.n]
        logprobs = formatter.echo(output) if params.logprobs is not None else None
        return choice(index, text, logprobs, None), len(text)

    fmt = StreamFormat(
        logprobs_of=lambda out, state: formatter.completion(
            out, state.tokens_sent, state.offset + state.text_sent
        ),
        choice_chunk=choice,
        usage_chunk=(lambda usage: sse(call.response([], usage=usage)))
        if call.include_usage
        else None,
        first_chunk=echo_chunk if call.echo is not None else None,
    )
    return stream_choices(
        stream,
        params,
        call.num_choices,
        call.prompt_tokens,
        fmt,
        on_end=lambda tokens, how: call.server.log_finished(
            call.request_id, call.prompt_tokens, tokens, call.start, how
        ),
        n=call.n,
    )


def _echo_text(server: OpenAIServer, prompt: Any) -> str:
    """What `echo` puts before the completion: the prompt string as given, token ids
    decoded."""
    if isinstance(prompt, str):
        return prompt
    return server.tokenizer.decode(prompt) if server.tokenizer is not None else ""
