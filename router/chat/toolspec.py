"""Tools, tool choice and response format of a chat request: parsed and validated. Pure.

These are the internal request's shapes, shared by every API that translates onto chat
completions (OpenAI here; Anthropic Messages and Responses map their own fields onto the
same ``Tool``, ``ToolChoice`` and ``ResponseFormat``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.errors import BadRequest
from router.chat.constraints import ResponseFormat

__all__ = ["Tool", "ToolChoice", "parse_tools", "parse_tool_choice", "parse_response_format",
           "parse_tool_calls"]

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
MAX_TOOLS = 128


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call; ``parameters`` is its JSON schema."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool = False

    def to_template(self) -> dict[str, Any]:
        """The OpenAI shape chat templates expect in ``tools``."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """``auto`` (the model decides), ``none``, ``required`` (at least one call) or
    ``function`` (a call to ``name``); ``parallel`` False: at most one call
    (``parallel_tool_calls: false``, Anthropic's ``disable_parallel_tool_use``)."""

    mode: str = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def is_forced(self) -> bool:
        return self.mode in ("required", "function")


def tools_as_chat(value: Any, convert: Callable[[Any, int], dict[str, Any]]) -> Any:
    """Another API's tool list as chat's ``tools``, each tool through ``convert`` (which
    refuses what it cannot map); an empty list is no tools, a non-list is left for
    ``parse_tools`` to refuse."""
    if not isinstance(value, list):
        return value
    return [convert(t, i) for i, t in enumerate(value)] or None


def parse_tools(value: Any) -> list[Tool]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise BadRequest(f"tools must be a list of up to {MAX_TOOLS} tools", param="tools")
    tools = [_tool(t, i) for i, t in enumerate(value)]
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise BadRequest("tools must have distinct function names", param="tools")
    return tools


def _tool(t: Any, i: int) -> Tool:
    param = f"tools[{i}]"
    fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
    if not isinstance(fn, dict):
        raise BadRequest(f"{param} must be {{\"type\": \"function\", \"function\": {{...}}}}",
                         param=param)
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise BadRequest(f"{param}.function.name must be 1-64 letters, digits, _ . or -",
                         param=f"{param}.function.name")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise BadRequest(f"{param}.function.description must be a string",
                         param=f"{param}.function.description")
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise BadRequest(f"{param}.function.parameters must be a JSON schema object",
                         param=f"{param}.function.parameters")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise BadRequest(f"{param}.function.strict must be a bool", param=f"{param}.function.strict")
    return Tool(name=name, description=description, parameters=parameters, strict=bool(strict))


def parse_tool_choice(value: Any, tools: list[Tool], parallel: Any = None) -> ToolChoice:
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("parallel_tool_calls must be a bool", param="parallel_tool_calls")
    parallel = parallel is not False
    if value is None:
        return ToolChoice("auto" if tools else "none", parallel=parallel)
    if value in ("auto", "none", "required"):
        choice = ToolChoice(value, parallel=parallel)
    elif (isinstance(value, dict) and value.get("type") == "function"
          and isinstance(value.get("function"), dict)
          and isinstance(value["function"].get("name"), str)):
        choice = ToolChoice("function", value["function"]["name"], parallel)
        if choice.name not in {t.name for t in tools}:
            raise BadRequest(f"tool_choice names {choice.name!r}, which is not in tools",
                             param="tool_choice")
    else:
        raise BadRequest('tool_choice must be "auto", "none", "required" or '
                         '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    if choice.is_forced and not tools:
        raise BadRequest("tool_choice needs tools", param="tool_choice")
    return choice


def parse_response_format(value: Any) -> ResponseFormat | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object", {"type": "object"})
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise BadRequest("response_format.json_schema must be an object with a schema object",
                             param="response_format")
        name = spec.get("name", "")
        strict = spec.get("strict")
        if not isinstance(name, str) or (strict is not None and not isinstance(strict, bool)):
            raise BadRequest("response_format.json_schema: name must be a string, strict a bool",
                             param="response_format")
        return ResponseFormat("json_schema", spec.get("schema") or {}, name, bool(strict))
    raise BadRequest('response_format.type must be "text", "json_object" or "json_schema"',
                     param="response_format")


def parse_tool_calls(value: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, with arguments as objects (what templates expect)
    where they are JSON; arguments that are not (a call cut by ``max_tokens``, which OpenAI
    returns and clients replay) stay text, as Hermes and Qwen templates render text."""
    if not isinstance(value, list):
        raise BadRequest(f"{param} must be a list", param=param)
    calls = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{param}[{j}] must have function.name", param=param)
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                pass  # a call cut short, replayed as it came: the template gets the text
        elif not isinstance(arguments, dict):
            raise BadRequest(f"{param}[{j}].function.arguments must be a string",
                             param=f"{param}[{j}].function.arguments")
        calls.append({"id": call.get("id") if isinstance(call.get("id"), str) else f"call_{j}",
                      "type": "function",
                      "function": {"name": fn["name"], "arguments": arguments}})
    return calls
