"""Log-probabilities in OpenAI's two shapes: completions' parallel lists (tokens,
token_logprobs, top_logprobs, text_offset) and chat's list of per-token objects."""

from __future__ import annotations

import math
from typing import Any

from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.server import responses

_TOKEN_TEXT_CACHE = 1 << 16  # decoded single tokens kept (a vocabulary's worth)


class LogprobFormatter:
    """Formats the engine's token id -> logprob dicts; caches each token's decoded text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._token_text: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""
            if len(self._token_text) < _TOKEN_TEXT_CACHE:
                self._token_text[token_id] = text
        return text

    def completion(
        self, out: CompletionOutput, start: int, offset: int
    ) -> responses.CompletionLogprobs | None:
        """Completions' logprobs of `out`'s tokens from `start`, the first at character
        `offset`; None if the request asked for none."""
        if out.logprobs is None:
            return None
        return self.of_tokens(out.token_ids[start:], out.logprobs[start:], offset)

    def of_tokens(
        self, token_ids: list[int], scores: list[dict[int, float] | None], offset: int
    ) -> responses.CompletionLogprobs:
        """OpenAI's completions logprobs of `token_ids`, the first at character `offset`; a
        None score (an echoed prompt's first token) has no logprobs."""
        result = responses.CompletionLogprobs()
        for token_id, top in zip(token_ids, scores, strict=False):
            text = self.token_text(token_id)
            result.tokens.append(text)
            result.token_logprobs.append(None if top is None else top.get(token_id, -math.inf))
            result.top_logprobs.append(None if top is None else self.by_text(top))
            result.text_offset.append(offset)
            offset += len(text)
        return result

    def by_text(self, top: dict[int, float]) -> dict[str, float]:
        """Token id -> logprob as OpenAI's token text -> logprob, most likely first."""
        return {self.token_text(t): lp for t, lp in sorted(top.items(), key=lambda kv: -kv[1])}

    def echo(self, output: RequestOutput) -> responses.CompletionLogprobs:
        """OpenAI's logprobs of an echoed prompt: every prompt token, None for the first."""
        scores = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
        return self.of_tokens(output.prompt_token_ids, scores, 0)

    def echo_and_completion(
        self, output: RequestOutput, text_offset: int
    ) -> responses.CompletionLogprobs | None:
        """An echoed prompt's logprobs followed by the completion's (at `text_offset`)."""
        completion = self.completion(output.outputs[0], 0, text_offset)
        if completion is None:
            return None
        prompt = self.echo(output)
        return responses.CompletionLogprobs(
            tokens=prompt.tokens + completion.tokens,
            token_logprobs=prompt.token_logprobs + completion.token_logprobs,
            top_logprobs=prompt.top_logprobs + completion.top_logprobs,
            text_offset=prompt.text_offset + completion.text_offset,
        )

    def chat(
        self, out: CompletionOutput, start: int, num_top: int
    ) -> responses.ChatLogprobs | None:
        """Chat's logprobs of `out`'s tokens from `start`, `num_top` alternatives each."""
        if out.logprobs is None:
            return None
        content = []
        for token_id, top in zip(out.token_ids[start:], out.logprobs[start:], strict=False):
            text = self.token_text(token_id)
            best = sorted(top.items(), key=lambda kv: -kv[1])[:num_top]
            content.append(
                responses.TokenLogprob(
                    token=text,
                    logprob=top.get(token_id, float("-inf")),
                    bytes=list(text.encode()),
                    top_logprobs=[self._top(t, lp) for t, lp in best],
                )
            )
        return responses.ChatLogprobs(content=content)

    def _top(self, token_id: int, logprob: float) -> responses.TopLogprob:
        text = self.token_text(token_id)
        return responses.TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))
