"""Tests for router/http/responses_api.py: the Responses body as the chat body that means the same.
Pure: plain dicts in and out, no processes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from common.errors import BadRequest
from router.http.responses_api import parse_responses, to_chat
from tests.unit.test_anthropic_api import FIXTURES


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "gpt-5", "input": "hi", **fields}


def refused(b: Any) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        to_chat(b)
    return info.value


# -- request ---------------------------------------------------------------------------


def test_string_input_with_instructions() -> None:
    chat = to_chat(body(instructions="Be brief.", max_output_tokens=9, temperature=0.5,
                        top_p=0.8, stream=True, store=False, reasoning={"effort": "low"},
                        include=["reasoning.encrypted_content"], prompt_cache_key="k",
                        text={"verbosity": "low"}))
    assert chat == {"model": "gpt-5", "stream": True, "max_tokens": 9, "temperature": 0.5,
                    "top_p": 0.8, "messages": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "hi"}]}


def test_items_with_function_calls_and_outputs() -> None:
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {"role": "user", "content": "list files"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "..."},
        {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"cmd":"ls"}'},
        {"type": "function_call", "call_id": "c2", "name": "shell", "arguments": '{"cmd":"pwd"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "/"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
    ]
    call = lambda i, cmd: {"id": f"c{i}", "type": "function",  # noqa: E731
                           "function": {"name": "shell", "arguments": f'{{"cmd":"{cmd}"}}'}}
    assert to_chat(body(input=items))["messages"] == [
        {"role": "developer", "content": [{"type": "text", "text": "rules"}]},
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": None, "tool_calls": [call(1, "ls"), call(2, "pwd")]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "c2", "content": "/"},
        {"role": "assistant", "content": [{"type": "text", "text": "done"}]},
    ]
    parsed = parse_responses(body(input=items[:2]), 512)
    assert parsed.messages == [{"role": "system", "content": "rules"},
                               {"role": "user", "content": "list files"}]


def test_function_call_after_assistant_text_joins_its_turn() -> None:
    items = [{"role": "assistant", "content": "Let me look."},
             {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]
    [turn] = to_chat(body(input=items))["messages"]
    assert turn["content"] == "Let me look." and turn["tool_calls"][0]["id"] == "c"


@pytest.mark.parametrize(("choice", "chat_choice"), [
    ("auto", "auto"), ("none", "none"), ("required", "required"),
    ({"type": "function", "name": "f"}, {"type": "function", "function": {"name": "f"}}),
])
def test_function_tools_and_tool_choice(choice: Any, chat_choice: Any) -> None:
    tools = [{"type": "function", "name": "f", "description": "d", "strict": True,
              "parameters": {"type": "object"}}]
    chat = to_chat(body(tools=tools, tool_choice=choice, parallel_tool_calls=False))
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}}]
    assert chat["tool_choice"] == chat_choice and chat["parallel_tool_calls"] is False


def test_text_format_json_schema_is_a_response_format() -> None:
    fmt = {"type": "json_schema", "name": "answer", "strict": True, "schema": {"type": "object"}}
    assert to_chat(body(text={"format": fmt}))["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"},
                                               "strict": True}}
    assert to_chat(body(text={"format": {"type": "json_object"}}))["response_format"] == {
        "type": "json_object"}
    assert "response_format" not in to_chat(body(text={"format": {"type": "text"}}))


@pytest.mark.parametrize(("b", "param"), [
    (body(previous_response_id="resp_1"), "previous_response_id"),
    (body(store=True), "store"),
    (body(conversation="conv_1"), "conversation"),
    (body(background=True), "background"),
    (body(input=[]), "input"),
    (body(input=[{"type": "web_search_call", "id": "x"}]), "input[0].type"),
    (body(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
     "input[0].content[0]"),
    (body(input=[{"role": "tool", "content": "x"}]), "input[0].role"),
    (body(input=[{"type": "function_call", "call_id": "c"}]), "input[0]"),
    (body(tools=[{"type": "web_search"}]), "tools[0].type"),
    (body(tools=[{"type": "custom", "name": "apply_patch"}]), "tools[0].type"),
    (body(tool_choice={"type": "web_search"}), "tool_choice"),
    (body(text={"format": {"type": "json_schema"}}), "text.format"),
    (body(instructions=["x"]), "instructions"),
    # Values of the wrong type (once a 500):
    (body(input=[{"role": ["user"], "content": "x"}]), "input[0].role"),
    (body(input=[{"role": "user", "content": [{"type": {}, "text": "x"}]}]), "input[0].content[0]"),
    (body(input=[{"type": "function_call_output", "call_id": "c", "output": [{"text": 5}]}]), "input[0]"),
    (body(input=[{"type": "reasoning", "content": 5}]), "input[0].content"),
])
def test_bad_input_names_the_responses_parameter(b: dict[str, Any], param: str) -> None:
    assert refused(b).param == param


def test_store_false_is_accepted() -> None:
    assert to_chat(body(store=False))["messages"] == [{"role": "user", "content": "hi"}]


def test_a_codex_request_translates_whole() -> None:
    recorded = json.loads((FIXTURES / "codex_responses.json").read_text())
    chat = to_chat(recorded)
    assert [t["function"]["name"] for t in chat["tools"]] == ["shell", "apply_patch"]
    assert [m["role"] for m in chat["messages"]] == [
        "system", "user", "user", "assistant", "tool", "assistant", "tool", "user"]
    assert chat["messages"][3]["tool_calls"][0]["id"] == "call_1"
    # the assistant's text and the call after it are one turn, as the model produced them
    assert chat["messages"][5]["content"][0]["text"].startswith("Adding the flag")
    assert chat["messages"][5]["tool_calls"][0]["function"]["name"] == "apply_patch"
    assert chat["parallel_tool_calls"] is False and chat["stream"] is True


def test_replayed_reasoning_text_goes_with_the_next_assistant_turn() -> None:
    items = [{"role": "user", "content": "hi"},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "Think."}]},
             {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]
    assert to_chat(body(input=items))["messages"][-1]["reasoning_content"] == "Think."


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name", "tools[0].name must be"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}, "strict": "yes"}}},
     "text.format", "text.format"),
])
def test_refusals_name_the_fields_as_responses_names_them(body: dict[str, Any], param: str,
                                                          words: str) -> None:
    from router.http.responses_output import error_body

    with pytest.raises(BadRequest) as info:
        parse_responses({"model": "m", "input": "hi", **body}, None)
    error = error_body(info.value)["error"]
    assert error["param"].startswith(param) and words in error["message"], error
    assert "messages" not in error["message"] and "function." not in error["message"]
