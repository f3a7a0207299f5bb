"""Tests for router/http/anthropic_api.py: the Messages body as the chat body that means the same.
Pure: plain dicts in and out, no processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from common.errors import BadRequest
from router.http.anthropic_api import parse_messages, to_chat
from router.http.anthropic_output import error_body

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
USER = [{"role": "user", "content": "hi"}]


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "claude-sonnet-4-5", "max_tokens": 16, "messages": USER, **fields}


def refused(b: Any) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        to_chat(b)
    return info.value


# -- request ---------------------------------------------------------------------------


def test_text_request_becomes_the_same_chat_request() -> None:
    chat = to_chat(body(system="Be brief.", temperature=0.2, top_p=0.9, top_k=40, stream=True,
                        stop_sequences=["\n\n"], metadata={"user_id": "u"},
                        thinking={"type": "disabled"}))
    assert chat == {"model": "claude-sonnet-4-5", "max_tokens": 16, "stream": True,
                    "temperature": 0.2, "top_p": 0.9, "top_k": 40, "stop": ["\n\n"],
                    "chat_template_kwargs": {"enable_thinking": False},
                    "messages": [{"role": "system", "content": "Be brief."}, *USER]}


def test_text_blocks_are_joined_by_newlines_and_cache_control_dropped() -> None:
    system = [{"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "B"}]
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "q", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]
    chat = to_chat(body(system=system, messages=messages))
    assert chat["messages"] == [{"role": "system", "content": "A\nB"}, {"role": "user", "content": "q"}]
    parsed = parse_messages(body(system=system, messages=messages), 512)
    assert parsed.messages == chat["messages"]
    assert parsed.kind == "chat" and parsed.sampling.max_tokens == 16


def test_tool_use_and_tool_result_become_tool_calls_and_tool_messages() -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "...", "signature": "s"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "-3C"}]},
            {"type": "text", "text": "and tomorrow?"}]},
    ]
    chat = to_chat(body(messages=messages))
    assert chat["messages"] == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Checking.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}],
         "reasoning_content": "..."},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "-3C"},
        {"role": "user", "content": "and tomorrow?"},
    ]


def test_error_tool_result_and_result_only_turn() -> None:
    messages = [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "boom", "is_error": True}]}]
    assert to_chat(body(messages=messages))["messages"] == [
        {"role": "tool", "tool_call_id": "t", "content": "Error: boom"}]


@pytest.mark.parametrize(("choice", "chat_choice"), [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}),
])
def test_tools_and_tool_choice(choice: dict[str, Any], chat_choice: Any) -> None:
    tools = [{"name": "f", "description": "d", "input_schema": {"type": "object"},
              "cache_control": {"type": "ephemeral"}}]
    chat = to_chat(body(tools=tools, tool_choice=choice))
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "f", "description": "d", "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == chat_choice


def test_disable_parallel_tool_use() -> None:
    chat = to_chat(body(tool_choice={"type": "auto", "disable_parallel_tool_use": True}))
    assert chat["parallel_tool_calls"] is False


def test_output_config_json_schema_is_a_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = to_chat(body(output_config={"format": {"type": "json_schema", "schema": schema},
                                       "effort": "low"}))
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": schema}}


@pytest.mark.parametrize(("b", "param"), [
    ({"messages": USER}, "max_tokens"),
    (body(messages=[]), "messages"),
    (body(messages=[{"role": "system", "content": "x"}]), "messages[0].role"),
    (body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
     "messages[0].content[0]"),
    (body(system=[{"type": "image"}]), "system[0]"),
    (body(stop_sequences="x"), "stop_sequences"),
    (body(thinking={"type": "sometimes"}), "thinking"),
    (body(metadata="x"), "metadata"),
    (body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type"),
    (body(tools=[{"name": "f"}]), "tools[0]"),
    (body(tool_choice={"type": "tool"}), "tool_choice"),
    (body(output_config={"format": {"type": "xml"}}), "output_config.format"),
    # Values that cannot be looked up in a set (once a 500):
    (body(messages=[{"role": ["user"], "content": "x"}]), "messages[0].role"),
    (body(thinking={"type": []}), "thinking"),
    (body(messages=[{"role": "user", "content": [{"type": ["text"], "text": "x"}]}]),
     "messages[0].content[0]"),
])
def test_bad_input_names_the_anthropic_parameter(b: dict[str, Any], param: str) -> None:
    assert refused(b).param == param


def test_count_tokens_needs_no_max_tokens() -> None:
    assert "max_tokens" not in to_chat({"messages": USER}, require_max_tokens=False)


def test_a_claude_code_request_translates_whole() -> None:
    # Claude Code's shape, scaled to what the demo model prefills quickly in the integration test
    recorded = json.loads((FIXTURES / "claude_code_messages.json").read_text())
    chat = to_chat(recorded)
    assert [t["function"]["name"] for t in chat["tools"]] == ["Bash", "Read", "Edit"]
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool",
                                                     "assistant", "tool", "user"]
    assert chat["messages"][0]["content"].startswith("You are Claude Code")
    assert chat["messages"][2]["reasoning_content"] == "Run the test first."
    calls = [c["id"] for m in chat["messages"] for c in m.get("tool_calls", ())]
    results = [m["tool_call_id"] for m in chat["messages"] if m["role"] == "tool"]
    assert calls == results == ["toolu_01A", "toolu_01C"]
    assert chat["messages"][3]["content"].startswith("Error: E   AssertionError")
    assert chat["max_tokens"] == 32000 and chat["stream"] is True
    assert chat["chat_template_kwargs"] == {"enable_thinking": True}



def test_thinking_switches_the_template_and_replayed_thinking_is_reasoning() -> None:
    assert to_chat(body(thinking={"type": "enabled", "budget_tokens": 2048}))[
        "chat_template_kwargs"] == {"enable_thinking": True}
    assert to_chat(body(thinking={"type": "disabled"}))["chat_template_kwargs"] == {
        "enable_thinking": False}
    assert "chat_template_kwargs" not in to_chat(body())
    turn = {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Hm.", "signature": "s"},
        {"type": "redacted_thinking", "data": "xyz"}, {"type": "text", "text": "Hi."}]}
    assert to_chat(body(messages=[*USER, turn]))["messages"][-1] == {
        "role": "assistant", "content": "Hi.", "reasoning_content": "Hm."}


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, None, "stop_sequences must be"),
    ({"tools": [{"name": "x" * 65, "input_schema": {"type": "object"}}]}, None, "tools[0].name must be"),
    ({"temperature": 1.5}, "temperature", "between 0 and 1"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}]},
     None, "'image' blocks are not supported"),
])
def test_refusals_name_the_fields_as_messages_names_them(body: dict[str, Any], param: str | None,
                                                         words: str) -> None:
    request = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(BadRequest) as info:
        parse_messages(request, None)
    message = error_body(info.value)["error"]["message"]
    assert words in message and "function" not in message, message
    assert param is None or info.value.param == param
