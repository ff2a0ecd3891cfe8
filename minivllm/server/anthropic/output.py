"""A finished output as Anthropic's `Message`: its text and tool calls split as the chat path
splits them (`reasoning.py` drops a `<think>` part, as Anthropic shows no thinking unless
asked; `tools.py` reads the calls), then content blocks, a stop reason and usage."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.server.anthropic.protocol import (
    ContentBlock,
    Message,
    StopReason,
    TextBlock,
    ToolUseBlock,
    Usage,
)
from minivllm.server.openai import tools
from minivllm.server.openai.reasoning import split_reasoning
from minivllm.server.openai.serving import OpenAIServer


@dataclass
class Turn:
    """One Messages request in flight: what its answer is built from."""

    server: OpenAIServer
    message: Message  # the answer, its content and stop reason filled in when it ends
    prompt: list[int]
    params: SamplingParams
    mode: tools.Mode
    named: str | None  # the tool tool_choice names
    single_call: bool  # disable_parallel_tool_use: at most one tool_use block
    start: float  # time.monotonic() at the add

    def tool_uses(self, calls: list[Any]) -> list[ToolUseBlock]:
        """The calls as tool_use blocks (`input` {} when max_tokens cut its JSON short)."""
        if self.single_call:
            calls = calls[:1]
        return [
            ToolUseBlock(name=c.function.name, input=tool_input(c.function.arguments))
            for c in calls
        ]

    def finish(self, output: RequestOutput, content: list[ContentBlock]) -> Message:
        """Fill in the answer from the final output and its content blocks."""
        out = output.outputs[0]
        has_calls = any(isinstance(b, ToolUseBlock) for b in content)
        message = self.message
        message.content = content
        message.stop_reason, message.stop_sequence = self.stop_reason(out, has_calls)
        message.usage = usage_of(len(self.prompt), output)
        self.server.log_finished(
            message.id, len(self.prompt), len(out.token_ids), self.start, "finished"
        )
        return message

    def stop_reason(self, out: CompletionOutput, has_calls: bool) -> tuple[StopReason, str | None]:
        """max_tokens if cut (a call's input may be incomplete), tool_use, stop_sequence
        (with the one matched), else end_turn."""
        if out.finish_reason == "length":
            return "max_tokens", None
        if has_calls:
            return "tool_use", None
        matched = self.matched_stop(out)
        return ("stop_sequence", matched) if matched is not None else ("end_turn", None)

    def matched_stop(self, out: CompletionOutput) -> str | None:
        """The stop sequence that ended `out`: the runtime cuts it from the text but keeps the
        token that completed it, so the tokens' text goes on with it where the text ends."""
        stops = self.params.stop_strings
        tokenizer = self.server.tokenizer
        if out.finish_reason != "stop" or not stops or tokenizer is None:
            return None
        full = tokenizer.decode(out.token_ids, skip_special_tokens=self.params.skip_special_tokens)
        rest = full[len(out.text) :] if full.startswith(out.text) else ""
        return next((s for s in stops if rest.startswith(s)), None)


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as a tool_use input: {} where max_tokens cut the JSON short."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def usage_of(prompt_tokens: int, output: RequestOutput | None) -> Usage:
    cached = output.num_cached_prompt_tokens if output is not None else 0
    return Usage(
        input_tokens=prompt_tokens - cached,
        cache_read_input_tokens=cached,
        output_tokens=len(output.outputs[0].token_ids) if output is not None else 0,
    )


def message_of(turn: Turn, output: RequestOutput) -> Message:
    """The whole answer of a non-streamed request."""
    text = output.outputs[0].text
    if turn.server.reasoning_parser is not None:
        _, text = split_reasoning(turn.server.reasoning_parser, text)
    content, calls = tools.parse_calls(text, turn.mode, turn.named)
    blocks: list[ContentBlock] = [TextBlock(text=content)] if content else []
    blocks += turn.tool_uses(calls)
    return turn.finish(output, blocks)
