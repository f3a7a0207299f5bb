"""A client that goes away frees its work, whether it was queued or running."""

from __future__ import annotations

import json
import random
import re
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.conftest import wait_until
from tests.integration.conftest import Router

LONG = {"prompt": "Tell me everything.", "max_tokens": 3000, "ignore_eos": True, "temperature": 0}


def metric(router: Router, name: str, labels: str = "") -> float:
    text = router.http.get("/metrics").text
    pattern = re.escape(name) + (re.escape("{" + labels + "}") if labels else "") + r" ([0-9.e+]+)"
    match = re.search(r"^" + pattern + r"$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def running(router: Router) -> int:
    workers = router.memory()["workers"]
    return int(workers[0]["running"]) if workers else -1


def test_disconnected_stream_frees_its_row(router: Router) -> None:
    before = metric(router, "headroom_cancelled_requests_total", 'where="running"')
    closed = metric(router, "headroom_requests_total", 'endpoint="completions",status="499"')
    failed = metric(router, "headroom_requests_total", 'endpoint="completions",status="500"')
    with httpx.Client(base_url=router.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            data = [line for line, _ in zip(lines, range(40)) if line.startswith("data: ")]
            assert data, "no tokens streamed"
            assert running(router) == 1
    # The client hung up after a few tokens of 3000: its row must leave the generator.
    wait_until(lambda: running(router) == 0, 10, "the worker's running count to drop to 0")
    assert metric(router, "headroom_cancelled_requests_total", 'where="running"') == before + 1
    # Counted as nginx's 499 "client closed request", never as a server error
    wait_until(lambda: metric(router, "headroom_requests_total", 'endpoint="completions",status="499"')
               == closed + 1, 10, "the request counted as 499")
    assert metric(router, "headroom_requests_total", 'endpoint="completions",status="500"') == failed


def test_disconnected_non_streaming_request_is_cancelled(router: Router) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(router.url + "/v1/completions", json=LONG, timeout=1.5)
    wait_until(lambda: running(router) == 0, 10, "the cancelled request to leave the worker")


def post_raw(router: Router, path: str, body: dict[str, Any]) -> socket.socket:
    """Send a request without waiting for its answer: a queued stream's headers wait for its
    first token, so an HTTP client would block on them."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", router.port), timeout=10)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_queued_request_that_leaves_never_reaches_the_worker(fresh_router: Callable[..., Router]) -> None:
    # Keepalive ticks every 50 ms (default 5 s): the queued stream's timer checks its client often.
    router = fresh_router("--max-running-requests", "1", "--sse-keepalive", "0.05")
    with httpx.Client(base_url=router.url, timeout=30) as first:
        with first.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as running_resp:
            # Keep the iterator referenced: a collected httpx line iterator closes the stream.
            running_lines = running_resp.iter_lines()
            next(running_lines)
            wait_until(lambda: running(router) == 1, 10, "the first request to run")
            dispatched = metric(router, "headroom_dispatched_requests_total")
            queued = post_raw(router, "/v1/completions", {**LONG, "stream": True, "max_tokens": 5})
            with queued:
                wait_until(lambda: router.health().get("queued") == 1, 10, "the second request to queue")
                # What is under test is time spent queued: many keepalive ticks go by, and
                # none of them writes (the headers wait for a first token or a refusal).
                queued_at = time.monotonic()
                wait_until(lambda: time.monotonic() - queued_at > 0.5, 5, "ten keepalive periods")
                queued.setblocking(False)
                with pytest.raises(BlockingIOError):
                    queued.recv(1)
            wait_until(lambda: router.health().get("queued") == 0, 10, "the queued request to leave")
            assert metric(router, "headroom_cancelled_requests_total", 'where="queued"') == 1
        wait_until(lambda: running(router) == 0, 10, "the first request to be cancelled")
    assert metric(router, "headroom_dispatched_requests_total") == dispatched
    ok = router.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and json.loads(ok.text)["usage"]["completion_tokens"] == 3


def test_a_client_gone_while_its_answer_is_prepared_frees_its_rows_and_its_id(router: Router) -> None:
    """Echo with logprobs over 2,048 prompt tokens: the router works out the echoed text's
    token offsets on its thread pool once the rows are queued. A client gone during that
    await (its handler cancelled) once left its row running with no one to cancel it, and
    its request id free: a later request with that id then collided with the row."""
    rng = random.Random(7)
    body = json.dumps({"prompt": [rng.randrange(3, 500) for _ in range(2100)], "echo": True,
                       "logprobs": 1, "max_tokens": 50, "ignore_eos": True}).encode()
    for attempt in range(8):
        with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Request-Id: gone-early\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(attempt / 1000)  # gone 0-7 ms after sending: across that await
        # A row left running would prefill and decode for tens of seconds here.
        wait_until(lambda: running(router) == 0 and router.health().get("queued") == 0, 10,
                   f"attempt {attempt}'s row to be cancelled", on_fail=router.log)
    ok = router.http.post("/v1/completions", headers={"X-Request-Id": "gone-early"},
                          json={"prompt": "hello", "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200, ok.text
