"""From a StructuredOutputsParams to an llguidance grammar: built, checked, cached by spec.

llguidance was chosen over xgrammar by measurement (docs/benchmarks.md,
benchmarks/grammar_mask.py): on this CPU with a 49k vocabulary its mask is cheaper per token
and a schema compiles in milliseconds rather than half a second, which matters when every
request brings its own schema (tools).
"""

from __future__ import annotations

import functools
import json

import llguidance

from minivllm.sampling_params import StructuredOutputsParams

# Compact JSON (no whitespace between tokens): valid JSON all the same, and a model that
# babbles cannot pad an object with whitespace until max_tokens.
_JSON_OPTIONS: llguidance.JsonCompileOptions = {"whitespace_flexible": False}
_CACHE_SIZE = 256  # distinct specs kept compiled


class GrammarError(ValueError):
    """A schema, regex, choice list or grammar that does not compile; `field` names it."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"structured_outputs.{field} is invalid: {reason}")
        self.field = field
        self.reason = reason


def compile_grammar(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of `spec`, checked; GrammarError if it is invalid."""
    return _compile(*spec.key)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _compile(kind: str, text: str) -> str:
    grammar = _grammar_of(kind, text)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(kind, error.strip())
    return grammar


def _grammar_of(kind: str, text: str) -> str:
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, overrides=_JSON_OPTIONS
        )
    if kind == "json":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise GrammarError(kind, f"the schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise GrammarError(kind, "a JSON schema must be an object")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(kind, str(exc)) from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        return llguidance.grammar_from("choice", text)
    if kind == "grammar":
        try:
            return llguidance.grammar_from("grammar", text)  # GBNF or Lark
        except ValueError as exc:
            raise GrammarError(kind, str(exc)) from None
    raise GrammarError(kind, f"unknown kind {kind!r}")
