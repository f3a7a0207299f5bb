"""Tests for router/http/responses_output.py: chat-shaped output as a Response object and its
event stream. Pure: no processes."""

from __future__ import annotations

import json

from common.errors import WorkerLost
from router.http.responses_output import ResponsesPresenter
from router.job import TokenEvent
from tests.unit.test_anthropic_output import collector, events


# -- response --------------------------------------------------------------------------


def presenter() -> ResponsesPresenter:
    return ResponsesPresenter("resp_abc", {"model": "demo", "tools": []})


def test_stream_sequence_and_whole_response_agree() -> None:
    c, p = collector(), presenter()
    raw = p.keepalive() + p.keepalive()
    assert raw.endswith(b": keepalive\n\n")
    raw = raw.removesuffix(b": keepalive\n\n")
    for ids, reason in (([72, 105], None), ([33], "stop")):
        c.feed(TokenEvent(ids, reason))
        raw += p.delta(c)
    seq = events(raw + p.tail([c], 7))
    assert [e["type"] for e in seq] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [e["sequence_number"] for e in seq] == list(range(len(seq)))
    assert seq[0]["response"]["status"] == "in_progress"
    assert "".join(e["delta"] for e in seq if e["type"] == "response.output_text.delta") == "Hi!"
    final = seq[-1]["response"]
    assert final == p.body([c], 7) and final["status"] == "completed"
    assert final["output"][0]["content"][0]["text"] == "Hi!" and final["store"] is False
    assert final["usage"]["input_tokens"] == 7 and final["usage"]["output_tokens"] == 3


def test_max_output_tokens_is_incomplete() -> None:
    c, p = collector(), presenter()
    c.feed(TokenEvent([72], "length"))
    seq = events(p.delta(c) + p.tail([c], 7))
    assert seq[-1]["type"] == "response.incomplete"
    assert seq[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    # The message the limit cut is incomplete too, where it closes and in the final object.
    done = [e for e in seq if e["type"] == "response.output_item.done"]
    assert [e["item"]["status"] for e in done] == ["incomplete"]
    assert [item["status"] for item in seq[-1]["response"]["output"]] == ["incomplete"]
    c = collector()
    c.feed(TokenEvent([72], "length"))
    body = presenter().body([c], 7)
    assert body["status"] == "incomplete" and body["output"][0]["status"] == "incomplete"


def test_only_the_item_the_limit_cut_is_incomplete() -> None:
    c, p = collector(), presenter()
    raw = p.feed({"reasoning_content": "Hmm."}) + p.feed({"content": "Hi"})
    c.feed(TokenEvent([], "length"))
    seq = events(raw + p.tail([c], 7))
    done = [e["item"] for e in seq if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["status"]) for i in done] == [("reasoning", "completed"),
                                                       ("message", "incomplete")]
    assert [i["status"] for i in seq[-1]["response"]["output"]] == ["completed", "incomplete"]


def test_a_finished_answer_is_completed() -> None:
    c, p = collector(), presenter()
    c.feed(TokenEvent([72], "stop"))
    seq = events(p.delta(c) + p.tail([c], 7))
    assert seq[-1]["type"] == "response.completed"
    assert [i["status"] for i in seq[-1]["response"]["output"]] == ["completed"]


def test_stream_error_ends_with_response_failed() -> None:
    seq = events(presenter().error(WorkerLost("gone")))
    assert [e["type"] for e in seq] == ["response.created", "response.in_progress", "error",
                                        "response.failed"]
    assert seq[2]["code"] == "worker_lost" and seq[2]["message"] == "gone"
    assert seq[3]["response"]["error"] == {"code": "worker_lost", "message": "gone"}


def test_reasoning_text_and_streamed_function_calls_become_items() -> None:
    p = presenter()
    raw = p.feed({"reasoning_content": "Think."}) + p.feed({"content": "Running it."})
    raw += p.feed({"tool_calls": [{"index": 0, "id": "call_a", "function": {"name": "shell", "arguments": ""}}]})
    for fragment in ('{"cmd": ', '["ls"]}'):
        raw += p.feed({"tool_calls": [{"index": 0, "function": {"arguments": fragment}}]})
    c = collector()
    c.feed(TokenEvent([], "stop"))
    seq = events(raw + p.tail([c], 7))
    added = [e["item"]["type"] for e in seq if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call"]
    assert [e["type"] for e in seq if "delta" in e["type"]] == [
        "response.reasoning_text.delta", "response.output_text.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta"]
    done = [e for e in seq if e["type"] == "response.function_call_arguments.done"]
    assert json.loads(done[0]["arguments"]) == {"cmd": ["ls"]}
    assert [e["sequence_number"] for e in seq] == list(range(len(seq)))
    final = seq[-1]["response"]
    assert seq[-1]["type"] == "response.completed"
    call = final["output"][2]
    assert (call["type"], call["call_id"], call["name"], call["status"]) == (
        "function_call", "call_a", "shell", "completed")
    assert final["output"][1]["content"][0]["text"] == "Running it."
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "Think."}]


def test_a_stream_s_error_event_and_failed_response_name_the_same_fields() -> None:
    from common.errors import ContextLengthExceeded

    exc = ContextLengthExceeded("the request has 5 prompt tokens and max_tokens 80", param="max_tokens")
    seq = events(ResponsesPresenter("resp_1", {}).error(exc))
    error = next(e for e in seq if e["type"] == "error")
    failed = next(e for e in seq if e["type"] == "response.failed")["response"]["error"]
    assert error["param"] == "max_output_tokens" and "max_output_tokens 80" in error["message"]
    assert failed["message"] == error["message"]
