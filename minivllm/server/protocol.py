"""The HTTP API's typed shapes: OpenAI's request and response bodies, as pydantic models.

Requests are validated strictly (a string where a number belongs is a 400, not coerced) and
unknown fields are ignored, as OpenAI clients send fields this server does not use.
`to_sampling_params` turns a request into the engine's SamplingParams; its ValueErrors carry
the message the client sees.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from minivllm.sampling_params import SamplingParams

MAX_N = 128  # choices per request
MAX_STOP = 64  # stop strings per request
MAX_LOGPROBS = 20  # top log-probabilities per token


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    """The fields completions and chat completions share (OpenAI's and vLLM's extras)."""

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's) -> bias
    # vLLM's extras
    repetition_penalty: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True

    def sampling_params(
        self, default_max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams:
        """The engine's SamplingParams; ValueError with a client-facing message if invalid."""
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n}")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise ValueError(f"stop may hold at most {MAX_STOP} strings, got {len(self.stop)}")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}")
        max_tokens = self.max_tokens if self.max_tokens is not None else self.max_completion_tokens
        return SamplingParams(
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=_token_biases(self.logit_bias),
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _token_biases(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    if not logit_bias:
        return None
    biases = {}
    for key, bias in logit_bias.items():
        if not key.strip().isdigit():
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        biases[int(key)] = bias
    return biases


class CompletionRequest(_SamplingRequest):
    # A string, token ids, or a batch of either (one set of n choices per prompt).
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False  # the prompt before the completion (its logprobs too, with logprobs)
    # OpenAI's fields this server does not implement: a 400 if a client asks for them, rather
    # than an answer that silently differs from what it asked for.
    best_of: int | None = None
    suffix: str | None = None

    def sampling_params(
        self, default_max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of is not supported (only best_of == n), got {self.best_of}")
        if self.suffix:
            raise ValueError("suffix is not supported")
        params = super().sampling_params(default_max_tokens, logprobs)
        if self.echo and logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=logprobs)
        return params


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text; a list of parts must be text parts only."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"only text content parts are supported, got {part.type!r}")
            texts.append(part.text)
        return "".join(texts)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM's extra


# ---- responses --------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []  # None for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "minivllm"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


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
