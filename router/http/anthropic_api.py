"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) on the shared path.

A Messages body is translated into the chat-completions body that means the same
(`to_chat`: plain dicts, pure) and parsed by router/chat/schema.py, so the request is the same
internal request as a chat completion's; `MessagesPresenter` turns the output back into
Anthropic's message and its SSE event sequence (router/http/anthropic_output.py, where
`error_body` is the one place the error tree takes Anthropic's error shape).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web

from common.errors import BadRequest
from router.chat.schema import Parsed, parse_chat
from router.chat.tokenizer import RouterTokenizer
from router.chat.toolspec import tools_as_chat
from router.http.anthropic_output import MessagesPresenter
from router.http.api import Api, Endpoint
from router.http.output import Presenter
from router.http.rows import Rows

log = logging.getLogger(__name__)

MESSAGE_ROLES = frozenset({"user", "assistant"})
# Replayed reasoning that only Anthropic's servers can read.
DROPPED_BLOCKS = frozenset({"redacted_thinking"})
# thinking.type -> the chat template switch most reasoning templates read (Qwen3's and others')
# Between a turn's text blocks, as vLLM joins content parts: Claude Code sends a reminder and
# the prompt as two blocks, which glued together would read as one run-on line.
BLOCK_SEPARATOR = "\n"
ENABLE_THINKING = {"enabled": True, "adaptive": True, "between_tools": True, "disabled": False}


# -- request: Messages body -> chat-completions body -------------------------------------


def to_chat(body: Any, *, require_max_tokens: bool = True) -> dict[str, Any]:
    """The chat-completions body that asks for what this Messages body asks for."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("max_tokens") is None and require_max_tokens:
        raise BadRequest("max_tokens: field required", param="max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    chat_messages = _system(body.get("system"))
    for i, m in enumerate(messages):
        chat_messages += _message(m, i)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": chat_messages,
                            "stream": body.get("stream")}
    final = chat_messages[-1]
    if final["role"] == "assistant" and "tool_calls" not in final:
        # A prefilled answer: the response goes on from its text ("If the request input
        # messages ended with an assistant turn, the response content continues directly
        # from that last turn"); an empty one is no prefill.
        if final["content"].strip():
            chat["continue_final_message"] = True
        else:
            chat_messages.pop()
    # ignore_eos: vLLM's extension, as chat completions take it (benchmarks need exact lengths)
    temperature = body.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) \
            and not 0 <= temperature <= 1:  # Anthropic's range (chat's goes to 2)
        raise BadRequest("temperature must be between 0 and 1", param="temperature")
    for name in ("max_tokens", "temperature", "top_p", "top_k", "ignore_eos"):
        if body.get(name) is not None:
            chat[name] = body[name]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise BadRequest("stop_sequences must be a list of non-empty strings",
                             param="stop_sequences")
        if stops:
            chat["stop"] = stops
    _check_accepted(body)
    if isinstance(body.get("thinking"), dict):
        chat["chat_template_kwargs"] = {"enable_thinking": ENABLE_THINKING[body["thinking"]["type"]]}
    chat.update(tools_to_chat(body.get("tools"), body.get("tool_choice")))
    chat["response_format"] = _output_format(body.get("output_config"))
    return {k: v for k, v in chat.items() if v is not None}


def _check_accepted(body: dict[str, Any]) -> None:
    """Fields accepted for what they are and otherwise ignored: metadata, thinking."""
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise BadRequest("metadata must be an object", param="metadata")
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and isinstance(thinking.get("type"), str)
                                     and thinking["type"] in ENABLE_THINKING):
        raise BadRequest(f"thinking.type must be one of {sorted(ENABLE_THINKING)}",
                         param="thinking")


def _output_format(config: Any) -> dict[str, Any] | None:
    """``output_config.format`` (structured output) as chat's ``response_format``; effort ignored."""
    if config is None:
        return None
    fmt = config.get("format") if isinstance(config, dict) else None
    if fmt is None:
        return None
    if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema"
            and isinstance(fmt.get("schema"), dict)):
        raise BadRequest("output_config.format must be {type: json_schema, schema}",
                         param="output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None or system == "" or system == []:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if isinstance(system, list):
        return [{"role": "system", "content": BLOCK_SEPARATOR.join(
            _text(b, f"system[{j}]") for j, b in enumerate(system))}]
    raise BadRequest("system must be a string or a list of text blocks", param="system")


def _text(block: Any, param: str) -> str:
    """A text block's text (cache_control and citations dropped)."""
    kind = block.get("type") if isinstance(block, dict) else None
    if isinstance(kind, str) and kind != "text":  # an image in a tool result, say
        raise BadRequest(f"{param}: {kind!r} blocks are not supported here (text only)", param=param)
    if not (kind == "text" and isinstance(block.get("text"), str)):
        raise BadRequest(f"{param} must be a text block", param=param)
    return str(block["text"])


def _message(m: Any, i: int) -> list[dict[str, Any]]:
    """One Messages turn as chat messages: tool results become ``tool`` messages first."""
    param = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in MESSAGE_ROLES:
        raise BadRequest(f"{param}.role must be 'user' or 'assistant'", param=f"{param}.role")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise BadRequest(f"{param}.content must be a string or a list of blocks",
                         param=f"{param}.content")
    parts: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    thinking: list[str] = []
    for j, block in enumerate(content):
        where = f"{param}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str):
            raise BadRequest(f"{where} must be a content block with a type", param=where)
        if kind == "text":
            parts.append(_text(block, where))
        elif kind == "thinking" and role == "assistant" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])  # replayed: the template decides whether to show it
        elif kind == "tool_use" and role == "assistant":
            tool_calls.append(_tool_call(block, where))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, where))
        elif kind not in DROPPED_BLOCKS:
            raise BadRequest(f"{where}: {kind!r} blocks are not supported here", param=where)
    out: list[dict[str, Any]] = results
    if tool_calls:
        out.append({"role": "assistant", "content": BLOCK_SEPARATOR.join(parts) or None,
                    "tool_calls": tool_calls})
    elif parts or thinking or not results:
        out.append({"role": role, "content": BLOCK_SEPARATOR.join(parts)})
    if thinking:
        out[-1]["reasoning_content"] = "".join(thinking)
    return out


def _tool_call(block: dict[str, Any], param: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise BadRequest(f"{param}: a tool_use block needs an id and a name", param=param)
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}}


def _tool_result(block: dict[str, Any], param: str) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str):
        raise BadRequest(f"{param}: a tool_result block needs a tool_use_id", param=param)
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = BLOCK_SEPARATOR.join(_text(b, f"{param}.content[{k}]") for k, b in enumerate(content))
    else:
        raise BadRequest(f"{param}.content must be a string or a list of text blocks", param=param)
    if block.get("is_error"):
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def tools_to_chat(tools: Any, tool_choice: Any) -> dict[str, Any]:
    """Anthropic ``tools`` and ``tool_choice`` as the chat-completions fields."""
    out: dict[str, Any] = {"tools": tools_as_chat(tools, _tool)}
    if tool_choice is not None:
        out["tool_choice"] = _tool_choice(tool_choice)
        if isinstance(tool_choice, dict) and tool_choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    return out


def _tool(tool: Any, i: int) -> dict[str, Any]:
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise BadRequest(f"{param}: only client tools (name, input_schema) are supported, "
                         f"not {kind!r}", param=f"{param}.type")
    if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
        raise BadRequest(f"{param} needs a name and an input_schema object", param=param)
    function: dict[str, Any] = {"name": tool["name"], "parameters": tool["input_schema"]}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise BadRequest("tool_choice must be {type: auto | any | none} or {type: tool, name}",
                     param="tool_choice")


def parse_messages(body: Any, default_max_tokens: int | None, max_n: int = 1) -> Parsed:
    return parse_chat(to_chat(body), default_max_tokens)  # one choice: Messages has no n


def parse_count(body: Any, default_max_tokens: int | None, max_n: int = 1) -> Parsed:
    """count_tokens takes a Messages body without max_tokens."""
    return parse_chat(to_chat(body, require_max_tokens=False), default_max_tokens)


# -- the endpoint ----------------------------------------------------------------------


def _present(body: Any, parsed: Parsed, rows: Rows, model_id: str, tok: RouterTokenizer) -> Presenter:
    return MessagesPresenter(rows.request_id, model_id, rows.prompt_tokens)


MESSAGES = Endpoint("messages", "msg_", parse_messages, _present,
                    as_chat=lambda body: to_chat(body, require_max_tokens=False))


class Messages:
    """The two routes, served by the shared `Api`."""

    def __init__(self, api: Api) -> None:
        self.api = api

    async def create(self, request: web.Request) -> web.StreamResponse:
        return await self.api.serve(request, MESSAGES)

    async def count_tokens(self, request: web.Request) -> web.Response:
        return web.json_response({"input_tokens": await self.api.count_prompt_tokens(
            request, parse_count, MESSAGES.as_chat)})
