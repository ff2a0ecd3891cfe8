"""Log-probabilities in OpenAI's two shapes: completions' parallel lists (tokens,
token_logprobs, top_logprobs, text_offset) and chat's list of per-token objects."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from minivllm.logprobs import Logprob, TokenTexts
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.server.openai import response_models


class LogprobFormatter:
    """Formats the engine's token id -> Logprob dicts; caches each token's decoded text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_text = TokenTexts(tokenizer)

    def completion(
        self, out: CompletionOutput, start: int, offset: int
    ) -> response_models.CompletionLogprobs | None:
        """Completions' logprobs of `out`'s tokens from `start`, the first at character
        `offset`; None if the request asked for none."""
        if out.logprobs is None:
            return None
        return self.of_tokens(out.token_ids[start:], out.logprobs[start:], offset)

    def of_tokens(
        self, token_ids: list[int], scores: Sequence[dict[int, Logprob] | None], offset: int
    ) -> response_models.CompletionLogprobs:
        """OpenAI's completions logprobs of `token_ids`, the first at character `offset`; a
        None score (an echoed prompt's first token) has no logprobs."""
        result = response_models.CompletionLogprobs()
        for token_id, top in zip(token_ids, scores, strict=False):
            text = self.token_text(token_id)
            result.tokens.append(text)
            result.token_logprobs.append(None if top is None else _logprob(top, token_id))
            result.top_logprobs.append(None if top is None else self.by_text(top))
            result.text_offset.append(offset)
            offset += len(text)
        return result

    def by_text(self, top: dict[int, Logprob]) -> dict[str, float]:
        """Token id -> Logprob as OpenAI's token text -> logprob, most likely first."""
        return {self.token_text(t): lp for t, lp in _most_likely_first(top)}

    def echo(self, output: RequestOutput) -> response_models.CompletionLogprobs:
        """OpenAI's logprobs of an echoed prompt: every prompt token, None for the first."""
        scores = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
        return self.of_tokens(output.prompt_token_ids, scores, 0)

    def echo_and_completion(
        self, output: RequestOutput, text_offset: int
    ) -> response_models.CompletionLogprobs | None:
        """An echoed prompt's logprobs followed by the completion's (at `text_offset`)."""
        completion = self.completion(output.outputs[0], 0, text_offset)
        if completion is None:
            return None
        prompt = self.echo(output)
        return response_models.CompletionLogprobs(
            tokens=prompt.tokens + completion.tokens,
            token_logprobs=prompt.token_logprobs + completion.token_logprobs,
            top_logprobs=prompt.top_logprobs + completion.top_logprobs,
            text_offset=prompt.text_offset + completion.text_offset,
        )

    def chat(
        self, out: CompletionOutput, start: int, num_top: int
    ) -> response_models.ChatLogprobs | None:
        """Chat's logprobs of `out`'s tokens from `start`, `num_top` alternatives each."""
        if out.logprobs is None:
            return None
        content = []
        for token_id, top in zip(out.token_ids[start:], out.logprobs[start:], strict=False):
            text = self.token_text(token_id)
            best = _most_likely_first(top)[:num_top]
            content.append(
                response_models.TokenLogprob(
                    token=text,
                    logprob=_logprob(top, token_id),
                    bytes=list(text.encode()),
                    top_logprobs=[self._top(t, lp) for t, lp in best],
                )
            )
        return response_models.ChatLogprobs(content=content)

    def _top(self, token_id: int, logprob: float) -> response_models.TopLogprob:
        text = self.token_text(token_id)
        return response_models.TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))


def _logprob(entry: dict[int, Logprob], token_id: int) -> float:
    found = entry.get(token_id)
    return -math.inf if found is None else found.logprob


def _most_likely_first(entry: dict[int, Logprob]) -> list[tuple[int, float]]:
    """(token id, logprob) pairs, highest logprob first (ties keep the entry's order)."""
    return sorted(((t, lp.logprob) for t, lp in entry.items()), key=lambda kv: -kv[1])
