"""A client that goes away frees its work, whether it was queued or running."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

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


def test_disconnected_non_streaming_request_is_cancelled(router: Router) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(router.url + "/v1/completions", json=LONG, timeout=1.5)
    wait_until(lambda: running(router) == 0, 10, "the cancelled request to leave the worker")


def test_queued_request_that_leaves_never_reaches_the_worker(fresh_router: Callable[..., Router]) -> None:
    # A keepalive each second (default 5 s): the queued stream's first comment comes sooner.
    router = fresh_router("--max-running-requests", "1", "--sse-keepalive", "1")
    with httpx.Client(base_url=router.url, timeout=30) as first, \
            httpx.Client(base_url=router.url, timeout=30) as second:
        with first.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as running_resp:
            # Keep the iterator referenced: a collected httpx line iterator closes the stream.
            running_lines = running_resp.iter_lines()
            next(running_lines)
            wait_until(lambda: running(router) == 1, 10, "the first request to run")
            dispatched = metric(router, "headroom_dispatched_requests_total")
            body = {**LONG, "stream": True, "max_tokens": 5}
            with second.stream("POST", "/v1/completions", json=body) as queued:
                assert router.health()["queued"] == 1
                # While it waits, the stream sends SSE comments so a dead client is noticed.
                queued_lines = queued.iter_lines()
                comment = next(line for line, _ in zip(queued_lines, range(5)) if line)
                assert comment == ": keepalive"
            wait_until(lambda: router.health().get("queued") == 0, 10, "the queued request to leave")
            assert metric(router, "headroom_cancelled_requests_total", 'where="queued"') == 1
        wait_until(lambda: running(router) == 0, 10, "the first request to be cancelled")
    assert metric(router, "headroom_dispatched_requests_total") == dispatched
    ok = router.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and json.loads(ok.text)["usage"]["completion_tokens"] == 3
