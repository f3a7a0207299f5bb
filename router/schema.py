"""Parse and validate OpenAI request bodies into plain values. Pure: no I/O.

Every rule raises ``BadRequest`` naming the parameter. Known-but-unsupported parameters
are accepted at their neutral values and refused otherwise; unknown ones are ignored, as
clients often send vendor extras.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.errors import BadRequest
from router.job import Sampling

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_STOPS = 4
# Parameter → predicate that is true at its neutral value.
NEUTRAL: dict[str, Any] = {
    "presence_penalty": lambda v: v in (None, 0, 0.0),
    "frequency_penalty": lambda v: v in (None, 0, 0.0),
    "repetition_penalty": lambda v: v in (None, 1, 1.0),
    "logit_bias": lambda v: v is None or v == {},
    "logprobs": lambda v: v in (None, False),
    "top_logprobs": lambda v: v in (None, 0),
    "echo": lambda v: v in (None, False),
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: v in (None, ""),
    "tools": lambda v: v in (None, []),
    "functions": lambda v: v in (None, []),
    "tool_choice": lambda v: v in (None, "none", "auto"),
    "function_call": lambda v: v in (None, "none", "auto"),
    "response_format": lambda v: v is None or v == {"type": "text"},
    "top_k": lambda v: v in (None, 0, -1),
    "min_p": lambda v: v in (None, 0, 0.0),
    "modalities": lambda v: v in (None, ["text"]),
    "audio": lambda v: v is None,
    "prediction": lambda v: v is None,
}


@dataclass(frozen=True, slots=True)
class Parsed:
    """A validated request, before tokenization."""

    kind: str                                  # "chat" | "completion"
    model: str
    sampling: Sampling
    stream: bool
    include_usage: bool
    stop: list[str]
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None


def parse_completion(body: Any, default_max_tokens: int) -> Parsed:
    body = _object(body)
    prompt = body.get("prompt")
    text: str | None = None
    ids: list[int] | None = None
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        ids = [int(t) for t in prompt]
    elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return parse_completion({**body, "prompt": prompt[0]}, default_max_tokens)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest("only one prompt per request is supported", param="prompt")
    else:
        raise BadRequest("prompt must be a string or a list of token ids", param="prompt")
    if text == "":
        raise BadRequest("prompt must not be empty", param="prompt")
    return _common(body, "completion", default_max_tokens, prompt_text=text, prompt_ids=ids)


def parse_chat(body: Any, default_max_tokens: int) -> Parsed:
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    clean = [_message(m, i) for i, m in enumerate(messages)]
    return _common(body, "chat", default_max_tokens, messages=clean)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


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
    elif content is None and role == "assistant":
        content = ""
    elif not isinstance(content, str):
        raise BadRequest(f"{param}.content must be a string or a list of text parts",
                         param=f"{param}.content")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def _common(body: dict[str, Any], kind: str, default_max_tokens: int, **prompt: Any) -> Parsed:
    for name, is_neutral in NEUTRAL.items():
        if name in body and not is_neutral(body[name]):
            raise BadRequest(f"{name} is not supported (only its default value is accepted)",
                             param=name)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model must be a string", param="model")
    stream = _optional(body, "stream", bool, False)
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise BadRequest("stream_options must be an object", param="stream_options")
        include_usage = _optional(options, "include_usage", bool, False, "stream_options.include_usage")
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise BadRequest("only n=1 is supported", param="n")
    return Parsed(kind=kind, model=model or "", sampling=_sampling(body, default_max_tokens),
                  stream=stream, include_usage=include_usage, stop=_stops(body.get("stop")),
                  **prompt)


def _sampling(body: dict[str, Any], default_max_tokens: int) -> Sampling:
    max_tokens = default_max_tokens
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not _is_int(value) or value <= 0:
            raise BadRequest(f"{name} must be a positive integer, got {value!r}", param=name)
        max_tokens = value
    temperature = body.get("temperature")
    if temperature is None:
        temperature = 1.0
    if not _is_number(temperature) or not 0 <= temperature <= 2:
        raise BadRequest("temperature must be a number in [0, 2]", param="temperature")
    top_p = body.get("top_p")
    if top_p is None:
        top_p = 1.0
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise BadRequest("top_p must be a number in (0, 1]", param="top_p")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**64):
        raise BadRequest("seed must be an integer", param="seed")
    ignore_eos = _optional(body, "ignore_eos", bool, False)
    return Sampling(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                    seed=None if seed is None else seed % 2**63, ignore_eos=ignore_eos)


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
