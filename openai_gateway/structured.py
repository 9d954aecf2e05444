"""Structured outputs: a request body's output constraint -> the gRPC `Constraint`. Pure functions.

The forms: OpenAI's `response_format` (`json_schema`, `json_object`; `text` is none), and vLLM's, so
that its users can switch: the older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` and the newer `structured_outputs: {json | regex | choice | grammar | json_object}`.
A request gives at most one. Whether a schema, regex or grammar compiles is the coordinator's
check (INVALID_ARGUMENT naming `sampling.constraint.<kind>`); the gateway reports it under the
parameter the constraint came from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from openai_gateway.errors import invalid
from specdec.v1 import common_pb2

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_OUTPUTS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's options of how its backend compiles a constraint: llguidance needs none of them.
IGNORED = ("guided_decoding_backend", "disable_fallback", "disable_any_whitespace", "disable_additional_properties")


@dataclass(frozen=True)
class Structured:
    """A request's constraint and the parameter it came from (for errors)."""

    constraint: common_pb2.Constraint
    param: str

    @property
    def is_json(self) -> bool:
        return self.constraint.WhichOneof("kind") in ("json_schema", "json_object")


def structured(body: dict) -> Structured | None:
    """The body's output constraint, or None. Two of them is a 400 naming both."""
    found = [s for s in (_response_format(body), *_guided(body), *_structured_outputs(body)) if s is not None]
    if len(found) > 1:
        raise invalid(", ".join(s.param for s in found), "at most one output constraint per request")
    return found[0] if found else None


def _response_format(body: dict) -> Structured | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise invalid("response_format", "must be an object")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Structured(common_pb2.Constraint(json_object=True), "response_format")
    if kind != "json_schema":
        raise invalid("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid("response_format.json_schema", "must be an object with a `schema`")
    schema = spec.get("schema")
    if schema is None:  # OpenAI's `schema` is optional: then any JSON object
        return Structured(common_pb2.Constraint(json_object=True), "response_format")
    return Structured(common_pb2.Constraint(json_schema=_schema_text(schema, "response_format.json_schema.schema")),
                      "response_format")


def _guided(body: dict) -> list[Structured | None]:
    return [_one(name.removeprefix("guided_"), body.get(name), name) for name in GUIDED]


def _structured_outputs(body: dict) -> list[Structured | None]:
    given = body.get("structured_outputs")
    if given is None:
        return []
    if not isinstance(given, dict):
        raise invalid("structured_outputs", "must be an object")
    for key, value in given.items():
        if key not in STRUCTURED_OUTPUTS + IGNORED and value not in (None, False, ""):
            raise invalid(f"structured_outputs.{key}", "is not supported by this server")
    return [_one(key, given.get(key), f"structured_outputs.{key}") for key in STRUCTURED_OUTPUTS]


def _one(kind: str, value, param: str) -> Structured | None:
    """One vLLM-style constraint field (json, regex, choice, grammar, json_object) -> a Structured."""
    if value is None or (kind == "json_object" and value is False):
        return None
    if kind == "json":
        return Structured(common_pb2.Constraint(json_schema=_schema_text(value, param)), param)
    if kind == "json_object":
        if value is not True:
            raise invalid(param, "must be true or false")
        return Structured(common_pb2.Constraint(json_object=True), param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise invalid(param, "must be a non-empty list of strings")
        return Structured(common_pb2.Constraint(choice=common_pb2.Choices(choices=value)), param)
    if not isinstance(value, str) or not value:
        raise invalid(param, "must be a non-empty string")
    return Structured(common_pb2.Constraint(**{kind: value}), param)


def _schema_text(schema, param: str) -> str:
    """A JSON schema given as an object (or, as vLLM takes it, JSON text) -> its JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise invalid(param, f"is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise invalid(param, "must be a JSON schema (an object)")
    return json.dumps(schema, ensure_ascii=False)
