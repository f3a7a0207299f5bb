"""What a request forces its output to be, as an llguidance grammar the worker enforces.

``response_format`` (``json_object``, ``json_schema``) and a forced tool call (``required``
or a named function, in the tool-call format of the model's family) become one grammar
string, checked here with llguidance's own validator: a schema the library cannot
enforce is a 400 that says what, never silently unconstrained output. llguidance is a
Rust extension with no MLX in it, so the router may import it.

A grammar constrains the output from its first token. When the prompt ends inside a
thinking block (the template opened ``<think>``), a forced output written there would be
read as reasoning and never reach the client; so ``after_marker`` makes the grammar begin
with the block's close marker, as the template itself renders an empty thought.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher

from common.errors import BadRequest

__all__ = ["JSON_OPTIONS", "ResponseFormat", "after_marker", "guided_schema", "json_schema_grammar",
           "lark_grammar", "response_format_grammar", "response_format_lark"]

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


def guided_schema(schema: dict[str, Any]) -> str:
    """A schema as the JSON of a lark ``%json`` rule, with the response-format spacing."""
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def response_format_lark(rf: ResponseFormat) -> str:
    """``response_format`` as lark (to put something before it; alone, ``response_format_grammar``)."""
    return f"start: %json {guided_schema(rf.schema)}\n"


def after_marker(marker: str, lark: str) -> str:
    """``lark`` (its ``start`` rule first) preceded by ``marker`` (a lark string or a special
    token's ``<[id]>``) and the blank line templates write after a closed thinking block."""
    body = lark.replace("start:", "forced:", 1)
    return f'start: {marker} "\\n\\n" forced\n{body}'


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
