"""Sampling parameters of one request, with vLLM's names and validation.

Pure Python: the scheduler reads `max_tokens`, `min_tokens`, `ignore_eos` and
`stop_token_ids`; the sampler reads the rest.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a completion to a language (vLLM's shape); give exactly one of:

    `json` a JSON schema (dict or string), `regex` a regular expression, `choice` a list of
    strings (the output is one of them), `grammar` an EBNF grammar (GBNF, llama.cpp's, or
    Lark), `json_object=True` any JSON object. The request ends where the language ends.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of {', '.join(_CONSTRAINTS)}, got "
                f"{', '.join(given) or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema, got {self.json!r:.80}"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a list of non-empty strings")

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(n for n in _CONSTRAINTS if getattr(self, n) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal for equal constraints, the compiled grammar's key."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, dict):
            value = json.dumps(value)  # key order kept: it is the order of the output's keys
        elif self.kind == "choice":
            value = json.dumps(list(value))
        return self.kind, str(value)


@dataclass
class SamplingParams:
    """How to sample one request's completion (vLLM semantics).

    `temperature=0` is greedy. `top_p`, `top_k` and `min_p` follow HF's rules (top-p keeps
    the token that crosses the threshold). `seed` makes a request reproducible whatever the
    batch it runs in. `stop` strings are cut from the text; `stop_token_ids` end the request
    like EOS; until `min_tokens` are generated, EOS and the stop tokens cannot be sampled.
    `logprobs=N` returns the top-N log-probabilities of each generated token (of the model's
    raw distribution, before penalties and filters, as vLLM does by default);
    `prompt_logprobs=N` those of each prompt token after the first (such a request computes its
    whole prompt: it takes no prefix-cache hits).

    Penalties, applied to the logits before temperature and the filters (greedy included):
    `repetition_penalty` (HF's: a logit of a token seen in the prompt or the completion is
    divided by it when positive, multiplied when negative), `presence_penalty` (subtracted once
    from every token the completion holds) and `frequency_penalty` (subtracted once per
    occurrence in the completion), OpenAI's. `logit_bias` adds a bias to token ids' logits.

    `structured_outputs` constrains the completion to a JSON schema, regex, choice or grammar
    (a token mask at every step, after the penalties); the request ends where it ends.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.stop_strings = tuple(s for s in self.stop if s)
        self._validate()
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not _is_real(self.temperature) or math.isnan(self.temperature):
            raise bad("temperature", "must be a number")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be -1 (disabled), 0 (disabled) or a positive integer")
        if not _is_real(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "must be an integer or None")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise bad("logprobs", "must be an integer >= 0 or None")
        for name in ["presence_penalty", "frequency_penalty"]:
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if not _is_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 100.0:
            raise bad("repetition_penalty", "must be in (0, 100] (1 means none)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must be a dict of token id -> bias")
            for token, bias in self.logit_bias.items():
                if not _is_int(token) or token < 0:
                    raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
                if not _is_real(bias) or not -100.0 <= bias <= 100.0:
                    raise ValueError(
                        f"logit_bias values must be in [-100, 100], got {bias!r} for {token}"
                    )
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0
        ):
            raise bad("prompt_logprobs", "must be an integer >= 0 or None")
        if not all(isinstance(s, str) for s in self.stop or []):
            raise bad("stop", "must be a string or a list of strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids or []):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise bad("structured_outputs", "must be StructuredOutputsParams or None")

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
