"""From token events to responses: detokenize, apply stop strings, count, format.

`Collector` is shared by every API; a `Presenter` is one API's view of it (the OpenAI one,
`ChatPresenter`, is here; router/anthropic_api.py and router/responses_api.py hold theirs).
"""

from __future__ import annotations

import json
import time
from typing import Any, Protocol

from common.errors import HeadroomError
from router.job import TokenEvent
from router.schema import Parsed
from router.stops import StopMatcher
from router.tokenizer import IncrementalDetokenizer


class Collector:
    """Text and usage of one request as its tokens arrive."""

    def __init__(self, detokenizer: IncrementalDetokenizer, stops: list[str], prompt_tokens: int) -> None:
        self.detokenizer = detokenizer
        self.stops = StopMatcher(stops) if stops else None
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.finished = False
        self.finish_reason: str | None = None
        self.parts: list[str] = []
        self._delta: list[str] = []

    def feed(self, event: TokenEvent) -> None:
        if self.finished:
            return
        self.completion_tokens += len(event.token_ids)
        text = self.detokenizer.add(event.token_ids)
        if event.finish_reason is not None:
            text += self.detokenizer.flush()
        stopped = False
        if self.stops is not None:
            text, stopped = self.stops.feed(text)
            if event.finish_reason is not None and not stopped:
                text += self.stops.flush()
                stopped = self.stops.is_stopped
        if text:
            self.parts.append(text)
            self._delta.append(text)
        if stopped:
            self.finished, self.finish_reason = True, "stop"
        elif event.finish_reason is not None:
            self.finished = True
            self.finish_reason = "length" if event.finish_reason == "length" else "stop"

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self.stops.matched if self.stops is not None else None

    def take_delta(self) -> str:
        delta = "".join(self._delta)
        self._delta.clear()
        return delta

    def take_chat_delta(self) -> dict[str, Any]:
        """What was gathered since the last take, as a chat completion's stream delta carries
        it; router/anthropic_output.py and router/responses_output.py build from these."""
        return {"content": self.take_delta()}

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


class Formatter:
    """The OpenAI shapes for chat and text completions, streamed and not."""

    def __init__(self, parsed: Parsed, request_id: str, model_id: str) -> None:
        self.chat = parsed.kind == "chat"
        self.include_usage = parsed.include_usage
        self.request_id = request_id
        self.model_id = model_id
        self.created = int(time.time())
        self._role_sent = False

    def _envelope(self, choices: list[dict[str, Any]], *, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        body: dict[str, Any] = {"id": self.request_id, "object": kind, "created": self.created,
                                "model": self.model_id, "choices": choices}
        if chunk and self.include_usage:
            body["usage"] = None
        return body

    def chunk(self, delta: str) -> dict[str, Any]:
        if not self.chat:
            return self._envelope([{"index": 0, "text": delta, "logprobs": None,
                                    "finish_reason": None}], chunk=True)
        body: dict[str, Any] = {"content": delta}
        if not self._role_sent:
            body["role"] = "assistant"
            self._role_sent = True
        return self._envelope([{"index": 0, "delta": body, "logprobs": None,
                                "finish_reason": None}], chunk=True)

    def needs_first_chunk(self) -> bool:
        return self.chat and not self._role_sent

    def final_chunk(self, c: Collector) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {}, "logprobs": None,
                                      "finish_reason": c.finish_reason}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": c.finish_reason}
        return self._envelope([choice], chunk=True)

    def usage_chunk(self, c: Collector) -> dict[str, Any]:
        body = self._envelope([], chunk=True)
        body["usage"] = c.usage()
        return body

    def full(self, c: Collector) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": c.text},
                                      "logprobs": None, "finish_reason": c.finish_reason}
        else:
            choice = {"index": 0, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
        body = self._envelope([choice], chunk=False)
        body["usage"] = c.usage()
        return body


def sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class Presenter(Protocol):
    """One API's shapes for a request's output; router/api.py's loop calls these.

    Stream methods return the bytes to write, b"" for nothing. A presenter keeps what it has
    sent, so it opens its stream (headers of the message, the first block) when it first
    has something to say, and closes what it opened.
    """

    def body(self, collectors: list[Collector], prompt_tokens: int) -> dict[str, Any]:
        """The whole response of a request that does not stream."""
        ...

    def delta(self, c: Collector) -> bytes:
        """What one choice gathered since the last call (and its end, once it finished)."""
        ...

    def keepalive(self) -> bytes:
        """Something to send while nothing happens, so a vanished client is noticed."""
        ...

    def tail(self, collectors: list[Collector], prompt_tokens: int) -> bytes:
        """The end of a stream whose choices all finished."""
        ...

    def error(self, exc: HeadroomError) -> bytes:
        """The end of a stream that failed after it had started."""
        ...


class ChatPresenter:
    """The OpenAI shapes (chat and text completions) as a `Presenter`."""

    def __init__(self, fmt: Formatter) -> None:
        self.fmt = fmt

    def body(self, collectors: list[Collector], prompt_tokens: int) -> dict[str, Any]:
        return self.fmt.full(collectors[0])

    def delta(self, c: Collector) -> bytes:
        text = c.take_delta()
        if not text and not self.fmt.needs_first_chunk():
            return b""
        return sse(self.fmt.chunk(text))

    def keepalive(self) -> bytes:
        return b": keepalive\n\n"

    def tail(self, collectors: list[Collector], prompt_tokens: int) -> bytes:
        tail = sse(self.fmt.final_chunk(collectors[0]))
        if self.fmt.include_usage:
            tail += sse(self.fmt.usage_chunk(collectors[0]))
        return tail + b"data: [DONE]\n\n"

    def error(self, exc: HeadroomError) -> bytes:
        return sse(exc.to_body(), event="error") + b"data: [DONE]\n\n"
