"""What a request forces its output to be, as an llguidance grammar the worker enforces.

``response_format`` (``json_object``, ``json_schema``) and a forced tool call (``required``
or a named function, in the tool-call format of the model's family) become one grammar
string, checked here with llguidance's own validator: a schema the library cannot
enforce is a 400 that says what, never silently unconstrained output. llguidance is a
Rust extension with no MLX in it, so the router may import it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher

from common.errors import BadRequest

__all__ = ["JSON_OPTIONS", "ResponseFormat", "json_schema_grammar", "lark_grammar",
           "response_format_grammar"]

# Compact JSON with the spacing models write (", " and ": "); no free whitespace, which a
# weak model could otherwise emit until max_tokens.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ",
                                "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """``json_object`` (any object) or ``json_schema`` (this schema)."""

    kind: str
    schema: dict[str, Any]
    name: str = ""
    strict: bool = False


def response_format_grammar(rf: ResponseFormat) -> str:
    return json_schema_grammar(json.dumps(rf.schema, sort_keys=True), "response_format")


@functools.lru_cache(maxsize=256)
def json_schema_grammar(schema_json: str, param: str) -> str:
    """The grammar for a JSON schema (given as JSON text, so it can be a cache key)."""
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema_json, defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise BadRequest(f"{param}: the schema is not valid JSON: {exc}", param=param) from None
    return _checked(grammar, param)


@functools.lru_cache(maxsize=256)
def lark_grammar(lark: str, param: str) -> str:
    return _checked(LLMatcher.grammar_from_lark(lark), param)


def _checked(grammar: str, param: str) -> str:
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise BadRequest(f"{param} cannot be enforced by constrained decoding: {error}", param=param)
    return grammar
