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
from minivllm.server.errors import APIError, bad_request
from minivllm.server.openai import protocol, response_models
from minivllm.server.openai.serving import OpenAIServer, json_response, usage_of
from minivllm.server.openai.streaming import SSEResponse, StreamFormat, sse, stream_choices


async def create_completion(server: OpenAIServer, request: Request) -> Response:
    req = await server.parse(request, protocol.CompletionRequest)
    params = await server.sampling_params(req, default_max_tokens=16, logprobs=req.logprobs)
    raw_prompts = requests.as_prompt_list(req.prompt)
    if not raw_prompts:
        raise bad_request("the prompt is empty: give at least one token", param="prompt")
    prompts = []
    for p in raw_prompts:
        if isinstance(p, str):
            prompts.append(await asyncio.to_thread(server.encode, p, True))
        else:
            prompts.append(list(p))
    echo = [_echo_text(server, p) for p in raw_prompts] if req.echo else None  # per prompt
    request_id = f"cmpl-{uuid.uuid4().hex}"
    start = time.monotonic()
    stream = await server.start(request_id, prompts, params)
    call = _Call(
        server,
        request_id,
        stream,
        len(prompts) * params.n,
        params.n,
        sum(map(len, prompts)),
        start,
        echo,
    )
    if req.stream:
        return SSEResponse(_stream(call, params, req.include_usage), on_close=stream.close)
    try:
        outputs = await server.collect(request, stream, call.num_choices)
    except APIError as exc:
        server.log_finished(request_id, call.prompt_tokens, 0, start, f"failed ({exc.status})")
        raise
    return json_response(_response(call, outputs))


@dataclass
class _Call:
    """One completions request in flight: what its response is built from."""

    server: OpenAIServer
    request_id: str
    stream: RequestStream
    num_choices: int  # prompts x n
    n: int
    prompt_tokens: int
    start: float  # time.monotonic() at the add
    echo: list[str] | None  # per prompt, with echo

    def response(self, choices: list[response_models.CompletionChoice], **kw: Any) -> Any:
        return response_models.CompletionResponse(
            id=self.request_id, model=self.server.served_model_name, choices=choices, **kw
        )


def _response(call: _Call, outputs: list[RequestOutput]) -> response_models.CompletionResponse:
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


def _stream(call: _Call, params: Any, include_usage: bool) -> AsyncIterator[str]:
    formatter = call.server.logprobs

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
        usage_chunk=(lambda usage: sse(call.response([], usage=usage))) if include_usage else None,
        first_chunk=echo_chunk if call.echo is not None else None,
    )
    return stream_choices(
        call.stream,
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
