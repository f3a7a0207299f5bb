"""A request's output as a Responses API Response object and its event stream.

Like router/http/anthropic_output.py, the presenter is fed chat-shaped deltas (``content``,
``reasoning_content``, ``tool_calls`` fragments) and builds output items from them: a
``reasoning`` item, a ``message`` item with one ``output_text`` part, one
``function_call`` item per call. Streaming, each item is announced with
``response.output_item.added``, grown with ``…text.delta`` /
``response.function_call_arguments.delta`` and closed with its ``…done`` events when the
next begins; ``response.completed`` (or ``response.incomplete`` at max_output_tokens, as
OpenAI sends it) carries the whole Response, which is also the non-streaming answer.
"""

from __future__ import annotations

import time
from typing import Any

from common.errors import HeadroomError
from router.http.http_errors import renamed
from router.http.output import Collector, sse

# Chat's field names in errors, as Responses names them (its request is checked as a chat's;
# its input items are not chat's messages one for one, so no index is kept).
NAMES = ((r"\bmax_tokens\b", "max_output_tokens"),
         (r"tools\[(\d+)\]\.function\.", r"tools[\1]."),
         (r"\bresponse_format\b", "text.format"),
         (r"(?<![\w-])messages(\[\d+\])?", "input"))  # not the flag --max-messages


def error_body(exc: HeadroomError) -> dict[str, Any]:
    """The OpenAI error shape, with the fields named as Responses names them."""
    return renamed(exc, NAMES).to_body()

KEEPALIVE = b": keepalive\n\n"


class ResponsesPresenter:
    """A Response object, and its stream: created, output items, completed."""

    def __init__(self, request_id: str, echo: dict[str, Any]) -> None:
        self.request_id = request_id
        self.suffix = request_id.removeprefix("resp_")
        self.created_at = int(time.time())
        self.echo = echo  # request fields a Response repeats (model, instructions, tools, ...)
        self.items: list[dict[str, Any]] = []
        self._open: tuple[str, int | None] | None = None  # (item type, tool call index)
        self._sequence = 0
        self._started = False

    # -- feeding ------------------------------------------------------------------------

    def feed(self, delta: dict[str, Any]) -> bytes:
        """Grow the items by one chat-shaped delta; returns the events that say so."""
        out = b""
        if delta.get("reasoning_content"):
            out += self._text("reasoning", "reasoning_text", delta["reasoning_content"])
        if delta.get("content"):
            out += self._text("message", "output_text", delta["content"])
        for call in delta.get("tool_calls") or ():
            out += self._call_fragment(call)
        return out

    def _text(self, kind: str, part_type: str, text: str) -> bytes:
        out = b""
        if self._open != (kind, None):
            item: dict[str, Any] = {"type": kind, "id": f"{'rs' if kind == 'reasoning' else 'msg'}_"
                                    f"{self.suffix}_{len(self.items)}", "status": "in_progress"}
            item.update({"summary": []} if kind == "reasoning" else {"role": "assistant"})
            out += self._open_item(kind, None, {**item, "content": []})
            part = {"type": part_type, "text": ""}
            if part_type == "output_text":
                part.update(annotations=[], logprobs=[])
                out += self._event("response.content_part.added", **self._where(), content_index=0,
                                   part=part)
            self.items[-1]["content"].append(part)
        if not text:
            return out
        self.items[-1]["content"][0]["text"] += text
        return out + self._event(f"response.{part_type}.delta", **self._where(), content_index=0,
                                 delta=text, **({"logprobs": []} if kind == "message" else {}))

    def _call_fragment(self, call: dict[str, Any]) -> bytes:
        function = call.get("function") or {}
        index = call.get("index", 0)
        out = b""
        if self._open != ("function_call", index):
            call_id = call.get("id") or f"call_{self.suffix}_{index}"
            out += self._open_item("function_call", index, {
                "type": "function_call", "id": f"fc_{self.suffix}_{len(self.items)}",
                "call_id": call_id, "name": function.get("name", ""), "arguments": "",
                "status": "in_progress"})
        arguments = function.get("arguments")
        if arguments:
            self.items[-1]["arguments"] += arguments
            out += self._event("response.function_call_arguments.delta", **self._where(),
                               delta=arguments)
        return out

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _open_item(self, kind: str, call_index: int | None, item: dict[str, Any]) -> bytes:
        out = self._close_item()
        self._open = (kind, call_index)
        self.items.append(item)
        return out + self._event("response.output_item.added", output_index=len(self.items) - 1,
                                 item=item)

    def _close_item(self, status: str = "completed") -> bytes:
        if self._open is None:
            return b""
        kind, _ = self._open
        self._open = None
        item, where = self.items[-1], self._where()
        item["status"] = status
        out = b""
        if kind == "function_call":
            out += self._event("response.function_call_arguments.done", **where,
                               arguments=item["arguments"])
        else:
            part = item["content"][0]
            extra = {"logprobs": []} if kind == "message" else {}
            out += self._event(f"response.{part['type']}.done", **where, content_index=0,
                               text=part["text"], **extra)
            if kind == "message":
                out += self._event("response.content_part.done", **where, content_index=0, part=part)
        return out + self._event("response.output_item.done", output_index=where["output_index"],
                                 item=item)

    def _event(self, kind: str, **fields: Any) -> bytes:
        self._sequence += 1
        return sse({"type": kind, "sequence_number": self._sequence - 1, **fields}, event=kind)

    # -- the Presenter interface --------------------------------------------------------

    def _response(self, status: str, c: Collector | None = None, **fields: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.request_id, "object": "response", "created_at": self.created_at,
            "status": status, "error": None, "incomplete_details": None,
            "output": self.items if c is not None else [], "previous_response_id": None,
            "store": False, "truncation": "disabled", "usage": None, **self.echo, **fields}
        if c is not None:
            body["usage"] = {"input_tokens": c.prompt_tokens, "output_tokens": c.completion_tokens,
                             "total_tokens": c.prompt_tokens + c.completion_tokens,
                             "input_tokens_details": {"cached_tokens": c.cached_tokens},
                             "output_tokens_details": {"reasoning_tokens": 0}}
        return body

    def _end(self, c: Collector) -> bytes:
        out = self.feed(c.take_chat_delta())
        if not self.items:  # an answer always has its message, as output_text reads it
            out += self._text("message", "output_text", "")
        # The item the limit cut short is as incomplete as the response (OpenAI marks both).
        return out + self._close_item("incomplete" if c.finish_reason == "length" else "completed")

    def _final(self, c: Collector) -> dict[str, Any]:
        if c.finish_reason == "length":
            return self._response("incomplete", c, incomplete_details={"reason": "max_output_tokens"})
        return self._response("completed", c)

    def _start(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        head = self._response("in_progress")
        return (self._event("response.created", response=head)
                + self._event("response.in_progress", response=head))

    def body(self, collectors: list[Collector], prompt_tokens: int) -> dict[str, Any]:
        c = collectors[0]  # a Response has one output
        self._end(c)
        return self._final(c)

    def delta(self, c: Collector) -> bytes:
        return self._start() + self.feed(c.take_chat_delta())

    def keepalive(self) -> bytes:
        return self._start() or KEEPALIVE

    def tail(self, collectors: list[Collector], prompt_tokens: int) -> bytes:
        c = collectors[0]
        out = self._start() + self._end(c)
        final = self._final(c)
        return out + self._event(f"response.{final['status']}", response=final)

    def error(self, exc: HeadroomError) -> bytes:
        exc = renamed(exc, NAMES)
        failed = self._response("failed", error={"code": exc.code, "message": exc.message})
        return (self._start()
                + self._event("error", code=exc.code, message=exc.message, param=exc.param)
                + self._event("response.failed", response=failed))
