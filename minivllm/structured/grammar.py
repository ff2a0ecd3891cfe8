"""From a StructuredOutputsParams to an llguidance grammar: built, checked, cached by spec.

llguidance was chosen over xgrammar by measurement (docs/benchmarks.md,
benchmarks/grammar_mask.py): on this CPU with a 49k vocabulary its mask is cheaper per token
and a schema compiles orders of magnitude faster (figures: "Structured outputs"), which matters
when every request brings its own schema (tools).

A JSON schema's objects are closed unless they say otherwise (`close_objects`): an object
schema without `additionalProperties` admits only the properties it declares. That is vLLM's
default (xgrammar's strict mode) and OpenAI's strict mode; llguidance alone follows the JSON
Schema spec, where a small model fills an open object with keys of its own invention until
max_tokens. A schema's own `additionalProperties` (true or a schema) is honoured.
"""

from __future__ import annotations

import functools
import json
from typing import Any

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
            return llguidance.LLMatcher.grammar_from_json_schema(
                close_objects(schema), overrides=_JSON_OPTIONS
            )
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


# Keywords whose value is a schema, a list of schemas, or a name -> schema map.
_SUBSCHEMA = ("items", "contains", "not", "if", "then", "else", "additionalItems")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_COMPOSITION = ("allOf", "anyOf", "oneOf", "$ref")


def close_objects(schema: Any) -> Any:
    """A copy of `schema` where every object schema that does not state
    `additionalProperties` (or `unevaluatedProperties`) has it false.

    Left open, so as not to reject what the schema means: an object whose properties are
    completed by a sibling `allOf`/`anyOf`/`oneOf`/`$ref`, and the members of `allOf` (each
    holds only part of the properties)."""
    return _close(schema, closable=True)


def _close(schema: Any, closable: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA or key == "additionalProperties":
            if isinstance(value, list):  # draft 4's tuple `items`
                out[key] = [_close(v, closable=True) for v in value]
            else:
                out[key] = _close(value, closable=True)
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            # anyOf/oneOf members extend their parent's properties when it has some
            members_closable = key == "prefixItems" or "properties" not in schema
            out[key] = [_close(v, members_closable) for v in value]
        elif key == "allOf" and isinstance(value, list):
            out[key] = [_close(v, closable=False) for v in value]
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _close(v, closable=True) for name, v in value.items()}
        else:
            out[key] = value
    if closable and _is_open_object(schema):
        out["additionalProperties"] = False
    return out


def _is_open_object(schema: dict[str, Any]) -> bool:
    types = schema.get("type")
    is_object = (
        types == "object"
        or (isinstance(types, list) and "object" in types)
        or (types is None and "properties" in schema)
    )
    stated = "additionalProperties" in schema or "unevaluatedProperties" in schema
    composed = any(k in schema for k in _COMPOSITION)
    return is_object and not stated and not composed
