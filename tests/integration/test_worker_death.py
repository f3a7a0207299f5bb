"""A worker that dies or hangs mid-stream: the router stays up, answers cleanly, restarts it."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from router.fleet.link import HEARTBEAT_TIMEOUT_S
from tests.conftest import process_gone, wait_until
from tests.integration.conftest import NO_EOS, Router, start_router

# Generous ceilings: restarts include an mlx import and a model load on 2 slow cores.
RESTART_TIMEOUT_S = 60.0
STREAM_END_S = 10.0
# The wedged worker's router judges a frozen step counter after this (default 10 s): the
# same verdict, sooner (a slow step still raises it: 5x the worker's slowest).
STALL_S = 3.0


@pytest.fixture(scope="module")
def survivor(tmp_path_factory: pytest.TempPathFactory, cache_home: Path) -> Iterator[Router]:
    """One router whose worker the kill tests take down in turn, each waiting for the
    restart it caused (a router start saved per test). Each streams its own prompt: one
    prompt running at two deaths is quarantined, rightly."""
    r = start_router(tmp_path_factory.mktemp("survivor"), cache_home)
    yield r
    r.stop()


def open_stream(router: Router, max_tokens: int = 3000, prompt: str = "Keep talking.",
                first_chunks: int = 5) -> Any:
    stream = router.client().completions.create(
        model="m", prompt=prompt, max_tokens=max_tokens, stream=True,
        extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(first_chunks):
        next(chunks)
    return chunks


def drain_expecting_error(chunks: Any, within_s: float) -> openai.APIError:
    started = time.monotonic()
    with pytest.raises(openai.APIError) as info:
        for _ in chunks:
            pass
    assert time.monotonic() - started < within_s, "the stream must end promptly, not hang"
    return info.value


def wait_restarted(router: Router, old_pid: int) -> dict[str, Any]:
    def restarted() -> dict[str, Any] | None:
        w = router.worker()
        return w if w.get("state") == "ready" and w.get("pid") != old_pid else None

    return wait_until(restarted, RESTART_TIMEOUT_S, "the worker to be restarted and ready",
                      on_fail=router.log)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGABRT])
def test_stream_ends_with_error_and_worker_restarts(survivor: Router, sig: signal.Signals) -> None:
    router = survivor
    first = router.worker()
    chunks = open_stream(router, prompt=f"Keep talking until {sig.name}.")
    os.kill(first["pid"], sig)
    error = drain_expecting_error(chunks, STREAM_END_S)
    assert "worker" in str(error.message)
    assert router.popen.poll() is None, "the router must survive its worker"
    worker = wait_restarted(router, first["pid"])
    assert worker["restarts"] == first["restarts"] + 1
    assert worker["last_exit"]["signal"] == sig.name
    r = router.client().completions.create(model="m", prompt="Back?", max_tokens=4, extra_body=NO_EOS)
    assert r.usage is not None and r.usage.completion_tokens == 4


def test_a_lost_worker_ends_messages_and_responses_streams_in_their_own_shapes(
        fresh_router: Callable[..., Router]) -> None:
    """Claude Code and Codex see a worker's death as their API's own retryable error, not a
    cut connection: an Anthropic ``error`` event (overloaded_error), and a Responses
    ``error`` event then ``response.failed`` carrying the code. Its own router: two more
    deaths on the shared one would make its supervisor give up (deaths in a window)."""
    router = fresh_router()
    pid = router.worker()["pid"]
    messages = [{"role": "user", "content": "Keep talking until the Messages stream dies."}]
    with anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0, timeout=60.0) as claude:
        events = iter(claude.messages.create(model="claude-sonnet-4-5", max_tokens=3000, messages=messages,
                                             stream=True, extra_body={"temperature": 0, "ignore_eos": True}))  # type: ignore[arg-type]
        assert [next(events).type for _ in range(3)][0] == "message_start"
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(anthropic.APIStatusError) as info:
            for _ in events:
                assert time.monotonic() - started < STREAM_END_S, "the stream did not end"
    assert info.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    assert "worker" in info.value.body["error"]["message"]  # type: ignore[index]
    pid = wait_restarted(router, pid)["pid"]

    stream = router.client().responses.create(
        model="gpt-5-codex", input="Keep talking until the Responses stream dies.", max_output_tokens=3000,
        temperature=0, stream=True, store=False, extra_body={"ignore_eos": True})
    events = iter(stream)
    assert [next(events).type for _ in range(3)][0] == "response.created"
    os.kill(pid, signal.SIGKILL)
    started, tail = time.monotonic(), []
    for event in events:
        tail.append(event)
        assert time.monotonic() - started < STREAM_END_S, "the stream did not end"
    kinds = [e.type for e in tail]
    assert kinds[-2:] == ["error", "response.failed"], kinds[-5:]
    failed = tail[-1].response  # type: ignore[union-attr]
    assert failed.status == "failed" and failed.error is not None and failed.error.code == "worker_lost"
    wait_restarted(router, pid)


def test_queued_requests_survive_a_worker_death(fresh_router: Callable[..., Router]) -> None:
    router = fresh_router("--max-running-requests", "1")
    pid = router.worker()["pid"]
    chunks = open_stream(router)
    client = router.client()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        queued = [pool.submit(client.completions.create, model="m", prompt=f"queued {i}",
                              max_tokens=6, extra_body=NO_EOS) for i in range(3)]
        wait_until(lambda: router.health().get("queued") == 3, 10, "three queued requests")
        os.kill(pid, signal.SIGKILL)
        drain_expecting_error(chunks, STREAM_END_S)
        results = [f.result(timeout=RESTART_TIMEOUT_S) for f in queued]
    assert [r.usage.completion_tokens for r in results] == [6, 6, 6]


def test_stopped_worker_is_detected_by_heartbeat_and_replaced(survivor: Router) -> None:
    router = survivor
    first = router.worker()
    pid = first["pid"]
    chunks = open_stream(router, prompt="Keep talking until stopped.")
    os.kill(pid, signal.SIGSTOP)
    drain_expecting_error(chunks, HEARTBEAT_TIMEOUT_S + STREAM_END_S)
    worker = wait_restarted(router, pid)
    assert worker["restarts"] == first["restarts"] + 1
    assert worker["last_exit"]["signal"] == "SIGKILL"
    assert "silent" in worker["last_exit"]["reason"] or any(
        "silent" in line for line in worker["last_exit"]["stderr_tail"])
    assert router.client().completions.create(model="m", prompt="ok", max_tokens=3, extra_body=NO_EOS).usage.completion_tokens == 3


def test_wedged_engine_loop_is_detected_and_replaced(fresh_router: Callable[..., Router]) -> None:
    # The hidden test flag wedges the engine loop while its heartbeat thread keeps beating:
    # only the step counter shows that it is stuck.
    router = fresh_router("--worker-arg=--test-wedge-after-steps=60", "--stall-timeout", str(STALL_S))
    pid = router.worker()["pid"]
    # One chunk shows the stream started: a client slowed by a busy machine may find the
    # tokens before the wedge coalesced into fewer chunks than that, then the error.
    chunks = open_stream(router, first_chunks=1)
    drain_expecting_error(chunks, STALL_S + STREAM_END_S)
    worker = wait_restarted(router, pid)
    assert any("wedged" in line for line in worker["last_exit"]["stderr_tail"])
    assert router.client().completions.create(model="m", prompt="ok", max_tokens=3, extra_body=NO_EOS).usage.completion_tokens == 3


def test_spawned_worker_and_its_standby_exit_when_their_router_dies(
        fresh_router: Callable[..., Router]) -> None:
    router = fresh_router("--standby-delay", "0")
    pid = router.worker()["pid"]
    standby = wait_until(lambda: router.worker().get("standby_pid"), 30, "a standby worker",
                         on_fail=router.log)
    os.kill(router.pid, signal.SIGKILL)

    wait_until(lambda: process_gone(pid), 15, "the orphaned worker to exit")
    wait_until(lambda: process_gone(standby), 15, "the orphaned standby to exit")

