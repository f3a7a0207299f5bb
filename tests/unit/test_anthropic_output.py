"""Tests for router/anthropic_output.py: chat-shaped output as Anthropic's message and its
event sequence, and the error tree in Anthropic's shape. Pure: no processes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from common.errors import (
    BadRequest, HeadroomError, InsufficientMemory, NoWorker, QueueFull, Unauthorized, WorkerLost,
)
from router.anthropic_output import MessagesPresenter, error_body
from router.job import TokenEvent
from router.output import Collector


# -- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(("error", "kind"), [
    (BadRequest("x"), "invalid_request_error"), (Unauthorized("x"), "authentication_error"),
    (QueueFull("x"), "overloaded_error"), (NoWorker("x"), "overloaded_error"),
    (WorkerLost("x"), "overloaded_error"), (HeadroomError("x"), "api_error"),
])
def test_error_types(error: HeadroomError, kind: str) -> None:
    assert error_body(error) == {"type": "error", "error": {"type": kind, "message": "x"}}


def test_never_fits_carries_the_needed_bytes_in_the_message() -> None:
    error = InsufficientMemory("too big", param="max_tokens", needed_bytes=123, max_request_tokens=9)
    assert error_body(error)["error"]["message"] == "too big (needed_bytes 123, max_request_tokens 9)"


# -- response --------------------------------------------------------------------------


class CharDetokenizer:
    """Token id n is the character chr(n)."""

    def add(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))

    def flush(self) -> str:
        return ""


def collector(stops: list[str] | None = None) -> Collector:
    return Collector(CharDetokenizer(), stops or [], prompt_tokens=7)  # type: ignore[arg-type]


def events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            name, data = block.split("\n")
            payload = json.loads(data.removeprefix("data: "))
            assert name == "event: " + payload["type"]
            out.append(payload)
    return out


def test_stream_sequence_and_whole_message_agree() -> None:
    c, p = collector(), MessagesPresenter("msg_1", "demo", 7)
    raw = p.keepalive() + p.keepalive()
    for ids, reason in (([72, 105], None), ([33], "length")):
        c.feed(TokenEvent(ids, reason))
        raw += p.delta(c)
    raw += p.tail([c], 7)
    seq = events(raw)
    assert [e["type"] for e in seq] == [
        "message_start", "ping", "ping", "content_block_start", "content_block_delta",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert seq[0]["message"]["usage"]["input_tokens"] == 7
    assert "".join(e["delta"]["text"] for e in seq if e["type"] == "content_block_delta") == "Hi!"
    assert seq[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert seq[-2]["usage"]["output_tokens"] == 3
    whole = p.body([c], 7)
    assert whole["content"] == [{"type": "text", "text": "Hi!"}]
    assert whole["stop_reason"] == "max_tokens" and whole["usage"]["output_tokens"] == 3


@pytest.mark.parametrize(("stops", "reason", "sequence"), [
    (["!"], "stop_sequence", "!"), ([], "end_turn", None)])
def test_stop_reasons(stops: list[str], reason: str, sequence: str | None) -> None:
    c = collector(stops)
    c.feed(TokenEvent([72, 105, 33, 63], "stop"))
    whole = MessagesPresenter("msg_1", "demo", 7).body([c], 7)
    assert (whole["stop_reason"], whole["stop_sequence"]) == (reason, sequence)


def test_empty_output_still_has_one_text_block() -> None:
    c, p = collector(), MessagesPresenter("msg_1", "demo", 7)
    c.feed(TokenEvent([], "stop"))
    seq = events(p.delta(c) + p.tail([c], 7))
    assert [e["type"] for e in seq] == ["message_start", "ping", "content_block_start",
                                        "content_block_stop", "message_delta", "message_stop"]


def test_stream_error_is_an_anthropic_error_event() -> None:
    seq = events(MessagesPresenter("msg_1", "demo", 7).error(WorkerLost("gone")))
    assert seq == [{"type": "error", "error": {"type": "overloaded_error", "message": "gone"}}]


def test_thinking_text_and_streamed_tool_calls_become_blocks() -> None:
    p = MessagesPresenter("msg_1", "demo", 7)
    raw = p.feed({"reasoning_content": "Need the "}) + p.feed({"reasoning_content": "weather."})
    raw += p.feed({"content": "Checking."})
    raw += p.feed({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                   "function": {"name": "get_weather", "arguments": ""}}]})
    for fragment in ('{"city": ', '"Oslo"}'):
        raw += p.feed({"tool_calls": [{"index": 0, "function": {"arguments": fragment}}]})
    raw += p.feed({"tool_calls": [{"index": 1, "id": "call_b", "function": {"name": "now", "arguments": "{}"}}]})
    c = collector()
    c.feed(TokenEvent([], "stop"))
    seq = events(raw + p.tail([c], 7))
    starts = [e["content_block"] for e in seq if e["type"] == "content_block_start"]
    assert [b["type"] for b in starts] == ["thinking", "text", "tool_use", "tool_use"]
    assert starts[2] == {"type": "tool_use", "id": "call_a", "name": "get_weather", "input": {}}
    partial = "".join(e["delta"]["partial_json"] for e in seq
                      if e["type"] == "content_block_delta" and e["index"] == 2)
    assert json.loads(partial) == {"city": "Oslo"}
    assert [e["index"] for e in seq if e["type"] == "content_block_stop"] == [0, 1, 2, 3]
    assert seq[-2]["delta"]["stop_reason"] == "tool_use"
    assert p.blocks == [{"type": "thinking", "thinking": "Need the weather."},
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "call_a", "name": "get_weather",
                         "input": {"city": "Oslo"}},
                        {"type": "tool_use", "id": "call_b", "name": "now", "input": {}}]


def test_whole_message_with_a_tool_call() -> None:
    p = MessagesPresenter("msg_1", "demo", 7)
    p.feed({"tool_calls": [{"index": 0, "id": "call_a", "function": {
        "name": "f", "arguments": '{"a": 1}'}}]})
    c = collector()
    c.feed(TokenEvent([], "stop"))
    whole = p.body([c], 7)
    assert whole["stop_reason"] == "tool_use"
    assert whole["content"] == [{"type": "tool_use", "id": "call_a", "name": "f", "input": {"a": 1}}]
