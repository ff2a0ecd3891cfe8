"""The Responses API's output: an output's text as reasoning, message and function-call
items, whole (`output_items`) or as the semantic event stream (`EventWriter`):
`response.created`, `response.in_progress`, per item `response.output_item.added`, its
content part and text (or arguments) deltas and dones, `response.output_item.done`, then
`response.completed` (or `response.incomplete` / `response.failed`), each event numbered by
`sequence_number`, as the `openai` SDK's `responses.stream` reads them.

The split of the text is the chat path's: `openai/reasoning.py` for `<think>`,
`openai/tools.py` for the calls (which, as in chat, arrive whole at the end of the output).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel

from minivllm.server.openai import tools
from minivllm.server.openai.reasoning import ReasoningStream, split_reasoning
from minivllm.server.responses.protocol import (
    FunctionCallItem,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
)

# A finished item's status: "incomplete" where max_output_tokens cut it.
Status = Literal["completed", "incomplete"]


def _text_events(item: ReasoningItem | OutputMessage) -> tuple[str, dict[str, Any]]:
    """The event family of an item's text ("reasoning_text" or "output_text") and the fields
    only output text carries (its logprobs)."""
    if isinstance(item, ReasoningItem):
        return "reasoning_text", {}
    return "output_text", {"logprobs": []}


def output_items(
    text: str, reasoning_parser: str | None, mode: tools.Mode, named: str | None, cut: bool
) -> tuple[list[OutputItem], str | None]:
    """A finished output's items (reasoning, message, function calls) and its reasoning
    text; `cut`: max_output_tokens ended it (the items are incomplete)."""
    reasoning = None
    if reasoning_parser is not None:
        reasoning, text = split_reasoning(reasoning_parser, text)
    content, calls = tools.parse_calls(text, mode, named)
    status: Status = "incomplete" if cut else "completed"
    items: list[OutputItem] = []
    if reasoning:
        items.append(ReasoningItem(content=[ReasoningText(text=reasoning)], status=status))
    if content or not calls:
        items.append(OutputMessage(content=[OutputText(text=content or "")], status=status))
    items += [
        FunctionCallItem(
            call_id=c.id, name=c.function.name, arguments=c.function.arguments, status=status
        )
        for c in calls
    ]
    return items, reasoning


def assistant_message(items: list[OutputItem]) -> dict[str, Any]:
    """The output as the assistant's chat message (for the conversation a continuation
    extends); reasoning is left out, as chat templates leave it out of earlier turns."""
    text = "".join(p.text for i in items if isinstance(i, OutputMessage) for p in i.content)
    calls = [
        {
            "id": i.call_id,
            "type": "function",
            "function": {"name": i.name, "arguments": i.arguments},
        }
        for i in items
        if isinstance(i, FunctionCallItem)
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message


class EventWriter:
    """One streamed response's events, from text deltas to the final response."""

    def __init__(
        self,
        response: ResponseObject,
        reasoning_parser: str | None,
        mode: tools.Mode,
        named: str | None,
    ) -> None:
        self.response = response
        self.sequence_number = 0
        self.items: list[OutputItem] = []
        self.reasoning_text = ""
        self._reasoning = ReasoningStream(reasoning_parser) if reasoning_parser else None
        self._tools = tools.ToolStream(mode, named) if mode != "none" else None
        self._open: ReasoningItem | OutputMessage | None = None

    def event(self, type: str, **fields: Any) -> str:
        """One server-sent event."""
        data = {"type": type, "sequence_number": self.sequence_number}
        data.update(
            {k: v.model_dump() if isinstance(v, BaseModel) else v for k, v in fields.items()}
        )
        self.sequence_number += 1
        return f"event: {type}\ndata: {json.dumps(data)}\n\n"

    def start(self) -> list[str]:
        return [
            self.event("response.created", response=self.response),
            self.event("response.in_progress", response=self.response),
        ]

    def feed(self, delta: str, finished: bool, cut: bool) -> list[str]:
        """The events of one step's new text; at the end, the items' dones and calls."""
        reasoning, text = "", delta
        if self._reasoning is not None:
            reasoning, text = self._reasoning.feed(delta, finished)
        calls: list[Any] = []
        if self._tools is not None:
            text, calls = self._tools.feed(text, finished)
        events = []
        if reasoning:
            events += self._append(ReasoningItem, reasoning)
        if text:
            events += self._append(OutputMessage, text)
        if finished:
            if not calls and not self.items:
                events += self._append(OutputMessage, "")  # an empty answer is a message too
            events += self._close(cut)
            for call in calls:
                events += self._call(
                    FunctionCallItem(
                        call_id=call.id,
                        name=call.function.name,
                        arguments=call.function.arguments,
                        status="incomplete" if cut else "completed",
                    )
                )
        return events

    def _append(self, kind: type[ReasoningItem] | type[OutputMessage], text: str) -> list[str]:
        events = []
        if not isinstance(self._open, kind):
            events += self._close(cut=False)
            events += self._open_item(kind)
        item = self._open
        assert isinstance(item, (ReasoningItem, OutputMessage))
        item.content[0].text += text
        if isinstance(item, ReasoningItem):
            self.reasoning_text += text
        family, extra = _text_events(item)
        events.append(
            self.event(
                f"response.{family}.delta",
                item_id=item.id,
                output_index=len(self.items) - 1,
                content_index=0,
                delta=text,
                **extra,
            )
        )
        return events

    def _open_item(self, kind: type[ReasoningItem] | type[OutputMessage]) -> list[str]:
        item = kind(status="in_progress")
        index = len(self.items)
        events = [self.event("response.output_item.added", output_index=index, item=item)]
        part: ReasoningText | OutputText
        part = ReasoningText(text="") if kind is ReasoningItem else OutputText(text="")
        events.append(
            self.event(
                "response.content_part.added",
                item_id=item.id,
                output_index=index,
                content_index=0,
                part=part,
            )
        )
        item.content = [part.model_copy()]  # type: ignore[assignment]
        self.items.append(item)
        self._open = item
        return events

    def _close(self, cut: bool) -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        part = item.content[0]
        family, extra = _text_events(item)
        item.status = "incomplete" if cut else "completed"
        return [
            self.event(
                f"response.{family}.done",
                item_id=item.id,
                output_index=index,
                content_index=0,
                text=part.text,
                **extra,
            ),
            self.event(
                "response.content_part.done",
                item_id=item.id,
                output_index=index,
                content_index=0,
                part=part,
            ),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def _call(self, item: FunctionCallItem) -> list[str]:
        index = len(self.items)
        self.items.append(item)
        pending = item.model_copy(update={"arguments": "", "status": "in_progress"})
        return [
            self.event("response.output_item.added", output_index=index, item=pending),
            self.event(
                "response.function_call_arguments.delta",
                item_id=item.id,
                output_index=index,
                delta=item.arguments,
            ),
            self.event(
                "response.function_call_arguments.done",
                item_id=item.id,
                output_index=index,
                name=item.name,
                arguments=item.arguments,
            ),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def end(self) -> str:
        """The final lifecycle event, after `self.response` was filled in."""
        # failed and cancelled alike end with response.failed: OpenAI has no cancelled event
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            self.response.status, "response.failed"
        )
        return self.event(kind, response=self.response)
