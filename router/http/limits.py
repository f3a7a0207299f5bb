"""How big a request may be: sizes checked before parsing, whatever the endpoint. Pure.

The body size (413), the header size and the idle timeout are enforced by aiohttp itself
(``client_max_size``, ``max_field_size``, ``keepalive_timeout``); the rest is here, each a
``BadRequest`` naming the parameter and the flag that sets its limit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from common.config import RouterConfig
from common.errors import BadRequest, ContextLengthExceeded

# A stop string longer than this is a mistake or an attack: the matcher holds back as many
# characters of every stream.
MAX_STOP_CHARS = 1024
# Body keys that ask for a number of output tokens, across the APIs the router serves.
MAX_TOKENS_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None
    max_messages: int = 2048
    max_tools: int = 128
    max_schema_bytes: int = 64 * 1024
    max_stop_chars: int = MAX_STOP_CHARS
    request_timeout_s: float = 60.0
    stream_buffer_bytes: int = 256 * 1024
    slow_reader_timeout_s: float = 30.0
    keepalive_s: float = 5.0

    @classmethod
    def from_config(cls, cfg: RouterConfig) -> Limits:
        return cls(max_prompt_tokens=cfg.max_prompt_tokens, max_tokens=cfg.max_tokens_limit,
                   max_messages=cfg.max_messages, max_tools=cfg.max_tools,
                   max_schema_bytes=cfg.max_schema_bytes, request_timeout_s=cfg.request_timeout_s,
                   stream_buffer_bytes=cfg.stream_buffer_bytes,
                   slow_reader_timeout_s=cfg.slow_reader_timeout_s, keepalive_s=cfg.sse_keepalive_s)


def check_body(body: Any, limits: Limits) -> None:
    """Refuse a body over any size limit; the endpoint's parser checks everything else."""
    if not isinstance(body, dict):
        return
    for name in ("messages", "input"):  # Responses' `input` is its list of messages
        items = body.get(name)
        if isinstance(items, list) and len(items) > limits.max_messages:
            raise BadRequest(f"{len(items)} {name} items; this server takes at most "
                             f"{limits.max_messages} (--max-messages)", param=name)
    for name in ("tools", "functions"):
        tools = body.get(name)
        if isinstance(tools, list):
            if len(tools) > limits.max_tools:
                raise BadRequest(f"{len(tools)} {name}; this server takes at most "
                                 f"{limits.max_tools} (--max-tools)", param=name)
            for i, tool in enumerate(tools):
                _check_schema(tool, f"{name}[{i}]", limits)
    if isinstance(body.get("response_format"), dict):
        _check_schema(body["response_format"], "response_format", limits)
    _check_stops(body.get("stop"), limits)
    _check_stops(body.get("stop_sequences"), limits, param="stop_sequences")
    if limits.max_tokens is not None:
        for name in MAX_TOKENS_KEYS:
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > limits.max_tokens:
                raise BadRequest(f"{name} is {value}; this server allows at most "
                                 f"{limits.max_tokens} (--max-tokens-limit)", param=name)


def check_max_tokens(max_tokens: int, limits: Limits) -> None:
    """The max_tokens a request will run with, given or defaulted."""
    if limits.max_tokens is not None and max_tokens > limits.max_tokens:
        raise BadRequest(f"max_tokens is {max_tokens}; this server allows at most "
                         f"{limits.max_tokens} (--max-tokens-limit)", param="max_tokens")


def check_prompt_tokens(num_tokens: int, limits: Limits, param: str) -> None:
    if limits.max_prompt_tokens is not None and num_tokens > limits.max_prompt_tokens:
        raise ContextLengthExceeded(
            f"the prompt has {num_tokens} tokens; this server takes at most "
            f"{limits.max_prompt_tokens} (--max-prompt-tokens)", param=param,
            sizes=(num_tokens, 0, limits.max_prompt_tokens))


def _check_schema(value: Any, param: str, limits: Limits) -> None:
    try:
        size = len(json.dumps(value, separators=(",", ":")).encode())
    except (RecursionError, ValueError):
        raise BadRequest(f"{param} is nested too deeply", param=param) from None
    if size > limits.max_schema_bytes:
        raise BadRequest(f"{param} is {size} bytes of JSON; this server takes at most "
                         f"{limits.max_schema_bytes} (--max-schema-bytes)", param=param)


def _check_stops(stop: Any, limits: Limits, param: str = "stop") -> None:
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    for s in stops:
        if isinstance(s, str) and len(s) > limits.max_stop_chars:
            raise BadRequest(f"a stop string of {len(s)} characters; at most "
                             f"{limits.max_stop_chars} are allowed", param=param)
