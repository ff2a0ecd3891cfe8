"""The HTTP API's request bodies: OpenAI's shapes with vLLM's extras, as pydantic models.

Requests are validated strictly (a string where a number belongs is a 400, not coerced). A
top-level field this server does not implement is a 400 that names it, rather than an answer
that silently differs from what was asked, unless it is one of INFORMATIONAL_FIELDS, which
do not change the answer. Inside messages unknown keys are ignored: clients send back the
assistant messages they received, with fields like `refusal`. `sampling_params` and
`constraint` turn a request into the engine's SamplingParams and structured-output spec;
their ValueErrors carry the message the client sees.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from minivllm.sampling_params import SamplingParams
from minivllm.server.openai.constraints import (
    Constraint,
    ResponseFormat,
    StructuredOutputsRequest,
    from_guided,
    from_response_format,
    from_structured_outputs,
    one_constraint,
)
from minivllm.server.openai.tools import NamedToolChoice, Tool, tool_constraint

MAX_N = 128  # choices per request
MAX_STOP = 64  # stop strings per request
MAX_LOGPROBS = 20  # top log-probabilities per token

# The one list of top-level fields accepted and ignored: they label or route a request but
# do not change its answer. Any other field this server does not know is a 400.
INFORMATIONAL_FIELDS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
    }
)

# SGLang's and vLLM's extras that vllm-router and sglang-router write into every request they
# forward, at their defaults. At the value below each asks for what this server does anyway
# (stop strings trimmed, reasoning split out by --reasoning-parser and streamed, no hidden
# states), so it is accepted; any other value is refused by name like an unknown field.
ROUTER_DEFAULTS: dict[str, object] = {
    "no_stop_trim": False,
    "continue_final_message": False,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "include_reasoning": True,
    "return_hidden_states": False,
}


class _Request(BaseModel):
    """A part of a request body (stream options, a message): unknown keys are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)


class _Body(BaseModel):
    """A whole request body: unknown fields are kept, to be refused by name."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None

    def unsupported_fields(self) -> list[str]:
        """The fields this server does not implement (the informational ones, and the routers'
        at their defaults, aside)."""
        return [
            k
            for k, v in (self.model_extra or {}).items()
            if k not in INFORMATIONAL_FIELDS
            and not (k in ROUTER_DEFAULTS and v is ROUTER_DEFAULTS[k])
        ]


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Body):
    """The fields completions and chat completions share (OpenAI's and vLLM's extras)."""

    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
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
    # Output constraints (constraints.py): at most one per request.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def constraint(self) -> Constraint | None:
        """The structured-output spec this request asks for and the field it came from;
        FieldError (a ValueError) if it is malformed or there are two."""
        guided = {
            "json": self.guided_json,
            "regex": self.guided_regex,
            "choice": self.guided_choice,
            "grammar": self.guided_grammar,
        }
        return one_constraint(
            [
                from_response_format(self.response_format),
                from_structured_outputs(self.structured_outputs),
                *from_guided(guided),
            ]
        )

    def sampling_params(
        self,
        default_max_tokens: int | None,
        logprobs: int | None,
        defaults: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """The engine's SamplingParams; ValueError with a client-facing message if invalid.

        A sampling field the request leaves unset takes `defaults`' value (the model's, from
        its generation_config.json), else vLLM's neutral one: vLLM's order of precedence."""
        defaults = defaults or {}

        def pick(name: str, neutral: float) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, neutral)

        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n}")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise ValueError(f"stop may hold at most {MAX_STOP} strings, got {len(self.stop)}")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}")
        max_tokens = self.max_tokens if self.max_tokens is not None else self.max_completion_tokens
        return SamplingParams(
            presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            logit_bias=_token_biases(self.logit_bias),
            n=self.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", -1),
            min_p=pick("min_p", 0.0),
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
        self,
        default_max_tokens: int | None,
        logprobs: int | None,
        defaults: dict[str, Any] | None = None,
    ) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of is not supported (only best_of == n), got {self.best_of}")
        if self.suffix:
            raise ValueError("suffix is not supported")
        params = super().sampling_params(default_max_tokens, logprobs, defaults)
        if self.echo and logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=logprobs)
        return params


class ContentPart(_Request):
    type: str
    text: str | None = None


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, OpenAI's


class ToolCall(_Request):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

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

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it: tool-call arguments as objects (HF's
        templates write them with `tojson`)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _json_or_text(c.function)},
                }
                for c in self.tool_calls
            ]
        return message


def _json_or_text(call: FunctionCall) -> Any:
    try:
        return json.loads(call.arguments)
    except json.JSONDecodeError:
        return call.arguments


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM's extra
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None  # none, auto, required, or a function
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: e.g. enable_thinking

    def constraint(self) -> Constraint | None:
        from_tools = tool_constraint(self.tools, self.tool_choice, self.parallel_tool_calls)
        return one_constraint([super().constraint(), from_tools])


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a `prompt`, or chat `messages` through the chat template."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    tokens: list[int]
