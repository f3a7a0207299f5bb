"""router/http/limits.py: each size limit refuses with a BadRequest naming the parameter and flag."""

from __future__ import annotations

from typing import Any

import pytest

from common.errors import BadRequest, ContextLengthExceeded
from router.http.limits import Limits, check_body, check_max_tokens, check_prompt_tokens

LIMITS = Limits(max_tokens=100, max_messages=2, max_tools=1, max_schema_bytes=50, max_stop_chars=5,
                max_prompt_tokens=10)
TOOL = {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize("body, param", [
    ({"messages": [{}, {}, {}]}, "messages"),
    ({"tools": [TOOL, TOOL]}, "tools"),
    ({"functions": [TOOL, TOOL]}, "functions"),
    ({"tools": [{**TOOL, "x": "y" * 60}]}, "tools[0]"),
    ({"response_format": {"schema": "y" * 60}}, "response_format"),
    ({"stop": "toolong"}, "stop"),
    ({"stop": ["ok", "toolong"]}, "stop"),
    ({"stop_sequences": ["toolong"]}, "stop_sequences"),
    ({"max_tokens": 101}, "max_tokens"),
    ({"max_completion_tokens": 10**40}, "max_completion_tokens"),
    ({"max_output_tokens": 101}, "max_output_tokens"),
])
def test_over_a_limit(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as info:
        check_body(body, LIMITS)
    assert info.value.param == param


@pytest.mark.parametrize("body", [
    {"messages": [{}, {}], "tools": [TOOL], "stop": ["short"], "max_tokens": 100},
    [1, 2, 3], "text", None, {"messages": "not a list"}, {"max_tokens": True},
    {"stop": [1, None]}, {"tools": "x"},
])
def test_within_limits_or_left_to_the_parser(body: Any) -> None:
    check_body(body, LIMITS)


def test_nested_too_deep_schema_is_a_400() -> None:
    deep: Any = {}
    for _ in range(5000):
        deep = {"a": deep}
    with pytest.raises(BadRequest, match="nested"):
        check_body({"tools": [deep]}, Limits())


def test_token_limits() -> None:
    check_max_tokens(100, LIMITS)
    with pytest.raises(BadRequest, match="--max-tokens-limit"):
        check_max_tokens(101, LIMITS)
    check_max_tokens(10**9, Limits())
    check_prompt_tokens(10, LIMITS, "prompt")
    with pytest.raises(ContextLengthExceeded, match="--max-prompt-tokens") as info:
        check_prompt_tokens(11, LIMITS, "messages")
    assert info.value.param == "messages"
