"""POST /v1/responses: OpenAI's Responses API shapes (as the `openai` SDK's types define
them), and the request's translation into a chat completion request, so that the chat
template, tools, tool_choice enforcement and structured outputs are the chat path's own.

The request's `input` items become chat messages: `message` (text parts; `developer` is a
system message), `function_call` (an assistant's tool call), `function_call_output` (a tool
message); `reasoning` items sent back are dropped, as chat templates drop earlier turns'
thinking. Anything else (images, files, built-in tools, item references) is a 400 naming
the field.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from minivllm.server.openai.constraints import FieldError
from minivllm.server.openai.protocol import INFORMATIONAL_FIELDS, _Body

# Chat fields of ours (vLLM's extras, as chat has them) a Responses request may carry.
CHAT_EXTRAS = (
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "ignore_eos",
    "min_tokens",
    "logit_bias",
    "structured_outputs",
)
# Accepted and ignored on top of chat's informational fields: they do not change the answer
# this server gives (`include` asks for extras we never produce; `truncation` "disabled" is
# what we do: a prompt too long is a 400).
_RESPONSES_INFORMATIONAL = frozenset(
    {"include", "truncation", "prompt_cache_retention", "background"}
)


class ResponsesRequest(_Body):
    """The body of POST /v1/responses."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool = True
    stream: bool = False
    previous_response_id: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra, as chat has it

    def unsupported_fields(self) -> list[str]:
        extra = self.model_extra or {}
        allowed = INFORMATIONAL_FIELDS | _RESPONSES_INFORMATIONAL | set(CHAT_EXTRAS)
        bad = [k for k in extra if k not in allowed]
        if extra.get("background"):
            bad.append("background")
        return bad


def chat_body(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion request body this Responses request means: its instructions (a
    system message: they do not carry over to a continuation, as OpenAI's do not), then
    `conversation` (the earlier turns `previous_response_id` names, then `input_messages`);
    FieldError naming the field for what this server does not implement."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {"messages": messages + conversation, "stream": False}
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p", "parallel_tool_calls", "chat_template_kwargs"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    for name in CHAT_EXTRAS:
        if (req.model_extra or {}).get(name) is not None:
            body[name] = req.model_extra[name]  # type: ignore[index]
    if req.tools:
        body["tools"] = [_chat_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    response_format = _response_format((req.text or {}).get("format"))
    if response_format is not None:
        body["response_format"] = response_format
    return body


def input_messages(input: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a Responses `input`."""
    if isinstance(input, str):
        return [{"role": "user", "content": input}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(input):
        kind = item.get("type", "message" if "role" in item else None)
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise FieldError(
                    f"{where}.role",
                    f"{where}.role must be system, developer, user or assistant, got {role!r}",
                )
            role = "system" if role == "developer" else role
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": _str(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _str(item, "name", where),
                    "arguments": _str(item, "arguments", where),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # parallel calls: one assistant message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _str(item, "call_id", where),
                    "content": _text_of(output, f"{where}.output")
                    if not isinstance(output, str)
                    else output,
                }
            )
        elif kind == "reasoning":
            continue  # earlier turns' thinking: chat templates leave it out
        else:
            raise FieldError(
                f"{where}.type",
                f"{where}.type {kind!r} is not supported: give "
                "message, function_call or function_call_output items",
            )
    return messages


def _str(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise FieldError(f"{where}.{key}", f"{where}.{key} must be a string, got {value!r:.40}")
    return value


def _text_of(content: Any, where: str) -> str:
    """The text of a message's content: a string or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError(
            f"{where}.content", f"{where}.content must be a string or a list of input_text parts"
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
            part.get("text"), str
        ):
            raise FieldError(
                f"{where}.content[{j}].type",
                f"{where}.content[{j}] of type {kind!r} is not supported: only text parts are",
            )
        texts.append(part["text"])
    return "".join(texts)


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise FieldError(
            f"tools[{i}].type",
            f"tools[{i}].type {tool.get('type')!r} is not "
            "supported: this server runs function tools only (no built-in tools)",
        )
    function = {
        k: tool[k]
        for k in ("name", "description", "parameters", "strict")
        if tool.get(k) is not None
    }
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # none, auto, required: checked by the chat path
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise FieldError(
        "tool_choice",
        "tool_choice must be none, auto, required or "
        f"{{'type': 'function', 'name': ...}}, got {choice!r:.80}",
    )


def _response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise FieldError(
        "text.format.type",
        f"text.format.type must be text, json_object or json_schema, got {fmt.get('type')!r}",
    )


# ---- the response object ----------------------------------------------------------------


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(_Out):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(_Out):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: new_id("msg"))
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = []


class FunctionCallItem(_Out):
    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: new_id("fc"))
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(_Out):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(_Out):
    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: new_id("rs"))
    summary: list[Any] = []
    content: list[ReasoningText] = []
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


class InputTokensDetails(_Out):
    cached_tokens: int  # prompt tokens served from the prefix cache
    cache_write_tokens: int  # prompt tokens computed (their KV written to the cache)


class OutputTokensDetails(_Out):
    reasoning_tokens: int


class ResponseUsage(_Out):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(_Out):
    reason: Literal["max_output_tokens"]


class ResponseError(_Out):
    code: str
    message: str


Status = Literal["completed", "failed", "in_progress", "cancelled", "incomplete"]


class ResponseObject(_Out):
    """A response, as POST, GET and the stream's lifecycle events return it."""

    id: str
    object: Literal["response"] = "response"
    created_at: float = Field(default_factory=time.time)
    model: str
    status: Status = "in_progress"
    output: list[OutputItem] = []
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = []
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] = {}
    user: str | None = None
    store: bool = True
    previous_response_id: str | None = None
    usage: ResponseUsage | None = None


def response_of(req: ResponsesRequest, response_id: str, model: str) -> ResponseObject:
    """The in-progress response of `req`, echoing its settings as OpenAI does."""
    return ResponseObject(
        id=response_id,
        model=model,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        tools=req.tools or [],
        tool_choice=req.tool_choice or ("auto" if req.tools else "none"),
        parallel_tool_calls=req.parallel_tool_calls is not False,
        text=req.text or {"format": {"type": "text"}},
        reasoning=req.reasoning,
        metadata=req.metadata or {},
        user=req.user,
        store=req.store,
        previous_response_id=req.previous_response_id,
    )
