"""A stream refused before its first token gets the HTTP status and JSON body a request
that does not stream gets, in its own API's error shape, however long it waited queued
(router/http/sse.py holds the headers until the first token or the refusal)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx

from tests.conftest import wait_until
from tests.integration.conftest import Router
from tests.integration.test_memory_limit import LIMIT, WORKLOAD_TIMEOUT_S

KEEPALIVE_S = 0.05
QUESTION = [{"role": "user", "content": "Tell me a story."}]


def refused_bodies(max_tokens: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """One request per API, each asking for ``max_tokens`` after a short prompt."""
    return {
        "chat": ("/v1/chat/completions", {"messages": QUESTION, "max_tokens": max_tokens, "stream": True}),
        "chat, not streamed": ("/v1/chat/completions", {"messages": QUESTION, "max_tokens": max_tokens}),
        "messages": ("/v1/messages", {"model": "m", "messages": QUESTION, "max_tokens": max_tokens,
                                      "stream": True}),
        "responses": ("/v1/responses", {"model": "m", "input": QUESTION[0]["content"],
                                        "max_output_tokens": max_tokens, "stream": True}),
    }


def test_streams_refused_while_queued_after_the_model_grows_get_a_400(
        fresh_router: Callable[..., Router]) -> None:
    """Queued past many keepalive periods, then refused by the re-check after the worker's
    cost model grows (the SIGUSR1 test hook): a 400 with the JSON body, never a 200 stream
    that ends in an error event."""
    router = fresh_router(*LIMIT, "--max-running-requests", "1", "--worker-arg=--test-grow-scale=4",
                          "--sse-keepalive", str(KEEPALIVE_S))
    pid = router.worker()["pid"]
    most = router.memory()["workers"][0]["max_request_tokens"]
    bodies = refused_bodies(most * 6 // 10)  # fits an idle worker now, not once the model grows x4
    with httpx.Client(base_url=router.url, timeout=WORKLOAD_TIMEOUT_S) as http, \
            concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool, \
            http.stream("POST", "/v1/completions", json={
                "prompt": [5] * 8, "max_tokens": most - 16, "ignore_eos": True, "stream": True}) as running:
        assert running.status_code == 200
        futures = {name: pool.submit(http.post, path, json=body) for name, (path, body) in bodies.items()}
        wait_until(lambda: router.memory()["queued"] == len(bodies), 30,
                   "every request queued behind the running one", on_fail=router.log)
        # What is under test is time spent queued: each stream's keepalive timer must fire
        # many times before the refusal (it used to start a 200 stream on its first tick).
        queued_at = time.monotonic()
        wait_until(lambda: time.monotonic() - queued_at > 10 * KEEPALIVE_S, 5, "ten keepalive periods")
        assert not any(f.done() for f in futures.values())
        os.kill(pid, signal.SIGUSR1)
        answers = {name: f.result(timeout=30) for name, f in futures.items()}  # not the queue timeout

    for name, answer in answers.items():
        assert answer.status_code == 400, (name, answer.headers, answer.text)
        assert answer.headers["content-type"].startswith("application/json"), (name, answer.text)
    plain = answers["chat, not streamed"].json()
    assert plain["error"]["code"] == "insufficient_memory"
    assert plain["error"]["max_request_tokens"] < most * 6 // 10
    assert answers["chat"].json() == plain
    # The Responses API errors in OpenAI's shape, naming its own field
    responses_error = answers["responses"].json()["error"]
    assert responses_error["param"] == "max_output_tokens"
    assert responses_error["message"] == plain["error"]["message"].replace("max_tokens", "max_output_tokens")
    assert {k: v for k, v in responses_error.items() if k not in ("param", "message")} == \
        {k: v for k, v in plain["error"].items() if k not in ("param", "message")}
    anthropic_error = answers["messages"].json()
    assert anthropic_error["type"] == "error"
    assert anthropic_error["error"]["type"] == "invalid_request_error"
    assert plain["error"]["message"] in anthropic_error["error"]["message"]
    assert router.worker()["pid"] == pid


LONG_ARGUMENT = {"type": "object", "properties": {"text": {"type": "string", "minLength": 120, "maxLength": 120}},
                 "required": ["text"], "additionalProperties": False}


def test_a_tool_call_being_written_sends_keepalives(fresh_router: Callable[..., Router]) -> None:
    """The call's tokens flow all along but show nothing until it is whole: the stream's
    keepalive is timed from its last write, so a proxy counting idle bytes sees some (it
    was timed from the last token: none came in 15 s of a call on the demo model)."""
    router = fresh_router("--sse-keepalive", str(KEEPALIVE_S))
    tool = {"type": "function", "function": {"name": "write", "parameters": LONG_ARGUMENT}}
    body = {"model": "m", "messages": QUESTION, "tools": [tool], "tool_choice": "required",
            "parallel_tool_calls": False, "max_tokens": 400, "stream": True}
    with router.http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    calls = [i for i, line in enumerate(lines) if '"tool_calls"' in line]
    assert calls, lines[-5:]
    # Between the role chunk and the call: the 120-character argument took well over 100
    # tokens, written at 20 keepalive periods a second
    assert ": keepalive" in lines[:calls[0]]
    assert lines[-1] == "data: [DONE]"
