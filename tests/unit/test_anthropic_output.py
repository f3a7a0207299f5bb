"""Tests for router/http/anthropic_output.py: chat-shaped output as Anthropic's message and its
event sequence, and the error tree in Anthropic's shape. Pure: no processes."""

from __future__ import annotations

import json
import re
from typing import Any

import anthropic
import anthropic.types as anthropic_types
import httpx
import pytest
from pydantic import TypeAdapter

from common.errors import (
    BadRequest, ContextLengthExceeded, HeadroomError, InsufficientMemory, ModelNotFound, NoWorker, QueueFull,
    QueueTimeout, Unauthorized, WorkerLost,
)
from router.http.anthropic_output import MessagesPresenter, error_body
from router.chat.streamparser import ToolCall
from router.http.output import Collector
from router.job import TokenEvent


# -- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(("error", "kind"), [
    (BadRequest("x"), "invalid_request_error"), (Unauthorized("x"), "authentication_error"),
    (QueueFull("x"), "rate_limit_error"), (NoWorker("x"), "overloaded_error"),
    (QueueTimeout("x"), "overloaded_error"), (WorkerLost("x"), "overloaded_error"),
    (HeadroomError("x"), "api_error"), (ModelNotFound("x"), "not_found_error"),
])
def test_error_types(error: HeadroomError, kind: str) -> None:
    body = error_body(error)
    assert body == {"type": "error", "error": {"type": kind, "message": "x"}}
    # The official SDK's error models take it (their ``type`` is a Literal per kind)
    parsed = anthropic_types.ErrorResponse.model_validate(body)
    assert parsed.error.type == kind


def test_a_full_queue_is_a_rate_limit_for_the_sdk() -> None:
    """The anthropic client maps a 429 to RateLimitError (and retries it): the body agrees."""
    request = httpx.Request("POST", "http://x/v1/messages")
    response = httpx.Response(429, json=error_body(QueueFull("full")), request=request)
    error = anthropic.Anthropic(api_key="k")._make_status_error(
        "full", body=response.json(), response=response)
    assert isinstance(error, anthropic.RateLimitError)
    assert error.body == {"type": "error", "error": {"type": "rate_limit_error", "message": "full"}}


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


def collector(stops: list[str] | None = None, calls: int = 0) -> Collector:
    """A choice's collector; ``calls``: whole tool calls it parsed (the presenter was fed them)."""
    c = Collector(CharDetokenizer(), stops or [], prompt_tokens=7)  # type: ignore[arg-type]
    c.calls += [ToolCall(f"call_{i}", "f", "{}") for i in range(calls)]
    return c


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
    c = collector(calls=2)
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
    assert p.blocks == [{"type": "thinking", "thinking": "Need the weather.", "signature": ""},
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "call_a", "name": "get_weather",
                         "input": {"city": "Oslo"}},
                        {"type": "tool_use", "id": "call_b", "name": "now", "input": {}}]


def test_whole_message_with_a_tool_call() -> None:
    p = MessagesPresenter("msg_1", "demo", 7)
    p.feed({"tool_calls": [{"index": 0, "id": "call_a", "function": {
        "name": "f", "arguments": '{"a": 1}'}}]})
    c = collector(calls=1)
    c.feed(TokenEvent([], "stop"))
    whole = p.body([c], 7)
    assert whole["stop_reason"] == "tool_use"
    assert whole["content"] == [{"type": "tool_use", "id": "call_a", "name": "f", "input": {"a": 1}}]


def test_max_tokens_wins_over_an_open_tool_use() -> None:
    """Cut by the limit while a call was being written: the call is unfinished, so the
    reason is max_tokens (a client would otherwise run a tool with truncated input)."""
    p = MessagesPresenter("msg_1", "demo", 7)
    p.feed({"tool_calls": [{"index": 0, "id": "call_a", "function": {"name": "f", "arguments": '{"a": 1}'}}]})
    c = collector()
    c.feed(TokenEvent([72], "length"))
    assert p.body([c], 7)["stop_reason"] == "max_tokens"
    streamed = MessagesPresenter("msg_2", "demo", 7)
    streamed.feed({"tool_calls": [{"index": 0, "id": "call_b", "function": {"name": "f", "arguments": "{"}}]})
    assert events(streamed.tail([c], 7))[-2]["delta"]["stop_reason"] == "max_tokens"


def test_thinking_blocks_parse_with_the_official_sdk() -> None:
    """ThinkingBlock requires ``signature``: the whole message and the streamed events (its
    start, a signature_delta before the stop) validate as the SDK's own models."""
    p = MessagesPresenter("msg_1", "demo", 7)
    raw = p.keepalive() + p.feed({"reasoning_content": "Hmm."}) + p.feed({"content": "Hi"})
    c = collector()
    c.feed(TokenEvent([], "stop"))
    raw += p.tail([c], 7)
    message = anthropic_types.Message.model_validate(p._message("end_turn", None, 0))
    thinking = message.content[0]
    assert isinstance(thinking, anthropic_types.ThinkingBlock)
    assert (thinking.thinking, thinking.signature) == ("Hmm.", "")
    adapter: TypeAdapter[Any] = TypeAdapter(anthropic_types.RawMessageStreamEvent)
    seq = [adapter.validate_python(e) for e in events(raw) if e["type"] != "ping"]
    assert isinstance(seq[0], anthropic_types.RawMessageStartEvent)
    start = seq[1]
    assert isinstance(start, anthropic_types.RawContentBlockStartEvent)
    assert isinstance(start.content_block, anthropic_types.ThinkingBlock)
    deltas = [e.delta for e in seq if isinstance(e, anthropic_types.RawContentBlockDeltaEvent) and e.index == 0]
    assert [type(d) for d in deltas] == [anthropic_types.ThinkingDelta, anthropic_types.SignatureDelta]
    assert isinstance(seq[4], anthropic_types.RawContentBlockStopEvent) and seq[4].index == 0



CLAUDE_CODE_OVERFLOW = r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)"


def test_context_overflow_is_worded_as_anthropic_words_it() -> None:
    """Claude Code parses the first wording and retries with a max_tokens that fits; agents
    look for the second to compact their context."""
    over = ContextLengthExceeded("296 + 4000 over 4096", sizes=(296, 4000, 4096))
    m = re.search(CLAUDE_CODE_OVERFLOW, error_body(over)["error"]["message"])
    assert m is not None and m.groups() == ("296", "4000", "4096")
    too_long = ContextLengthExceeded("14016 over 4096", sizes=(14016, 10, 4096))
    assert error_body(too_long)["error"]["message"] == "prompt is too long: 14016 tokens > 4096 maximum"
    assert error_body(ContextLengthExceeded("plain"))["error"]["message"] == "plain"


@pytest.mark.parametrize("fmt", ["hermes", "harmony"])
def test_a_call_cut_by_a_stop_sequence_is_no_tool_use(fmt: str) -> None:
    """A stop string that ends the output inside a call: chat says stop, Messages
    stop_sequence, and no client runs the cut call as if it were whole."""
    from router.chat.tools import make_parser

    text = {"hermes": '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
                      '<tool_call>\n{"name": "b", "arguments": {"x": "Par',
            "harmony": '<|channel|>commentary to=functions.b <|constrain|>json<|message|>{"x": "Par'}[fmt]
    c = Collector(CharDetokenizer(), ["Par"], prompt_tokens=7, parser=make_parser(fmt))  # type: ignore[arg-type]
    c.feed(TokenEvent([ord(ch) for ch in text], None))
    assert c.finished and c.finish_reason == "stop" and c.calls[-1].name == "b"
    p = MessagesPresenter("msg_1", "demo", 7)
    p.feed(c.take_chat_delta())
    whole = p.body([c], 7)
    assert whole["stop_reason"] == "stop_sequence" and whole["stop_sequence"] == "Par"


def test_quoted_values_are_never_renamed() -> None:
    from router.http.http_errors import renamed
    from router.http.responses_output import NAMES

    exc = BadRequest("tool_choice names 'messages', which is not in tools; messages[2] too",
                     param="tool_choice")
    assert renamed(exc, NAMES).message == "tool_choice names 'messages', which is not in tools; input too"
