"""OpenAI's Responses API (``/v1/responses``), stateless, on the shared path.

A Responses body is translated into the chat-completions body that means the same
(`to_chat`: plain dicts, pure) and parsed by router/chat/schema.py; router/http/responses_output.py
turns the output back into a Response object and its event stream. Nothing is stored, so
``previous_response_id`` and ``store: true`` are refused rather than half served. Errors
keep OpenAI's shape (the default of router/http/api.py's middleware); a stream that fails
after it started ends with ``error`` and ``response.failed`` events.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from common.errors import BadRequest
from router.chat.schema import Parsed, parse_chat
from router.chat.tokenizer import RouterTokenizer
from router.chat.toolspec import tools_as_chat
from router.http.api import Api, Endpoint
from router.http.output import Presenter
from router.http.responses_output import ResponsesPresenter
from router.http.rows import Rows

log = logging.getLogger(__name__)

INPUT_ROLES = frozenset({"user", "assistant", "system", "developer"})
TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})
# Fields that need state this server does not keep, and why the client should not send them.
STATEFUL = {
    "previous_response_id": "this server stores no responses: send the whole conversation in input",
    "conversation": "this server stores no conversations: send the whole conversation in input",
    "background": "background responses need storage, which this server does not have",
}


# -- request: Responses body -> chat-completions body ------------------------------------


def to_chat(body: Any) -> dict[str, Any]:
    """The chat-completions body that asks for what this Responses body asks for."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for name, why in STATEFUL.items():
        if body.get(name) not in (None, False):
            raise BadRequest(f"{name} is not supported: {why}", param=name)
    if body.get("store") is True:
        raise BadRequest("store: true is not supported: this server stores nothing; "
                         "send store: false", param="store")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("instructions must be a string", param="instructions")
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    messages += input_to_messages(body.get("input"))
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages,
                            "stream": body.get("stream"), "max_tokens": body.get("max_output_tokens"),
                            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
                            "parallel_tool_calls": body.get("parallel_tool_calls"),
                            "ignore_eos": body.get("ignore_eos")}  # vLLM's extension, as in chat
    chat.update(tools_to_chat(body.get("tools"), body.get("tool_choice")))
    chat["response_format"] = _text_format(body.get("text"))
    return {k: v for k, v in chat.items() if v is not None}


def input_to_messages(items: Any) -> list[dict[str, Any]]:
    """``input`` (a string or a list of items) as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("input must be a string or a non-empty list of items", param="input")
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []  # replayed reasoning, for the assistant turn that follows it
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append(_message(item, param))
        elif kind == "function_call":
            _add_call(messages, item, param)
        elif kind == "function_call_output":
            messages.append(_call_output(item, param))
        elif kind == "reasoning":
            # Only its text can be replayed (encrypted_content is OpenAI's); the template decides
            parts = item.get("content") or []
            if not isinstance(parts, list):
                raise BadRequest(f"{param}.content must be a list of parts", param=f"{param}.content")
            reasoning += [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
            continue
        else:
            raise BadRequest(f"{param}: {kind!r} items are not supported", param=f"{param}.type")
        if reasoning and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = "".join(reasoning)
            reasoning = []
    return messages


def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if not isinstance(role, str) or role not in INPUT_ROLES:
        raise BadRequest(f"{param}.role must be one of {sorted(INPUT_ROLES)}", param=f"{param}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise BadRequest(f"{param}.content must be a string or a list of parts", param=f"{param}.content")
    parts = []
    for j, part in enumerate(content):
        is_text = isinstance(part, dict) and isinstance(part.get("type"), str) and part["type"] in TEXT_PARTS
        text = part.get("text", part.get("refusal")) if is_text else None
        if not isinstance(text, str):
            where = f"{param}.content[{j}]"
            raise BadRequest(f"{where}: only text parts are supported", param=where)
        parts.append({"type": "text", "text": text})
    return {"role": role, "content": parts}


def _add_call(messages: list[dict[str, Any]], item: dict[str, Any], param: str) -> None:
    """A function_call item joins the assistant turn it follows (parallel calls are one turn)."""
    if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
        raise BadRequest(f"{param}: a function_call needs call_id, name and arguments strings",
                         param=param)
    call = {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and "tool_calls" in last:
        last["tool_calls"].append(call)
    elif last is not None and last["role"] == "assistant":
        last["tool_calls"] = [call]
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _call_output(item: dict[str, Any], param: str) -> dict[str, Any]:
    output = item.get("output")
    if isinstance(output, list):  # a list of output parts: keep their text
        texts = [p.get("text", "") for p in output if isinstance(p, dict)]
        output = "".join(texts) if all(isinstance(t, str) for t in texts) else None
    if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
        raise BadRequest(f"{param}: a function_call_output needs a call_id and an output string",
                         param=param)
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def tools_to_chat(tools: Any, tool_choice: Any) -> dict[str, Any]:
    """Responses ``tools`` (function tools only) and ``tool_choice`` as chat fields."""
    return {"tools": tools_as_chat(tools, _tool),
            "tool_choice": None if tool_choice is None else _tool_choice(tool_choice)}


def _tool(tool: Any, i: int) -> dict[str, Any]:
    param = f"tools[{i}]"
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise BadRequest(f"{param}: only function tools are supported, not {kind!r} "
                         "(hosted tools need OpenAI's servers)", param=f"{param}.type")
    if not isinstance(tool.get("name"), str):
        raise BadRequest(f"{param} needs a name", param=f"{param}.name")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise BadRequest("tool_choice must be auto, none, required or {type: function, name}",
                     param="tool_choice")


def _text_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (other ``text`` fields, e.g. verbosity, ignored)."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None or fmt == {"type": "text"}:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise BadRequest("text.format must be text, json_object or json_schema with a schema",
                     param="text.format")


def parse_responses(body: Any, default_max_tokens: int | None, max_n: int = 1) -> Parsed:
    return parse_chat(to_chat(body), default_max_tokens)  # one output: Responses has no n


# -- the endpoint ----------------------------------------------------------------------


def _present(body: Any, parsed: Parsed, rows: Rows, model_id: str, tok: RouterTokenizer) -> Presenter:
    echo = {"model": model_id, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": parsed.sampling.params.temperature, "top_p": parsed.sampling.params.top_p,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "text": body.get("text") or {"format": {"type": "text"}},
            "metadata": body.get("metadata") or {}}
    return ResponsesPresenter(rows.request_id, echo)


RESPONSES = Endpoint("responses", "resp_", parse_responses, _present, as_chat=to_chat)


class Responses:
    """The route, served by the shared `Api`."""

    def __init__(self, api: Api) -> None:
        self.api = api

    async def create(self, request: web.Request) -> web.StreamResponse:
        return await self.api.serve(request, RESPONSES)
