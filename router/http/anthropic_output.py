"""A request's output as Anthropic's message and its SSE event sequence.

The presenter is fed chat-shaped deltas, the pieces a chat completion's stream carries
(``content``, ``reasoning_content``, ``tool_calls`` fragments with ``index``, ``id``,
``function.name`` and ``function.arguments``), and turns them into content blocks:
``thinking``, ``text`` and ``tool_use``. Streaming, each block is opened with
``content_block_start``, grown with ``thinking_delta`` / ``text_delta`` /
``input_json_delta`` and closed with ``content_block_stop`` when the next one begins; the
whole message is the same blocks, built by the same feed. A thinking block carries an empty
``signature`` (and gets an empty ``signature_delta`` before it closes), as Anthropic's shape
has one: its SDK's ``ThinkingBlock`` requires the field, and clients replay it as received.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from common.errors import ContextLengthExceeded, HeadroomError
from router.http.http_errors import renamed
from router.http.output import Collector, sse

log = logging.getLogger(__name__)

PING = sse({"type": "ping"}, event="ping")
# chat delta field -> (block type, the block's text field, the delta type that grows it)
TEXT_KINDS = (("reasoning_content", "thinking", "thinking", "thinking_delta"),
              ("content", "text", "text", "text_delta"))
# Anthropic's error types by HTTP status: a full queue (429) is "rate limited, retry later",
# a 503 (no worker, queue timeout, lost worker) "overloaded, retry"; other 5xx are api_error.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error"}


# Chat's field names in errors, as Messages names them (its request is checked as a chat's).
NAMES = ((r"\bstop(?= must)", "stop_sequences"),
         (r"tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
         (r"tools\[(\d+)\]\.function\.", r"tools[\1]."),
         (r"\bresponse_format\b", "output_config.format"))


def error_body(exc: HeadroomError) -> dict[str, Any]:
    """Anthropic's error shape for any error of the tree: the API's one error mapping, used
    by router/http/api.py's middleware for HTTP errors and by the stream's ``error`` event."""
    kind = ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    message = renamed(exc, NAMES).message
    if isinstance(exc, ContextLengthExceeded) and exc.sizes is not None:
        # Anthropic's own wording, which clients parse: Claude Code retries the first with
        # a max_tokens that fits, and agents compact their context on the second.
        prompt, max_tokens, limit = exc.sizes
        if prompt > limit:
            message = f"prompt is too long: {prompt} tokens > {limit} maximum"
        else:
            message = (f"input length and `max_tokens` exceed context limit: {prompt} + "
                       f"{max_tokens} > {limit}, decrease input length or `max_tokens` and try again")
    elif exc.extra:  # the numbers behind a never-fits refusal, which OpenAI's shape has as fields
        message += " (" + ", ".join(f"{k} {v}" for k, v in exc.extra.items()) + ")"
    return {"type": "error", "error": {"type": kind, "message": message}}


class MessagesPresenter:
    """Anthropic's message, and its SSE sequence: message_start, content blocks, message_stop."""

    def __init__(self, request_id: str, model_id: str, input_tokens: int) -> None:
        self.request_id = request_id
        self.model_id = model_id
        self.input_tokens = input_tokens
        self.cached_tokens = 0
        self.blocks: list[dict[str, Any]] = []
        self._arguments: dict[int, list[str]] = {}  # block index -> tool input JSON fragments
        self._open: tuple[str, int | None] | None = None  # (block type, tool call index)
        self._started = False

    # -- feeding ------------------------------------------------------------------------

    def feed(self, delta: dict[str, Any]) -> bytes:
        """Grow the blocks by one chat-shaped delta; returns the events that say so."""
        out = b""
        for field, kind, text_field, delta_type in TEXT_KINDS:
            text = delta.get(field)
            if text:
                block = {"type": kind, text_field: ""}
                if kind == "thinking":
                    block["signature"] = ""  # nothing to sign: no client can verify one of ours
                out += self._open_block(kind, None, block)
                self.blocks[-1][text_field] += text
                out += self._event("content_block_delta", index=len(self.blocks) - 1,
                                   delta={"type": delta_type, text_field: text})
        for call in delta.get("tool_calls") or ():
            out += self._tool_fragment(call)
        return out

    def _tool_fragment(self, call: dict[str, Any]) -> bytes:
        function = call.get("function") or {}
        index = call.get("index", 0)
        out = b""
        if self._open != ("tool_use", index):
            block = {"type": "tool_use", "id": call.get("id") or f"toolu_{self.request_id}_{index}",
                     "name": function.get("name", ""), "input": {}}
            out += self._open_block("tool_use", index, block)
            self._arguments[len(self.blocks) - 1] = []
        arguments = function.get("arguments")
        if arguments:
            self._arguments[len(self.blocks) - 1].append(arguments)
            out += self._event("content_block_delta", index=len(self.blocks) - 1,
                               delta={"type": "input_json_delta", "partial_json": arguments})
        return out

    def _open_block(self, kind: str, call_index: int | None, block: dict[str, Any]) -> bytes:
        if self._open == (kind, call_index):
            return b""
        out = self._close_block()
        self._open = (kind, call_index)
        self.blocks.append(block)
        return out + self._event("content_block_start", index=len(self.blocks) - 1,
                                 content_block=block)

    def _close_block(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        index = len(self.blocks) - 1
        out = b""
        if index in self._arguments:
            self.blocks[index]["input"] = _tool_input("".join(self._arguments[index]))
        elif self.blocks[index]["type"] == "thinking":  # Anthropic signs just before the stop
            out = self._event("content_block_delta", index=index,
                              delta={"type": "signature_delta", "signature": ""})
        return out + self._event("content_block_stop", index=index)

    def _event(self, kind: str, **fields: Any) -> bytes:
        return sse({"type": kind, **fields}, event=kind)

    # -- the Presenter interface --------------------------------------------------------

    def _usage(self, output_tokens: int) -> dict[str, int]:
        """Anthropic counts cache reads apart: input + cache read is the whole prompt."""
        return {"input_tokens": self.input_tokens - self.cached_tokens, "output_tokens": output_tokens,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": self.cached_tokens}

    def _message(self, reason: str | None, stop_sequence: str | None,
                 output_tokens: int) -> dict[str, Any]:
        return {"id": self.request_id, "type": "message", "role": "assistant",
                "model": self.model_id, "content": self.blocks, "stop_reason": reason,
                "stop_sequence": stop_sequence, "usage": self._usage(output_tokens)}

    def _start(self, c: Collector | None = None) -> bytes:
        if self._started:
            return b""
        self._started = True
        if c is not None:  # known from the first tokens; a keepalive before them says none
            self.cached_tokens = c.cached_tokens
        start = {**self._message(None, None, 0), "content": []}
        return self._event("message_start", message=start) + PING

    def _end(self, c: Collector) -> bytes:
        out = self.feed(c.take_chat_delta())
        if not self.blocks:  # a message always has a block, as clients index content[0]
            out += self._open_block("text", None, {"type": "text", "text": ""})
        return out + self._close_block()

    def stop_reason(self, c: Collector) -> str:
        # max_tokens first: a tool_use block cut by the limit holds a call that never finished
        if c.finish_reason == "length":
            return "max_tokens"
        # As chat's finish_reason: tool_calls only when every call is whole (a stop
        # sequence may cut one)
        if c.finish_reason == "tool_calls":
            return "tool_use"
        return "stop_sequence" if c.stop_sequence is not None else "end_turn"

    def body(self, collectors: list[Collector], prompt_tokens: int) -> dict[str, Any]:
        c = collectors[0]  # Messages has one choice
        self._end(c)
        self.cached_tokens = c.cached_tokens
        return self._message(self.stop_reason(c), c.stop_sequence, c.completion_tokens)

    def delta(self, c: Collector) -> bytes:
        return self._start(c) + self.feed(c.take_chat_delta())

    def keepalive(self) -> bytes:
        return self._start() or PING

    def tail(self, collectors: list[Collector], prompt_tokens: int) -> bytes:
        c = collectors[0]
        out = self._start(c) + self._end(c)
        self.cached_tokens = c.cached_tokens
        out += self._event("message_delta", usage=self._usage(c.completion_tokens),
                           delta={"stop_reason": self.stop_reason(c), "stop_sequence": c.stop_sequence})
        return out + self._event("message_stop")

    def error(self, exc: HeadroomError) -> bytes:
        return sse(error_body(exc), event="error")


def _tool_input(arguments: str) -> Any:
    """A tool call's arguments as the ``input`` object (constrained decoding makes them JSON)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        log.debug("tool call arguments are not JSON (cut short?); sent as an empty input: %.200s",
                  arguments)
        return {}
    return value if isinstance(value, dict) else {"value": value}
