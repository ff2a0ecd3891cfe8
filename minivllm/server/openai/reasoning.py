"""`--reasoning-parser`: a reasoning model's `<think>...</think>` as `reasoning_content`
(vLLM's field), apart from the answer's `content`, whole or streamed.

Two parsers, vLLM's names: `qwen3` reads reasoning only when the output opens with `<think>`
(Qwen3 with `enable_thinking: false` writes none); `deepseek_r1` reads everything before
`</think>` as reasoning, as DeepSeek-R1's template opens the `<think>` in the prompt. An
output whose reasoning never closes is all reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

PARSERS = ("qwen3", "deepseek_r1")
_OPEN, _CLOSE = "<think>", "</think>"


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """(reasoning, content) of an output; reasoning None if the output did not think."""
    body = text.lstrip()
    if body.startswith(_OPEN):
        body = body[len(_OPEN) :]
    elif parser != "deepseek_r1":
        return None, text
    end = body.find(_CLOSE)
    if end < 0:
        return body.lstrip(), ""
    return body[:end].lstrip(), body[end + len(_CLOSE) :].lstrip()


@dataclass
class ReasoningStream:
    """One streamed choice's text as reasoning and content deltas: the split of the text so
    far, less what was sent, holding back a tail that may be the start of a tag."""

    parser: str
    text: str = ""
    reasoning_sent: int = 0
    content_sent: int = 0

    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        """(reasoning delta, content delta)."""
        self.text += delta
        view = self.text
        if not finished:
            if _OPEN.startswith(view.lstrip()):
                return "", ""  # "<thi": thinking or not is not known yet
            view = view[: len(view) - partial_tag(view, _CLOSE)]
        reasoning, content = split_reasoning(self.parser, view)
        reasoning = reasoning or ""
        r_delta, c_delta = reasoning[self.reasoning_sent :], content[self.content_sent :]
        self.reasoning_sent, self.content_sent = len(reasoning), len(content)
        return r_delta, c_delta


def partial_tag(text: str, tag: str) -> int:
    """How many trailing characters of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
