"""router/http/api.py: what decides that a chat is tokenized off the event loop."""

from __future__ import annotations

from router.http.api import INLINE_TOKENIZE_CHARS, strings, text_chars


def test_every_string_a_template_may_render_counts() -> None:
    """A chat's size once counted its contents alone, so 7 MB of reasoning or of a tool
    call's arguments were rendered and encoded on the event loop, stalling every stream."""
    big = "x" * (4 * INLINE_TOKENIZE_CHARS)
    reasoning = [{"role": "user", "content": "hi"},
                 {"role": "assistant", "content": "", "reasoning_content": big}]
    call = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": big}}]}]
    assert text_chars(reasoning) > len(big) and text_chars(call) > len(big)


def test_strings_walks_any_depth_keys_included() -> None:
    deep: object = "leaf"
    for _ in range(5000):  # deeper than Python's recursion limit
        deep = [{"k": deep}]
    assert sorted(strings(deep)) == ["k"] * 5000 + ["leaf"]
    assert sorted(strings({"a": 1, "b": [None, True, 2.5]})) == ["a", "b"]
