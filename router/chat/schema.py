"""Parse and validate OpenAI request bodies into plain values. Pure: no I/O.

Every rule raises ``BadRequest`` naming the parameter. Known-but-unsupported parameters
are accepted at their neutral values and refused otherwise; unknown ones are ignored, as
clients often send vendor extras.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from common.errors import BadRequest
from router.chat.constraints import ResponseFormat
from router.chat.sampling_params import is_int, parse_max_tokens, parse_prompt_logprobs, parse_sampling
from router.job import Sampling
from router.chat.toolspec import (
    Tool, ToolChoice, parse_response_format, parse_tool_calls, parse_tool_choice, parse_tools,
)

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_STOPS = 4
MAX_PROMPTS = 64
# Parameter → predicate that is true at its neutral value (``echo`` is taken by completions).
NEUTRAL: dict[str, Any] = {
    "echo": lambda v: v in (None, False),
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: v in (None, ""),
    "functions": lambda v: v in (None, []),
    "function_call": lambda v: v in (None, "none", "auto"),
    "modalities": lambda v: v in (None, ["text"]),
    "audio": lambda v: v is None,
    "prediction": lambda v: v is None,
}


@dataclass(frozen=True, slots=True)
class Parsed:
    """A validated request, before tokenization.

    A completion has one or more ``prompts`` (text or token ids); a chat has ``messages``.
    Each prompt is answered ``n`` times, each answer its own row in the batch.
    """

    kind: str                                  # "chat" | "completion"
    model: str
    sampling: Sampling
    stream: bool
    include_usage: bool
    stop: list[str]
    n: int = 1
    prompts: list[str | list[int]] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice = ToolChoice("none")
    response_format: ResponseFormat | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    separate_reasoning: bool = True            # reasoning text in reasoning_content
    continue_final: bool = False               # the answer continues the final assistant message
    echo: bool = False                         # a completion's text starts with its prompt
    prompt_logprobs: int | None = None         # vLLM's field: the prompt's logprobs, top k

    @property
    def num_choices(self) -> int:
        return self.n * (len(self.prompts) if self.prompts is not None else 1)


def parse_completion(body: Any, default_max_tokens: int | None, max_n: int = 1) -> Parsed:
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt)):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and p and all(is_int(t) for t in p))
            for p in prompt):
        prompts = list(prompt)
    else:
        raise BadRequest("prompt must be a string, a list of token ids, or a list of either",
                         param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise BadRequest(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    if any(p == "" for p in prompts):
        raise BadRequest("prompt must not be empty", param="prompt")
    prompts = [p if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    return _common(body, "completion", default_max_tokens, max_n, prompts=prompts,
                   echo=_optional(body, "echo", bool, False))


def parse_chat(body: Any, default_max_tokens: int | None, max_n: int = 1) -> Parsed:
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    clean = [_message(m, i) for i, m in enumerate(messages)]
    tools = parse_tools(body.get("tools"))
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
    choice = parse_tool_choice(body.get("tool_choice"), tools, body.get("parallel_tool_calls"))
    # vLLM's extension (and what a Messages request ending with an assistant turn asks)
    continue_final = _optional(body, "continue_final_message", bool, False)
    final = clean[-1]
    if continue_final and not (final.get("role") == "assistant" and not final.get("tool_calls")
                               and final.get("content")):
        raise BadRequest("continue_final_message needs a final assistant message with content",
                         param="continue_final_message")
    return _common(body, "chat", default_max_tokens, max_n, messages=clean, tools=tools,
                   tool_choice=choice, continue_final=continue_final,
                   template_kwargs=dict(kwargs or {}),
                   separate_reasoning=_optional(body, "separate_reasoning", bool, True))


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _message(m: Any, i: int) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise BadRequest(f"{param} must be an object", param=param)
    role = m.get("role")
    if not isinstance(role, str) or role not in ROLES:  # a list or dict is unhashable
        raise BadRequest(f"{param}.role must be one of {sorted(ROLES)}, got {role!r}",
                         param=f"{param}.role")
    content = m.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise BadRequest(f"{param}.content[{j}]: only text parts are supported",
                                 param=f"{param}.content")
            parts.append(part["text"])
        content = "".join(parts)
    elif content is None and role in ("assistant", "tool"):
        content = ""
    elif not isinstance(content, str):
        raise BadRequest(f"{param}.content must be a string or a list of text parts",
                         param=f"{param}.content")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    if role == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = parse_tool_calls(m["tool_calls"], f"{param}.tool_calls")
    if role == "tool" and isinstance(m.get("tool_call_id"), str):
        out["tool_call_id"] = m["tool_call_id"]
    if role == "assistant" and isinstance(m.get("reasoning_content"), str):
        out["reasoning_content"] = m["reasoning_content"]
    return out


def _common(body: dict[str, Any], kind: str, default_max_tokens: int | None, max_n: int,
            **prompt: Any) -> Parsed:
    for name, is_neutral in NEUTRAL.items():
        if name in body and name not in prompt and not is_neutral(body[name]):
            raise BadRequest(f"{name} is not supported (only its default value is accepted)",
                             param=name)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model must be a string", param="model")
    stream = _optional(body, "stream", bool, False)
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:  # as OpenAI answers
            raise BadRequest("stream_options is only allowed when stream is true",
                             param="stream_options")
        if not isinstance(options, dict):
            raise BadRequest("stream_options must be an object", param="stream_options")
        include_usage = _optional(options, "include_usage", bool, False, "stream_options.include_usage")
    n = body.get("n")
    if n is not None and (not is_int(n) or not 1 <= n <= max_n):
        raise BadRequest(f"n must be an integer in [1, {max_n}] (the server's --max-n)", param="n")
    echo = bool(prompt.get("echo"))
    prompt_logprobs = parse_prompt_logprobs(body)
    if prompt_logprobs is not None and stream:  # as vLLM answers: they come with the whole answer
        raise BadRequest("prompt_logprobs is not supported with stream", param="prompt_logprobs")
    params = parse_sampling(body, chat=kind == "chat")
    # The worker scores the prompt for the larger of the two asks: echo's logprobs (the
    # prompt's part of them) and prompt_logprobs.
    scored = [k for k in (prompt_logprobs, params.num_logprobs if echo else None) if k is not None]
    sampling = Sampling(max_tokens=parse_max_tokens(body, default_max_tokens, allow_zero=echo),
                        params=replace(params, prompt_logprobs=max(scored, default=None)))
    return Parsed(kind=kind, model=model or "", sampling=sampling, stream=stream,
                  include_usage=include_usage, stop=_stops(body.get("stop")), n=n or 1,
                  response_format=parse_response_format(body.get("response_format")),
                  prompt_logprobs=prompt_logprobs, **prompt)


def _stops(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and s for s in stops)):
        raise BadRequest(f"stop must be a non-empty string or a list of up to {MAX_STOPS} of them",
                         param="stop")
    return stops


def _optional(body: dict[str, Any], name: str, kind: type, default: Any, param: str | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise BadRequest(f"{param or name} must be a {kind.__name__}", param=param or name)
    return value
