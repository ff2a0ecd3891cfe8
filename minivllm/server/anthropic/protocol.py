"""Anthropic's Messages API shapes (as the `anthropic` SDK's types define them): the request
bodies of POST /v1/messages and /v1/messages/count_tokens, the `Message` answered, and the
error body `{"type": "error", "error": {"type", "message"}}`.

Content blocks, tools and tool_choice stay plain dicts here: `convert.py` reads them into a
chat request and names the exact field (`messages[1].content[0].type`) of whatever this
server does not implement, as the Responses API's translation does.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from minivllm.server.openai.protocol import _Body, _Request

# Our chat extras (vLLM's, as chat has them) a Messages request may carry; in the SDK:
# `extra_body`. Anthropic's own sampling fields are declared on MessagesRequest.
CHAT_EXTRAS = (
    "seed",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "ignore_eos",
    "min_tokens",
    "structured_outputs",
)
# Accepted and ignored: they label, route or bill a request, or ask for a speed, but do not
# change its answer (`cache_control`: our prefix cache is automatic).
INFORMATIONAL = frozenset(
    {
        "metadata",
        "service_tier",
        "cache_control",
        "inference_geo",
        "speed",
        "user_profile_id",
        "workspace_id",
    }
)


class InputMessage(_Request):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(_Body):
    """The body of POST /v1/messages/count_tokens: a conversation without sampling."""

    model: str  # required here, as Anthropic requires it
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra, as chat has it

    def unsupported_fields(self) -> list[str]:
        return [k for k in self.model_extra or {} if k not in INFORMATIONAL]


class MessagesRequest(CountTokensRequest):
    """The body of POST /v1/messages."""

    max_tokens: int  # required, as Anthropic requires it
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    def unsupported_fields(self) -> list[str]:
        return [k for k in super().unsupported_fields() if k not in CHAT_EXTRAS]


# ---- the response ----------------------------------------------------------------------


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


def new_id(prefix: str) -> str:
    """An id as Anthropic's look: `msg_...`, `toolu_...`."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class TextBlock(_Out):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(_Out):
    type: Literal["tool_use"] = "tool_use"
    id: str = Field(default_factory=lambda: new_id("toolu"))
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ToolUseBlock
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Usage(_Out):
    """Anthropic's split: `input_tokens` are the prompt tokens computed for this request,
    `cache_read_input_tokens` those served from the prefix cache (their sum is the prompt)."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class Message(_Out):
    id: str = Field(default_factory=lambda: new_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock] = []
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


class TokenCount(_Out):
    input_tokens: int


# Anthropic's error types by HTTP status; any other status is an `api_error`.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message},
    }
