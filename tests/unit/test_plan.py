"""Tests for router/plan.py: which grammar and parser a request gets."""

from __future__ import annotations

from typing import Any

import pytest

from common.errors import BadRequest
from router.plan import plan_output, template_tools
from router.schema import parse_chat, parse_completion

HERMES = "{% for t in tools %}{{ t }}{% endfor %}<tool_call></tool_call><think></think>"
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
USER = [{"role": "user", "content": "hi"}]


class Template:
    def __init__(self, source: str | None, special: dict[str, int] | None = None) -> None:
        self.chat_template_source = source
        self.special = special or {}

    @property
    def can_take_tools(self) -> bool:
        return self.chat_template_source is not None and "tools" in self.chat_template_source

    @property
    def think_markers(self) -> tuple[str, str] | None:
        return ("<think>", "</think>") if "</think>" in (self.chat_template_source or "") else None

    def special_token_id(self, text: str) -> int | None:
        return self.special.get(text)


def chat(**body: Any) -> Any:
    return parse_chat({"messages": USER, **body}, 16)


def test_plain_chat_splits_reasoning_only() -> None:
    plan = plan_output(chat(), Template(HERMES), "auto")
    assert plan.grammar is None and plan.tool_format is None and plan.think == ("<think>", "</think>")
    assert plan.keep_markers == ("<think>", "</think>")


def test_auto_tools_parse_without_a_grammar() -> None:
    plan = plan_output(chat(tools=TOOLS), Template(HERMES), "auto")
    assert plan.tool_format == "hermes" and plan.grammar is None
    assert template_tools(chat(tools=TOOLS, tool_choice="none")) is None


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_forced_tools_get_a_grammar(choice: Any) -> None:
    plan = plan_output(chat(tools=TOOLS, tool_choice=choice), Template(HERMES), "auto")
    assert plan.grammar is not None and "tool_call" in plan.grammar


def test_forced_tool_wins_over_response_format() -> None:
    rf = {"type": "json_object"}
    plan = plan_output(chat(tools=TOOLS, tool_choice="required", response_format=rf),
                       Template(HERMES), "auto")
    assert plan.grammar is not None and "tool_call" in plan.grammar


def test_response_format_on_completions() -> None:
    parsed = parse_completion({"prompt": "x", "response_format": {"type": "json_object"}}, 16)
    assert plan_output(parsed, Template(None), "auto").grammar is not None


@pytest.mark.parametrize(("source", "flag"), [(None, "auto"), ("{{ messages }}", "auto"),
                                              (HERMES, "none")])
def test_tools_without_a_format_are_a_400(source: str | None, flag: str) -> None:
    with pytest.raises(BadRequest) as info:
        plan_output(chat(tools=TOOLS), Template(source), flag)
    assert info.value.param == "tools"


def test_flag_forces_a_family() -> None:
    plan = plan_output(chat(tools=TOOLS), Template(HERMES), "qwen3_coder")
    assert plan.tool_format == "qwen3_coder"


def test_prompt_that_opened_thinking() -> None:
    plan = plan_output(chat(), Template(HERMES), "auto", "<|im_start|>assistant\n<think>\n")
    assert plan.in_reasoning
    plan = plan_output(chat(separate_reasoning=False), Template(HERMES), "auto", "<think>\n")
    assert plan.think is None and plan.parser() is None


def test_harmony_is_always_parsed_and_its_markers_kept() -> None:
    source = "{{ tools }}<|channel|><|call|>"
    plan = plan_output(chat(), Template(source), "auto")
    assert plan.tool_format == "harmony" and "<|channel|>" in plan.keep_markers
    assert plan.parser() is not None


def test_unenforceable_schema_names_response_format() -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strange"}}}
    with pytest.raises(BadRequest) as info:
        plan_output(chat(response_format=rf), Template(HERMES), "auto")
    assert info.value.param == "response_format" and "strange" in info.value.message
