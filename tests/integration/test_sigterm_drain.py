"""SIGTERM: stop accepting, let in-flight streams finish within the drain timeout, exit 0."""

from __future__ import annotations

import signal
from collections.abc import Callable

import httpx

from tests.conftest import process_gone, wait_until
from tests.integration.conftest import Router


def test_sigterm_lets_the_stream_finish_and_exits_zero(fresh_router: Callable[..., Router]) -> None:
    router = fresh_router("--drain-timeout", "30")
    worker_pid = router.worker()["pid"]
    stream = router.client().completions.create(model="m", prompt="drain me", max_tokens=300,
                                                stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    text = [next(chunks).choices[0].text]
    router.popen.send_signal(signal.SIGTERM)
    # New requests are refused while draining.
    wait_until(lambda: router.health().get("status") == "draining", 10, "the router to drain")
    refused = router.http.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_worker"
    finish = None
    for chunk in chunks:
        if chunk.choices:
            text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "length"
    assert router.popen.wait(40) == 0
    # The worker it spawned is stopped with it.
    wait_until(lambda: process_gone(worker_pid), 15, "the spawned worker to exit")
    try:
        httpx.get(router.url + "/health", timeout=2)
        raise AssertionError("the router should no longer listen")
    except httpx.HTTPError:
        pass



def test_past_the_drain_timeout_a_stream_ends_with_an_error_and_the_router_exits(
        fresh_router: Callable[..., Router]) -> None:
    """A stream that outlives --drain-timeout is answered: an error event, then the stream's
    end, and the router exits. It once waited on for aiohttp's own minute (and more), past
    the service manager's stop timeout, which kills the router mid-stream."""
    import json

    router = fresh_router("--drain-timeout", "1")
    with httpx.Client(base_url=router.url, timeout=60) as client, \
            client.stream("POST", "/v1/completions", json={"prompt": "never done", "max_tokens": 3000,
                                                           "stream": True, "ignore_eos": True}) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        router.popen.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data: "):])["error"]
    assert error["code"] == "no_worker" and "shutting down" in error["message"]
    assert router.popen.wait(30) == 0
