"""A streamed Messages answer as Anthropic's server-sent events, as the `anthropic` SDK's
`messages.stream` reads them: `message_start`, `ping`, per content block
`content_block_start`, its deltas (`text_delta`, or `input_json_delta` for a tool_use block's
input) and `content_block_stop`, then `message_delta` (stop reason and usage) and
`message_stop`; a request that fails mid-stream ends with an `error` event.

The text is split as the chat stream splits it: `<think>` dropped (`ReasoningStream`), tool
calls read at the end (`tools.ToolStream`); a tool the request names (tool_choice `tool`) is
the whole output, so its input streams as it is written.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from minivllm.engine.runtime.async_engine import RequestStream
from minivllm.outputs import RequestOutput
from minivllm.server.anthropic.output import Turn, tool_input
from minivllm.server.anthropic.protocol import ContentBlock, TextBlock, ToolUseBlock, error_body
from minivllm.server.errors import error_of, is_failed
from minivllm.server.openai import tools
from minivllm.server.openai.reasoning import ReasoningStream
from minivllm.server.openai.streaming import text_delta


def event(kind: str, **fields: Any) -> str:
    """One server-sent event: Anthropic names each event and repeats the name as `type`."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"


class EventWriter:
    """One streamed answer's events, from text deltas to the final message."""

    def __init__(self, turn: Turn) -> None:
        self.turn = turn
        self.content: list[ContentBlock] = []
        self._open = False  # the last block in `content` is still streaming
        parser = turn.server.reasoning_parser
        self._reasoning = ReasoningStream(parser) if parser is not None else None
        auto_or_any = turn.mode in ("auto", "required")
        self._tools = tools.ToolStream(turn.mode, turn.named) if auto_or_any else None
        self._input = ""  # the named tool's input JSON so far

    def start(self) -> list[str]:
        return [event("message_start", message=self.turn.message.model_dump()), event("ping")]

    def feed(self, delta: str, finished: bool) -> list[str]:
        """The events of one step's new text; at the end, the blocks' stops and calls."""
        if self._reasoning is not None:
            _, delta = self._reasoning.feed(delta, finished)
        if self.turn.mode == "named":
            return self._feed_input(delta, finished)
        calls: list[Any] = []
        if self._tools is not None:
            delta, calls = self._tools.feed(delta, finished)
        events = []
        if delta:
            if not self._open:
                events += self._start_block(TextBlock(text=""))
            block = self.content[-1]
            assert isinstance(block, TextBlock)
            block.text += delta
            events.append(self._delta({"type": "text_delta", "text": delta}))
        if finished:
            events += self._stop_block()
            for use in self.turn.tool_uses(calls):
                events += self._start_block(use.model_copy(update={"input": {}}))
                events.append(self._input_delta(json.dumps(use.input)))
                self.content[-1] = use
                events += self._stop_block()
        return events

    def _feed_input(self, delta: str, finished: bool) -> list[str]:
        events = []
        if not self.content:
            events += self._start_block(ToolUseBlock(name=self.turn.named or "", input={}))
        if delta:
            self._input += delta
            events.append(self._input_delta(delta))
        if finished:
            block = self.content[-1]
            self.content[-1] = block.model_copy(update={"input": tool_input(self._input)})
            events += self._stop_block()
        return events

    def _start_block(self, block: ContentBlock) -> list[str]:
        self.content.append(block)
        self._open = True
        return [
            event(
                "content_block_start",
                index=len(self.content) - 1,
                content_block=block.model_dump(),
            )
        ]

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", index=len(self.content) - 1, delta=delta)

    def _input_delta(self, partial_json: str) -> str:
        return self._delta({"type": "input_json_delta", "partial_json": partial_json})

    def _stop_block(self) -> list[str]:
        if not self._open:
            return []
        self._open = False
        return [event("content_block_stop", index=len(self.content) - 1)]

    def end(self, output: RequestOutput) -> list[str]:
        """`message_delta` and `message_stop`, once the final output is in."""
        message = self.turn.finish(output, self.content)
        usage = message.usage.model_dump(exclude={"cache_creation_input_tokens"})
        delta = {"stop_reason": message.stop_reason, "stop_sequence": message.stop_sequence}
        return [event("message_delta", delta=delta, usage=usage), event("message_stop")]


async def events(turn: Turn, stream: RequestStream) -> AsyncIterator[str]:
    """The SSE lines of a streamed answer; logs how it ended, however it ended."""
    writer = EventWriter(turn)
    hold_back = max(map(len, turn.params.stop_strings), default=1) - 1
    sent, how = 0, "aborted (client disconnected)"
    try:
        for line in writer.start():
            yield line
        async for _, output in stream:
            if is_failed(output):
                how = "failed"
                yield event("error", error=error_body(500, error_of(output).error.message)["error"])
                return
            out = output.outputs[0]
            delta, sent = text_delta(out, sent, hold_back)
            finished = out.finish_reason is not None
            for line in writer.feed(delta, finished):
                yield line
            if finished:
                how = ""  # logged by turn.finish
                for line in writer.end(output):
                    yield line
    finally:
        if how:
            turn.server.log_finished(turn.message.id, len(turn.prompt), 0, turn.start, how)
