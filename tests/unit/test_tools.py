"""Tests for router/chat/tools.py and router/chat/harmony.py: realistic outputs of each family, whole
and split into stream chunks of every size, with text and reasoning around the calls."""

from __future__ import annotations

import json
from typing import Any

import pytest

from common.errors import BadRequest
from router.chat.constraints import lark_grammar
from router.chat.tools import FORMATS, Delta, call_grammar, detect_format, make_parser
from router.chat.toolspec import Tool, ToolChoice

THINK = ("<think>", "</think>")


def run(fmt: str | None, text: str, chunk: int, **kw: Any) -> Delta:
    parser = make_parser(fmt, **kw)
    out = Delta()
    for i in range(0, len(text), chunk):
        out.add(parser.feed(text[i:i + chunk]))
    out.add(parser.finish())
    return out


def calls(d: Delta) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in d.calls]


CASES: list[tuple[str, str, str, str, list[tuple[str, Any]]]] = [
    # (format, output, content, reasoning, calls)
    ("hermes",
     'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.\n", "", [("get_weather", {"city": "Paris"})]),
    ("hermes",
     '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
     '{"name": "b", "arguments": {"x": [1, 2]}}\n</tool_call>',
     "", "", [("a", {}), ("b", {"x": [1, 2]})]),
    ("hermes", "No tools needed: 1 < 2 and <tool is not a marker.",
     "No tools needed: 1 < 2 and <tool is not a marker.", "", []),
    ("hermes", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", "", []),
    ("qwen3_coder",
     "I'll run it.\n<tool_call>\n<function=run_shell>\n<parameter=command>\nls -la /tmp\n"
     "</parameter>\n<parameter=timeout>\n30\n</parameter>\n</function>\n</tool_call>",
     "I'll run it.\n", "", [("run_shell", {"command": "ls -la /tmp", "timeout": 30})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}',
     "", "", [("get_weather", {"city": "Oslo", "unit": "c"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": 1}}',
     "", "", [("a", {}), ("b", {"k": 1})]),
    ("llama3_json", "The weather is {sunny}.", "The weather is {sunny}.", "", []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]',
     "Sure. ", "", [("get_weather", {"city": "Rome"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]now[ARGS]{}',
     "", "", [("get_weather", {"city": "Rome"}), ("now", {})]),
    ("harmony",
     "<|channel|>analysis<|message|>User wants weather. Call the tool.<|end|><|start|>assistant"
     "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
     '{"city": "Tokyo"}',
     "", "User wants weather. Call the tool.", [("get_weather", {"city": "Tokyo"})]),
    ("harmony", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
                "<|message|>It is 4.",
     "It is 4.", "Easy.", []),
]


@pytest.mark.parametrize(("fmt", "text", "content", "reasoning", "expected"), CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 10_000])
def test_families(fmt: str, text: str, content: str, reasoning: str,
                  expected: list[tuple[str, Any]], chunk: int) -> None:
    out = run(fmt, text, chunk)
    assert out.content == content
    assert out.reasoning == reasoning
    assert calls(out) == expected
    assert len({c.id for c in out.calls}) == len(out.calls)


@pytest.mark.parametrize("chunk", [1, 4, 10_000])
def test_reasoning_then_call(chunk: int) -> None:
    text = ("<think>\nThe user wants a sum.\n</think>\n\nSure.<tool_call>\n"
            '{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    out = run("hermes", text, chunk, think=THINK)
    assert out.reasoning == "\nThe user wants a sum.\n"
    assert out.content == "Sure."
    assert calls(out) == [("add", {"a": 1, "b": 2})]


@pytest.mark.parametrize("chunk", [1, 5, 10_000])
def test_reasoning_opened_by_the_prompt(chunk: int) -> None:
    out = run(None, "thinking hard</think>\n\nThe answer.", chunk, think=THINK, in_reasoning=True)
    assert (out.reasoning, out.content) == ("thinking hard", "The answer.")


def test_unclosed_reasoning_is_all_reasoning() -> None:
    out = run(None, "no end in sight", 3, think=THINK, in_reasoning=True)
    assert (out.reasoning, out.content) == ("no end in sight", "")


def test_nothing_is_sent_that_could_become_a_marker() -> None:
    parser = make_parser("hermes", think=THINK)
    assert parser.feed("Hello <tool").content == "Hello "
    assert parser.feed("_c").content == ""
    d = parser.feed('all>\n{"name": "f", "arguments": {}}\n</tool_call> bye')
    assert [c.name for c in d.calls] == ["f"] and d.content == "bye"


def test_streamed_content_arrives_before_the_end() -> None:
    parser = make_parser("hermes")
    assert parser.feed("Hello world").content == "Hello world"


@pytest.mark.parametrize(("template", "fmt"), [
    ("{% if tools %}<|channel|>x<|call|>{% endif %}", "harmony"),
    ("{{ tools }}<tool_call>\n<function=x>\n<parameter=y>", "qwen3_coder"),
    ("{% for tool in tools %}{{ tool }}{% endfor %}<tool_call>", "hermes"),
    ("{{ tools }}[TOOL_CALLS]", "mistral"),
    ("{{ tools }}<|python_tag|>ipython", "llama3_json"),
    ("{{ messages }}", None),
    (None, None),
])
def test_detect_format(template: str | None, fmt: str | None) -> None:
    assert detect_format(template) == fmt


TOOLS = [Tool("get_weather", parameters={"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city", "days"]}),
    Tool("now")]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("choice", [ToolChoice("required"), ToolChoice("function", "get_weather")])
def test_call_grammars_validate(fmt: str, choice: ToolChoice) -> None:
    special = {"<|channel|>": 1, "<|constrain|>": 2, "<|message|>": 3, "<|call|>": 4}.get
    lark = call_grammar(fmt, TOOLS, choice, special)
    assert lark_grammar(lark, "tool_choice")
    assert ("call1" in lark) == (choice.mode == "required")
    if fmt == "harmony":
        assert "<[1]>" in lark and '"<|channel|>"' not in lark


@pytest.mark.parametrize("parameters", [
    {"type": "object", "properties": {"a": "str"}, "required": ["a"]},
    {"type": "object", "properties": {"a": 5}, "required": ["a"]},
    {"type": "object", "properties": {"a": {}}, "required": [{"x": 1}]},
    {"type": "object", "properties": "a", "required": ["a"]},
])
def test_qwen3_coder_parameters_that_are_not_schemas_are_a_400(parameters: dict[str, Any]) -> None:
    with pytest.raises(BadRequest) as info:
        call_grammar("qwen3_coder", [Tool("f", parameters=parameters)], ToolChoice("required"))
    assert info.value.param == "tools"


def test_qwen3_coder_parameter_names_are_escaped_in_its_grammar() -> None:
    name = 'say "hi"\\n'
    tool = Tool("f", parameters={"type": "object", "properties": {name: True}, "required": [name]})
    lark = call_grammar("qwen3_coder", [tool], ToolChoice("required"))
    assert lark_grammar(lark, "tool_choice") and json.dumps(f"<parameter={name}>\n") in lark


def test_the_flag_lists_every_family() -> None:
    from common.config import TOOL_PARSERS

    assert set(TOOL_PARSERS) == {"auto", "none", *FORMATS}


CUT: list[tuple[str, str, list[tuple[str, str, bool]]]] = [
    # (format, output cut short, [(name, arguments so far, complete)])
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Par',
     [("get_time", '{"tz": "Europe/Par', False)]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n{"name": "b\\"c", "arguments": ',
     [("a", "{}", True), ('b"c', "", False)]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n',
     [("a", '{"x": 1}', True)]),
    ("qwen3_coder", "<tool_call>\n<function=run>\n<parameter=command>\nls -l",
     [("run", '{"command": "ls -l"}', False)]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Os', [("get_weather", '{"city": "Os', False)]),
    ("mistral", '[TOOL_CALLS][{"name": "now", "arguments": {"a', [("now", '{"a', False)]),
    ("mistral", '[TOOL_CALLS]now[ARGS]{"a', [("now", '{"a', False)]),
    # A whole call, then one cut in its name: the whole one is kept
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_ti',
     [("get_weather", '{"city": "Paris"}', True)]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_t',
     [("get_weather", '{"city": "Paris"}', True)]),
]


@pytest.mark.parametrize("text", ['{"name": "Alice", "age": 3', '{"name": "f", "id": 1, "arguments": {'])
def test_a_cut_object_with_a_name_but_no_arguments_key_is_no_call(text: str) -> None:
    out = run("llama3_json", text, 4)
    assert out.calls == [] and out.content == text


@pytest.mark.parametrize(("fmt", "text", "expected"), CUT, ids=[f"{c[0]}-{i}" for i, c in enumerate(CUT)])
@pytest.mark.parametrize("chunk", [1, 5, 10_000])
def test_a_call_cut_short_is_a_call_with_the_arguments_written_so_far(
        fmt: str, text: str, expected: list[tuple[str, str, bool]], chunk: int) -> None:
    """max_tokens or a stop string ended the output inside a call: OpenAI and Anthropic return
    the call (its arguments cut), never the template's markup as text."""
    out = run(fmt, text, chunk)
    assert out.content == ""
    assert [(c.name, c.arguments, c.complete) for c in out.calls] == expected


@pytest.mark.parametrize("text", ["<tool_call>\n", '<tool_call>\n{"na'])
def test_a_call_cut_before_its_name_shows_no_markup(text: str) -> None:
    assert run("hermes", text, 3).content == "" and run("hermes", text, 3).calls == []


def test_an_unclosed_marker_before_text_that_is_no_call_is_shown_as_written() -> None:
    text = "<tool_call>\nnot json"
    assert run("hermes", text, 3).content == text and run("hermes", text, 3).calls == []


@pytest.mark.parametrize("text", ["<tool", "<tool_call>\n", '<tool_call>\n{"na'])
def test_a_forced_call_cut_before_its_name_shows_no_markup(text: str) -> None:
    out = run("hermes", text, 2, forced=True)
    assert out.content == "" and out.calls == []
