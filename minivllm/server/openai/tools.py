"""Tool calling in chat: the `tools` and `tool_choice` fields, the prompt, and the calls
read back from the output.

- `tool_choice="none"` (or no tools): plain chat; the tools are not shown to the model.
- `"auto"` (the default with tools): the tools go to the chat template (`tools=`); where a
  template has no tool section, a system message lists them (FALLBACK_PROMPT). The output is
  read for Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
  (Qwen2.5, Qwen3 and others), which become `message.tool_calls`.
- `"required"` or a named function: enforced with the structured-output mask, as vLLM does. A
  named function's output is its arguments, valid for its parameter schema; `required` gives
  a JSON array of `{"name", "parameters"}` (one item unless parallel_tool_calls).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from minivllm.sampling_params import StructuredOutputsParams
from minivllm.server.openai import response_models
from minivllm.server.openai.constraints import Constraint, FieldError
from minivllm.server.openai.reasoning import partial_tag

FALLBACK_PROMPT = (
    "You may call these tools. To call one, answer with "
    '<tool_call>{{"name": <tool name>, "arguments": <JSON arguments>}}</tool_call>.\n'
    "Tools:\n{tools}"
)
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionDef(_Part):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(_Part):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Part):
    name: str


class NamedToolChoice(_Part):
    type: Literal["function"] = "function"
    function: NamedFunction


Mode = Literal["none", "auto", "required", "named"]


def mode_of(tools: list[Tool] | None, choice: str | NamedToolChoice | None) -> Mode:
    """How the tools are used; FieldError for a choice that cannot be honoured."""
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in tools or []]
        if choice.function.name not in names:
            raise FieldError(
                "tool_choice",
                f"tool_choice names {choice.function.name!r}, "
                f"which is not one of the tools {names}",
            )
        return "named"
    if choice not in (None, "none", "auto", "required"):
        raise FieldError(
            "tool_choice",
            "tool_choice must be none, auto, required or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}",
        )
    if not tools:
        if choice == "required":
            raise FieldError("tool_choice", "tool_choice required needs tools")
        return "none"
    return choice or "auto"  # type: ignore[return-value]


def tool_constraint(
    tools: list[Tool] | None, choice: str | NamedToolChoice | None, parallel: bool | None
) -> Constraint | None:
    """The mask that enforces `required` or a named function; None otherwise."""
    mode = mode_of(tools, choice)
    if mode == "named":
        assert isinstance(choice, NamedToolChoice) and tools
        tool = next(t for t in tools if t.function.name == choice.function.name)
        return StructuredOutputsParams(json=tool.function.parameters or _ANY_OBJECT), "tool_choice"
    if mode == "required":
        assert tools
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"enum": [t.function.name]},
                    "parameters": t.function.parameters or _ANY_OBJECT,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if parallel is False:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema), "tool_choice"
    return None


def template_tools(tools: list[Tool] | None, mode: Mode) -> list[dict[str, Any]] | None:
    """The tools as chat templates take them (`tools=`); None when the model should not see
    them."""
    if not tools or mode == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in tools]


def with_fallback_prompt(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The conversation with a system message listing the tools, for a template that has
    no tool section of its own."""
    listing = "\n".join(json.dumps(t["function"]) for t in tools)
    note = FALLBACK_PROMPT.format(tools=listing)
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{note}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]


def parse_calls(text: str, mode: Mode, named: str | None) -> tuple[str | None, list[Any]]:
    """The message content and tool calls of a finished output.

    With `required` or a named function the output is the call: one cut short by max_tokens
    is still returned as a call, its arguments the JSON written so far (vLLM's way), so that
    a client that forced a call finds it where it looks. Such an output is never content,
    even when it was cut before a tool's name."""
    if mode == "named":
        return None, [_call(named or "", text)]
    if mode == "required":
        return None, [_call(name, arguments) for name, arguments in _required_items(text)]
    if mode == "none":
        return text, []
    calls = []
    for block in _CALL.findall(text):
        try:
            data = json.loads(block)
            calls.append(_call(data["name"], json.dumps(data.get("arguments", {}))))
        except (json.JSONDecodeError, KeyError, TypeError):
            return text, []  # not a well-formed call: leave the text as it is
    if not calls:
        return text, []
    content = _CALL.sub("", text).strip()
    return content or None, calls


# A `required` item as the grammar writes it (compact JSON, keys in schema order), possibly
# cut short: its name, then whatever of its parameters was written.
_REQUIRED_ITEM = re.compile(r'\{"name":("(?:[^"\\]|\\.)*")(?:,"parameters":(.*))?', re.DOTALL)


def _required_items(text: str) -> list[tuple[str, str]]:
    """(name, arguments) of each item of a `required` output, a JSON array of
    `{"name", "parameters"}`, the last one possibly cut short."""
    try:
        return [(i["name"], json.dumps(i["parameters"])) for i in json.loads(text)]
    except (json.JSONDecodeError, KeyError, TypeError):
        pass
    decoder, items, pos = json.JSONDecoder(), [], 1 if text.startswith("[") else len(text)
    while pos < len(text):
        try:
            item, end = decoder.raw_decode(text, pos)
            items.append((item["name"], json.dumps(item["parameters"])))
        except (json.JSONDecodeError, KeyError, TypeError):
            cut = _REQUIRED_ITEM.match(text, pos)
            if cut is not None:
                items.append((json.loads(cut.group(1)), cut.group(2) or ""))
            break
        pos = end + 1 if text[end : end + 1] == "," else len(text)
    return items


def _call(name: str, arguments: str) -> response_models.ToolCallOut:
    return response_models.ToolCallOut(
        id=f"call_{uuid.uuid4().hex[:24]}",
        function=response_models.FunctionCallOut(name=name, arguments=arguments),
    )


@dataclass
class ToolStream:
    """One streamed choice's text, split into content deltas and, at the end, tool calls.

    In `auto` mode content streams until a `<tool_call>` begins (a tail that could be its
    start is held back); in `required`/named mode the output is the call itself and streams
    as a tool-call delta at the end."""

    mode: Mode
    named: str | None
    text: str = ""
    sent: int = 0  # characters of `text` sent as content

    def feed(self, delta: str, finished: bool) -> tuple[str, list[Any]]:
        """(content delta, tool calls: only at the end, when there are some)."""
        self.text += delta
        if self.mode in ("named", "required"):
            if not finished:
                return "", []
            return "", parse_calls(self.text, self.mode, self.named)[1]
        if finished:
            _, calls = parse_calls(self.text, self.mode, self.named)
            if not calls:
                return self._content_up_to(len(self.text)), []
            return self._content_up_to(self.text.find(_OPEN)), calls
        start = self.text.find(_OPEN)
        if start >= 0:
            return self._content_up_to(start), []
        return self._content_up_to(len(self.text) - partial_tag(self.text, _OPEN)), []

    def _content_up_to(self, end: int) -> str:
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent : end], end
        return out
