"""One request's own failure ends that request alone (DESIGN's failure model).

A real worker runs with a test double (``faulty_worker.py``) that makes one marked row's
grammar matcher or sampler raise inside the engine step. Seven greedy streams run
together: the marked one gets its error (``request_failed``), the six others produce
exactly the tokens they produce alone, and the worker keeps its pid: no restart.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.integration.conftest import NO_EOS, Proc, Router, isolated_env
from tests.integration.faulty_worker import POISON, POISON_SEED, POISON_TOKEN

PROMPTS = [f"containment {i}: " + "a b c " * i for i in range(6)]
MAX_TOKENS = 24
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
          "required": ["name"], "additionalProperties": False}
POISONED = {"type": "object", "properties": {POISON: {"type": "string", "maxLength": 8}},
            "required": [POISON], "additionalProperties": False}
READY_S = 90.0
STREAM_S = 120.0


def start(tmp_path: Path, cache_home: Path, kind: str, *extra: str) -> tuple[Router, Proc]:
    router = Router(tmp_path, cache_home, "--worker-mode", "external", *extra)
    argv = [sys.executable, "-m", "tests.integration.faulty_worker", kind, "--model", "demo",
            "--router", router.addr]
    worker = Proc(argv, isolated_env(cache_home, tmp_path), tmp_path / "worker.log")
    try:
        router.wait_ready(READY_S)
    except BaseException:
        print(worker.log())
        worker.stop()
        router.stop()
        raise
    return router, worker


@pytest.fixture(params=["grammar", "sampler", "sampler_start"])
def served(request: pytest.FixtureRequest, tmp_path: Path, cache_home: Path) -> Iterator[tuple[str, Router, Proc]]:
    router, worker = start(tmp_path, cache_home, request.param)
    yield request.param, router, worker
    router.stop()
    worker.stop()


def streamed_text(client: openai.OpenAI, prompt: str) -> str:
    chunks = client.completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, extra_body=NO_EOS)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def poisoned_request(kind: str, client: openai.OpenAI) -> Callable[[], Any]:
    if kind == "grammar":
        fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": POISONED}}
        return lambda: "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "poison"}], max_tokens=MAX_TOKENS,
            temperature=0, response_format=fmt, stream=True) if c.choices)  # type: ignore[arg-type]
    return lambda: streamed_text_sampled(client)


def streamed_text_sampled(client: openai.OpenAI) -> str:
    chunks = client.completions.create(model="m", prompt="poison", max_tokens=MAX_TOKENS, temperature=1.0,
                                       seed=POISON_SEED, stream=True, extra_body=NO_EOS)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_a_failing_row_ends_alone(served: tuple[str, Router, Proc]) -> None:
    kind, router, worker = served
    client = router.client()
    alone = [streamed_text(client, p) for p in PROMPTS]
    start = threading.Barrier(len(PROMPTS) + 1)

    def run(job: Callable[[], Any]) -> Any:
        start.wait(timeout=30)
        try:
            return job()
        except openai.APIError as exc:
            return exc

    jobs = [lambda p=p: streamed_text(client, p) for p in PROMPTS] + [poisoned_request(kind, client)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = [f.result(timeout=STREAM_S) for f in [pool.submit(run, j) for j in jobs]]

    *together, failed = results
    assert together == alone, "a row beside the failing one changed its tokens"
    assert isinstance(failed, openai.APIError), f"the poisoned request did not fail: {failed!r}"
    body = failed.body if isinstance(failed.body, dict) else {}
    error = body.get("error", body)
    assert error.get("code") == "request_failed", failed.body
    assert "injected fault" in error.get("message", ""), failed.body
    if kind != "grammar":  # it failed before any token: a plain HTTP 500, not a stream
        assert isinstance(failed, openai.InternalServerError)
    # The worker never restarted: same process, still ready, and grammars still work.
    assert worker.popen.poll() is None, worker.log()
    health = router.health()
    assert health["status"] == "ok" and router.worker()["pid"] == worker.pid
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=60, temperature=0, response_format=fmt)  # type: ignore[arg-type]
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), PERSON)
    assert router.worker()["pid"] == worker.pid


@pytest.fixture
def skewed(tmp_path: Path, cache_home: Path) -> Iterator[tuple[Router, Proc]]:
    router, worker = start(tmp_path, cache_home, "llguidance")
    yield router, worker
    router.stop()
    worker.stop()


def test_a_grammar_the_worker_cannot_build_is_a_400_before_any_step(skewed: tuple[Router, Proc]) -> None:
    """The router's llguidance accepts the grammar, the worker's cannot build it (version
    skew): a 400 naming the parameter, streamed or not, and the worker serves on."""
    router, worker = skewed
    client = router.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=msgs, max_tokens=20, response_format=fmt)  # type: ignore[arg-type]
    assert info.value.body["code"] == "invalid_request" and info.value.body["param"] == "response_format"  # type: ignore[index]
    assert "eos_token" in info.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        list(client.chat.completions.create(model="m", messages=msgs, max_tokens=20, response_format=fmt,  # type: ignore[arg-type]
                                            stream=True))
    assert info.value.body["param"] == "response_format"  # type: ignore[index]
    tool = {"type": "function", "function": {"name": "f", "parameters": PERSON}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=msgs, max_tokens=20, tools=[tool],  # type: ignore[list-item]
                                       tool_choice="required")
    assert info.value.body["param"] == "tools"  # type: ignore[index]
    assert streamed_text(client, PROMPTS[0])  # a request without a grammar runs as ever
    assert worker.popen.poll() is None and router.worker()["pid"] == worker.pid


def test_a_failure_in_the_loop_outside_a_step_exits_as_an_engine_error_with_its_cause(
        tmp_path: Path, cache_home: Path) -> None:
    """Not a row's failure (those end alone, above) but a bug in the worker's own loop: the
    worker logs its traceback and exits ENGINE_ERROR at once (a supervisor restarts it),
    without the interpreter's teardown, which could end it by SIGSEGV and lose the cause."""
    from common.protocol import ExitCode

    # The request then waits in the router's queue for a worker (this one is external:
    # nobody restarts it): sent on a bare socket, it is left to the router's short drain.
    router, worker = start(tmp_path, cache_home, "loop", "--drain-timeout", "1")
    body = json.dumps({"prompt": [POISON_TOKEN, 5, 6], "max_tokens": 4}).encode()
    try:
        with socket.create_connection(("127.0.0.1", router.port), timeout=READY_S) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (router.port, len(body), body))
            assert worker.popen.wait(timeout=READY_S) == ExitCode.ENGINE_ERROR, worker.log()
        log = worker.log()
        assert "the worker's loop failed" in log and "injected fault in the worker's loop" in log, log
    finally:
        router.stop()
        worker.stop()
