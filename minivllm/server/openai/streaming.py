"""Server-sent events, completions and chat alike: one `data: {chunk}` per committed step and
choice, `data: [DONE]` at the end; a request that fails mid-stream gets `data: {"error": ...}`.

The engine's outputs are cumulative; `stream_choices` turns them into per-choice deltas,
holding back text that may still change (a forming stop string, an incomplete character).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from minivllm.engine.runtime.async_engine import RequestStream
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.server.errors import error_of, is_failed
from minivllm.server.openai import response_models

DONE = "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
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


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event carrying `payload` as JSON."""
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


@dataclass
class ChoiceState:
    """What one choice has sent so far, to turn cumulative outputs into deltas."""

    text_sent: int = 0  # characters of the cumulative text already sent
    tokens_sent: int = 0  # completion tokens whose logprobs were already sent
    started: bool = False  # the choice's first chunk (an echoed prompt) went out
    offset: int = 0  # characters sent before the completion's text (the echoed prompt)


def text_delta(out: CompletionOutput, sent: int, hold_back: int) -> tuple[str, int]:
    """The new text of a cumulative output, and the new count of characters sent.

    While running, hold back the last `hold_back` characters (a stop string may be forming;
    the runtime cuts it from the text once complete) and a trailing incomplete UTF-8
    character ('\\ufffd', completed by a later token)."""
    text = out.text
    end = len(text)
    if out.finish_reason is None:
        end -= hold_back
        while end > sent and text[end - 1] == "\ufffd":
            end -= 1
    end = max(end, sent)
    return text[sent:end], end


ChoiceChunk = Callable[[int, str, Any, "str | None"], str]  # (index, delta, logprobs, finish)


@dataclass
class StreamFormat:
    """How one endpoint writes its events (the machinery in `stream_choices` is shared)."""

    logprobs_of: Callable[[CompletionOutput, ChoiceState], Any]
    choice_chunk: ChoiceChunk
    usage_chunk: Callable[[response_models.Usage], str] | None  # None: no usage chunk
    preamble: tuple[str, ...] = ()  # events before any output (chat's role deltas)
    # The choice's first event and the characters it sent (completions' echoed prompt).
    first_chunk: Callable[[int, RequestOutput], tuple[str, int]] | None = None


async def stream_choices(
    stream: RequestStream,
    params: SamplingParams,
    num_choices: int,
    prompt_tokens: int,
    fmt: StreamFormat,
    on_end: Callable[[int, str], None],
    n: int = 1,
) -> AsyncIterator[str]:
    """The SSE lines of a streamed request: one chunk per committed step and choice, an error
    event if the request failed, usage, `[DONE]` (n choices per prompt, prompt-major).
    `on_end(completion_tokens, how)` runs however the stream ends."""
    states = [ChoiceState() for _ in range(num_choices)]
    hold_back = max(map(len, params.stop_strings), default=1) - 1
    completion_tokens = 0
    cached: dict[int, int] = {}  # prompt index -> its prompt tokens served from the prefix cache
    how = "aborted (client disconnected)"
    try:
        for line in fmt.preamble:
            yield line
        async for index, output in stream:
            out = output.outputs[0]
            if is_failed(output):
                how = "failed"
                yield sse(error_of(output).model_dump())
                yield DONE
                return
            state = states[index]
            cached.setdefault(index // n, output.num_cached_prompt_tokens)
            if fmt.first_chunk is not None and not state.started:
                line, state.offset = fmt.first_chunk(index, output)
                yield line
            state.started = True
            delta, end = text_delta(out, state.text_sent, hold_back)
            logprobs = fmt.logprobs_of(out, state)
            state.text_sent, state.tokens_sent = end, len(out.token_ids)
            if output.finished:
                completion_tokens += len(out.token_ids)
            if not delta and out.finish_reason is None and params.logprobs is None:
                continue
            yield fmt.choice_chunk(index, delta, logprobs, out.finish_reason)
        if fmt.usage_chunk is not None:
            yield fmt.usage_chunk(
                response_models.make_usage(prompt_tokens, completion_tokens, sum(cached.values()))
            )
        how = "finished"
        yield DONE
    finally:
        on_end(completion_tokens, how)
