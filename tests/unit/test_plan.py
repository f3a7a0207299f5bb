"""Tests for router/chat/plan.py: which grammar and parser a request gets."""

from __future__ import annotations

from typing import Any

import pytest
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from common.errors import BadRequest
from router.chat.plan import plan_output, template_tools
from router.chat.schema import parse_chat, parse_completion

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


class ByteTokenizer:
    """A vocabulary of the 256 bytes, EOS and ``</think>`` as a special token: enough for a
    real llguidance matcher over the plan's grammar."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<|endoftext|>", b"</think>"]
    special_token_ids = [256, 257]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


OPENED = "<|im_start|>assistant\n<think>\n"  # a prompt whose template opened a thought
FORCED = [({"tools": TOOLS, "tool_choice": "required"},
           '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'),
          ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
           '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'),
          ({"response_format": {"type": "json_object"}}, '{"a": 1}'),
          ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
              "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}},
           '{"a": 1}')]


@pytest.mark.parametrize("special", [{}, {"</think>": 257}])
@pytest.mark.parametrize(("body", "answer"), FORCED)
def test_forced_output_after_an_opened_thought_closes_it_first(
        body: dict[str, Any], answer: str, special: dict[str, int]) -> None:
    """The grammar begins with the close marker (its special token where it is one), so
    the forced call or JSON is read as the answer, not swallowed as reasoning."""
    plan = plan_output(chat(**body), Template(HERMES, special), "auto", "hi" + OPENED)
    assert plan.in_reasoning and plan.grammar is not None
    matcher = LLMatcher(LLTokenizer(TokenizerWrapper(ByteTokenizer())), plan.grammar)
    closer = [257] if special else list(b"</think>")
    assert matcher.compute_ff_tokens()[:len(closer) + 2] == closer + [10, 10]
    assert matcher.consume_tokens(closer + list(b"\n\n" + answer.encode())) and matcher.is_accepting()
    parser = plan.parser()
    assert parser is not None
    out = parser.feed("</think>\n\n" + answer)
    out.add(parser.finish())
    assert out.reasoning == ""
    if "tools" in body:
        assert [(c.name, c.arguments) for c in out.calls] == [("f", '{"a": 1}')] and not out.content
    else:
        assert out.content == answer and not out.calls


@pytest.mark.parametrize(("body", "answer"), FORCED[::2])
def test_forced_output_without_an_opened_thought_starts_at_once(body: dict[str, Any], answer: str) -> None:
    plan = plan_output(chat(**body), Template(HERMES), "auto", "<|im_start|>assistant\n")
    assert not plan.in_reasoning and plan.grammar is not None
    matcher = LLMatcher(LLTokenizer(TokenizerWrapper(ByteTokenizer())), plan.grammar)
    assert matcher.consume_tokens(list(answer.encode())) and matcher.is_accepting()


def test_inline_reasoning_still_closes_an_opened_thought() -> None:
    """``separate_reasoning: false`` only changes how the output is shown: the model still
    closes the thought the prompt opened before its forced answer."""
    plan = plan_output(chat(response_format={"type": "json_object"}, separate_reasoning=False),
                       Template(HERMES), "auto", OPENED)
    assert plan.think is None and not plan.in_reasoning
    assert plan.grammar is not None and "</think>" in plan.grammar


TWO_CALLS = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n' \
            '<tool_call>\n{"name": "f", "arguments": {"a": 2}}\n</tool_call>'


@pytest.mark.parametrize(("body", "calls"), [
    ({"tool_choice": "required"}, 2),
    ({"tool_choice": "required", "parallel_tool_calls": False}, 1),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, 1),
])
def test_required_means_one_or_more_calls_unless_parallel_calls_are_off(
        body: dict[str, Any], calls: int) -> None:
    """OpenAI's ``required``: "call one or more tools"; a named function (as vLLM's) and
    ``parallel_tool_calls: false`` one."""
    plan = plan_output(chat(tools=TOOLS, **body), Template(HERMES), "auto", "<|im_start|>assistant\n")
    assert plan.grammar is not None
    matcher = LLMatcher(LLTokenizer(TokenizerWrapper(ByteTokenizer())), plan.grammar)
    one = TWO_CALLS[:TWO_CALLS.index("\n<tool_call>", 1)]
    assert matcher.consume_tokens(list(one.encode())) and matcher.is_accepting()
    assert matcher.consume_tokens(list(b"\n<tool_call>")) == (calls == 2)


@pytest.mark.parametrize("parallel", [None, True, False])
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_parallel_calls_off_keeps_the_first_call(parallel: bool | None, choice: str) -> None:
    body = {"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel}
    parser = plan_output(chat(**body), Template(HERMES), "auto").parser()
    assert parser is not None
    out = parser.feed(TWO_CALLS[:20])
    out.add(parser.feed(TWO_CALLS[20:]))
    out.add(parser.finish())
    assert [c.arguments for c in out.calls] == (['{"a": 1}'] if parallel is False else
                                                ['{"a": 1}', '{"a": 2}'])
    assert out.content == ""
