"""Log-probabilities as the Python API returns them, in vLLM's shape (`vllm.logprobs`).

A generated token's entry is a dict token id -> `Logprob`: the request's top-N tokens (ranks
1..N) and the token itself, which is always there, with its rank in the whole vocabulary.
The sampler (and the model runner, for prompt tokens) fills `logprob` and `rank`; the
runtime's OutputProcessor fills `decoded_token` with `TokenTexts`.

Pure Python: no torch here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

_TOKEN_TEXT_CACHE = 1 << 16  # decoded single tokens kept (a vocabulary's worth)


@dataclass
class Logprob:
    """One token's log-probability under the model's raw distribution.

    `rank` is 1-based in the full vocabulary: for a top-N entry its place in the top-N, for
    the token itself (sampled, or the prompt's) the number of tokens whose log-probability is
    >= its own (vLLM's count: an exact tie ranks it after the tokens it ties with).
    `decoded_token` is the token's text alone, `tokenizer.decode([token_id])`.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token (the top-N plus the sampled token).
SampleLogprobs = list[dict[int, Logprob]]
# None for the first prompt token, then one dict per prompt token (the top-N plus its own).
PromptLogprobs = list[dict[int, Logprob] | None]


def logprob_entry(
    token_id: int, logprob: float, rank: int, top_ids: list[int], top_values: list[float]
) -> dict[int, Logprob]:
    """A token's entry: the top-N (ranks 1..N, most likely first), then the token itself with
    its own rank unless it is one of them."""
    entry = {t: Logprob(v, r) for r, (t, v) in enumerate(zip(top_ids, top_values, strict=True), 1)}
    if token_id not in entry:
        entry[token_id] = Logprob(logprob, rank)
    return entry


class TokenTexts:
    """Each token's text alone (`tokenizer.decode([token_id])`), cached by id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""
            if len(self._texts) < _TOKEN_TEXT_CACHE:
                self._texts[token_id] = text
        return text

    def fill(self, entries: Iterable[dict[int, Logprob] | None]) -> None:
        """Set `decoded_token` of every Logprob in `entries` (None entries are skipped)."""
        if self.tokenizer is None:
            return
        for entry in entries:
            for token_id, logprob in (entry or {}).items():
                logprob.decoded_token = self(token_id)
