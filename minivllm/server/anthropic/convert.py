"""A Messages request as the chat completion request it means, so that the chat template,
the tool parser, tool_choice's enforcement and structured outputs are the chat path's own.

- `system` (a string or text blocks) is the first message, a system message.
- A message's content is a string or blocks: `text`; an assistant's `tool_use` (a chat tool
  call, its `input` as JSON arguments); a user's `tool_result` (a chat `tool` message; an
  `is_error` result is prefixed "Error: ", as chat has no field for it).
- `tools` (custom tools: name, description, input_schema) are chat function tools.
- `tool_choice`: auto, any (chat's `required`), tool (a named function), none;
  `disable_parallel_tool_use` is chat's `parallel_tool_calls: false`.
- `stop_sequences` is chat's `stop`, `output_config.format` chat's `response_format`.

Anything else (images, documents, thinking, server tools, a final assistant message to
continue) is a FieldError naming the field, so the client learns it was not honoured.
"""

from __future__ import annotations

import json
from typing import Any

from minivllm.server.anthropic.protocol import (
    CHAT_EXTRAS,
    CountTokensRequest,
    InputMessage,
    MessagesRequest,
)
from minivllm.server.openai.constraints import FieldError
from minivllm.server.openai.protocol import MAX_STOP

_TOOL_KEYS = {"type", "name", "description", "input_schema", "cache_control", "strict"}


def chat_body(req: CountTokensRequest) -> dict[str, Any]:
    """The chat completion request body of `req` (a MessagesRequest adds its sampling)."""
    system = _system(req.system)
    messages = [{"role": "system", "content": system}] if system else []
    for i, message in enumerate(req.messages):
        messages += _messages(message, f"messages[{i}]")
    if req.messages[-1].role == "assistant":
        raise FieldError(
            f"messages[{len(req.messages) - 1}].role",
            "a final assistant message (a prefill to continue) is not supported: end the "
            "conversation with a user message",
        )
    body: dict[str, Any] = {"messages": messages, "stream": False}
    if req.tools:
        body["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body.update(_tool_choice(req.tool_choice, bool(req.tools)))
    _check_thinking(req.thinking)
    response_format = _response_format(req.output_config)
    if response_format is not None:
        body["response_format"] = response_format
    if req.chat_template_kwargs is not None:
        body["chat_template_kwargs"] = req.chat_template_kwargs
    if isinstance(req, MessagesRequest):
        body.update(_sampling(req))
    return body


def _sampling(req: MessagesRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": req.max_tokens}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.stop_sequences:
        if len(req.stop_sequences) > MAX_STOP:
            raise FieldError(
                "stop_sequences",
                f"stop_sequences may hold at most {MAX_STOP} strings, "
                f"got {len(req.stop_sequences)}",
            )
        body["stop"] = req.stop_sequences
    extra = req.model_extra or {}
    body.update({k: extra[k] for k in CHAT_EXTRAS if extra.get(k) is not None})
    return body


def _system(system: str | list[dict[str, Any]] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return _texts(system, "system")


def _texts(blocks: list[dict[str, Any]], where: str) -> str:
    """The text of a list of text blocks (joined by newlines); FieldError for another kind."""
    texts = []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind != "text" or not isinstance(block.get("text"), str):
            raise FieldError(
                f"{where}[{j}].type",
                f"{where}[{j}] of type {kind!r} is not supported here: only text blocks are",
            )
        texts.append(block["text"])
    return "\n".join(texts)


def _messages(message: InputMessage, where: str) -> list[dict[str, Any]]:
    """The chat messages of one Anthropic message: a user message's tool results become
    `tool` messages, in order, around its text."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        at = f"{where}.content[{j}]"
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and message.role == "assistant":
            calls.append(_call(block, at))
        elif kind == "tool_result" and message.role == "user":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append(_tool_result(block, at))
        else:
            raise FieldError(
                f"{at}.type",
                f"{at} of type {kind!r} is not supported in a {message.role} message: give "
                "text blocks, an assistant's tool_use or a user's tool_result",
            )
    if message.role == "assistant":
        assistant: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
        if calls:
            assistant["tool_calls"] = calls
        return [assistant]
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _call(block: dict[str, Any], at: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, dict):
        raise FieldError(at, f"{at}: a tool_use block needs a string id and name, object input")
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def _tool_result(block: dict[str, Any], at: str) -> dict[str, Any]:
    call_id, content = block.get("tool_use_id"), block.get("content", "")
    if not isinstance(call_id, str):
        raise FieldError(f"{at}.tool_use_id", f"{at}.tool_use_id must be a string")
    if isinstance(content, list):
        content = _texts(content, f"{at}.content")
    elif not isinstance(content, str):
        raise FieldError(f"{at}.content", f"{at}.content must be a string or text blocks")
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    if tool.get("type", "custom") != "custom":
        raise FieldError(
            f"{where}.type",
            f"{where}.type {tool.get('type')!r} is not supported: this server runs custom "
            "tools only (name, description, input_schema), no server tools",
        )
    unknown = sorted(set(tool) - _TOOL_KEYS)
    if unknown:
        raise FieldError(f"{where}.{unknown[0]}", f"{where}.{unknown[0]} is not supported")
    if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
        raise FieldError(where, f"{where} needs a string name and an input_schema object")
    function = {"name": tool["name"], "parameters": tool["input_schema"]}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any], has_tools: bool) -> dict[str, Any]:
    kind = choice.get("type")
    if kind in ("any", "tool") and not has_tools:
        raise FieldError("tool_choice", f"tool_choice {kind!r} needs tools")
    body: dict[str, Any] = {}
    if choice.get("disable_parallel_tool_use") is not None:
        body["parallel_tool_calls"] = not choice["disable_parallel_tool_use"]
    if kind in ("auto", "none"):
        body["tool_choice"] = kind
    elif kind == "any":
        body["tool_choice"] = "required"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise FieldError(
            "tool_choice",
            "tool_choice must be {'type': 'auto'}, {'type': 'any'}, {'type': 'none'} or "
            f"{{'type': 'tool', 'name': ...}}, got {choice!r:.80}",
        )
    return body


def _check_thinking(thinking: dict[str, Any] | None) -> None:
    if thinking is not None and thinking.get("type") != "disabled":
        raise FieldError(
            "thinking",
            f"thinking {thinking.get('type')!r} is not supported: this server does not return "
            "thinking blocks (send {'type': 'disabled'} or leave it out)",
        )


def _response_format(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """`output_config.format` (a JSON schema) as chat's `response_format`."""
    if not config:
        return None
    for key, value in config.items():
        if key != "format" and value is not None:
            raise FieldError(f"output_config.{key}", f"output_config.{key} is not supported")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or "schema" not in fmt:
        raise FieldError(
            "output_config.format",
            "output_config.format must be {'type': 'json_schema', 'schema': {...}}",
        )
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
