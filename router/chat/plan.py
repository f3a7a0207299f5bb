"""How one request's output is constrained (a grammar) and read back (a parser). Pure.

Shared by every API that translates onto the chat request: given the parsed request and
what the model's tokenizer and template declare, ``plan_output`` decides the tool-call
family, the thinking markers, whether the prompt already opened a thinking block, and the
grammar the worker must enforce (a forced tool call wins over ``response_format``). A
forced output after a prompt that opened a thinking block begins by closing it: the model
skips its thought (as with ``enable_thinking: false``) and what it is forced to write is
read as the answer, not as reasoning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from common.errors import BadRequest
from router.chat.constraints import after_marker, lark_grammar, response_format_grammar, response_format_lark
from router.chat.schema import Parsed
from router.chat.tools import MARKERS, StreamParser, call_grammar, detect_format, make_parser

__all__ = ["OutputPlan", "plan_output", "tool_format"]


class TemplateInfo(Protocol):
    chat_template_source: str | None

    @property
    def can_take_tools(self) -> bool: ...

    @property
    def think_markers(self) -> tuple[str, str] | None: ...

    def special_token_id(self, text: str) -> int | None: ...


@dataclass(frozen=True, slots=True)
class OutputPlan:
    tool_format: str | None = None            # family to read calls in; None: no parsing
    think: tuple[str, str] | None = None      # reasoning markers to split on
    in_reasoning: bool = False                # the prompt ended inside a thinking block
    grammar: str | None = None
    grammar_param: str | None = None          # the request parameter the grammar enforces
    forced_call: bool = False                 # the grammar is a tool call (tool_choice)
    one_call: bool = False                    # parallel tool calls off: the first call only

    @property
    def keep_markers(self) -> tuple[str, ...]:
        """Special tokens the detokenizer must keep so the parser can see them."""
        tools = MARKERS.get(self.tool_format or "", ())
        return tools + (self.think or ())

    def parser(self) -> StreamParser | None:
        if self.tool_format is None and self.think is None:
            return None
        return make_parser(self.tool_format, self.think, self.in_reasoning,
                           forced=self.forced_call, one_call=self.one_call)


def tool_format(tok: TemplateInfo, flag: str) -> str | None:
    """The family to use: the flag's, or the template's own (``auto``)."""
    if flag == "none":
        return None
    return detect_format(tok.chat_template_source) if flag == "auto" else flag


def plan_output(parsed: Parsed, tok: TemplateInfo, flag: str, prompt_text: str = "") -> OutputPlan:
    if parsed.kind != "chat":
        if parsed.response_format is None:
            return OutputPlan()
        return OutputPlan(grammar=response_format_grammar(parsed.response_format),
                          grammar_param="response_format")
    family = tool_format(tok, flag)
    uses_tools = bool(parsed.tools) and parsed.tool_choice.mode != "none"
    if uses_tools and (not tok.can_take_tools or family is None):
        raise BadRequest("this model's chat template cannot take tools (or its tool-call format "
                         "is unknown: see --tool-parser)", param="tools")
    markers = tok.think_markers if family != "harmony" else None
    opened = markers is not None and prompt_text.rstrip().endswith(markers[0])
    close = _close_marker(tok, markers[1]) if opened and markers is not None else None
    grammar = param = None
    if uses_tools and parsed.tool_choice.is_forced:
        assert family is not None
        lark = call_grammar(family, parsed.tools, parsed.tool_choice, tok.special_token_id)
        grammar = lark_grammar(after_marker(close, lark) if close else lark, "tool_choice")
        param = "tools"  # the call's arguments follow the tools' schemas
    elif parsed.response_format is not None:
        rf = parsed.response_format
        grammar = lark_grammar(after_marker(close, response_format_lark(rf)), "response_format") \
            if close else response_format_grammar(rf)
        param = "response_format"
    think = markers if parsed.separate_reasoning else None
    # Harmony's channels are its syntax, so it is always parsed (even without tools)
    return OutputPlan(tool_format=family if (uses_tools or family == "harmony") else None,
                      think=think, in_reasoning=think is not None and opened, grammar=grammar,
                      grammar_param=param, forced_call=param == "tools",
                      one_call=uses_tools and not parsed.tool_choice.parallel)


def _close_marker(tok: TemplateInfo, marker: str) -> str:
    """The thinking block's close marker in lark: its special token where it is one."""
    token = tok.special_token_id(marker)
    return f"<[{token}]>" if token is not None else json.dumps(marker)


def template_tools(parsed: Parsed) -> list[dict[str, Any]] | None:
    """The tools to render into the prompt (none when the request says ``tool_choice: none``)."""
    if not parsed.tools or parsed.tool_choice.mode == "none":
        return None
    return [t.to_template() for t in parsed.tools]
