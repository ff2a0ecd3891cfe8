"""What constrains a request's output, from the fields that can ask for it: OpenAI's
`response_format`, vLLM's `structured_outputs` (and its older `guided_*` fields), and the chat
`tool_choice` that forces a call. A request holds at most one; each becomes the engine's
StructuredOutputsParams, named by the field it came from so that a 400 can name it too.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from minivllm.sampling_params import StructuredOutputsParams


class FieldError(ValueError):
    """A client error about one request field, `param` (a dotted path)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # always honoured: the output follows the schema
    description: str | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: `text`, `json_object` or `json_schema`."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


Constraint = tuple[StructuredOutputsParams, str]  # the spec and the field it came from


def from_response_format(rf: ResponseFormat | None) -> Constraint | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise FieldError(
                "response_format.json_schema",
                "response_format of type json_schema needs json_schema.schema",
            )
        return (
            StructuredOutputsParams(json=rf.json_schema.schema_),
            "response_format.json_schema.schema",
        )
    raise FieldError(
        "response_format.type",
        f"response_format.type must be text, json_object or json_schema, got {rf.type!r}",
    )


def from_structured_outputs(so: StructuredOutputsRequest | None) -> Constraint | None:
    if so is None:
        return None
    fields: dict[str, Any] = {  # each value has its own field's type
        "json": so.json_,
        "regex": so.regex,
        "choice": so.choice,
        "grammar": so.grammar,
        "json_object": so.json_object or None,
    }
    given = [name for name, value in fields.items() if value is not None]
    if len(given) != 1:
        raise FieldError(
            "structured_outputs",
            "structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
            f"got {', '.join(given) or 'none'}",
        )
    name = given[0]
    try:
        return StructuredOutputsParams(**{name: fields[name]}), f"structured_outputs.{name}"
    except ValueError as exc:
        raise FieldError(f"structured_outputs.{name}", str(exc)) from None


def from_guided(guided: dict[str, Any]) -> list[Constraint]:
    """vLLM's older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`."""
    found = []
    for name, value in guided.items():
        if value is None:
            continue
        try:
            found.append((StructuredOutputsParams(**{name: value}), f"guided_{name}"))
        except ValueError as exc:
            raise FieldError(f"guided_{name}", str(exc)) from None
    return found


def one_constraint(found: list[Constraint | None]) -> Constraint | None:
    """The request's constraint; a FieldError if it asks for two."""
    given = [c for c in found if c is not None]
    if len(given) > 1:
        names = " and ".join(field for _, field in given)
        raise FieldError(given[1][1], f"give at most one output constraint, got {names}")
    return given[0] if given else None
