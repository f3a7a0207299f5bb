"""Fuzzed to the frame: arbitrary JSON and bytes at every POST endpoint, a schema-driven run
against /openapi.json, and arbitrary bytes and msgpack into the router's worker socket and
into a worker's. Nothing may answer 5xx, contradict the spec, or kill a process.

Examples are bounded (a few dozen per target) and share one router, so this stays fast.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from common.errors import ProtocolError
from common.protocol import (
    MESSAGE_TYPES, Generate, Hello, SamplingParams, Status, Tokens, decode, encode,
)
from router.http.openapi import ENDPOINTS
from tests.conftest import wait_until
from tests.integration.conftest import Proc, Router, isolated_env, start_router
from tests.integration.test_stream_cancel import metric

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
POSTS = [e.path for e in ENDPOINTS if e.method == "post" and e.path.startswith("/v1/")]
# Derandomized: the same examples every run, so a failure is a regression, never luck.
FUZZ = settings(max_examples=40, deadline=None, database=None, phases=[Phase.generate],
                derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "seed", "stop", "stream", "stream_options", "n", "ignore_eos", "tools",
          "response_format", "logprobs", "role", "content", "type", "text", "include_usage"]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory, cache_home: Path) -> Iterator[Router]:
    r = start_router(tmp_path_factory.mktemp("fuzz"), cache_home, "--api-key", KEY,
                     "--max-tokens-limit", "8", "--default-max-tokens", "8",
                     "--request-timeout", "10")
    r.http.headers.update(AUTH)
    yield r
    r.stop()


def json_values(leaves: int = 12) -> st.SearchStrategy[Any]:
    scalars = (st.none() | st.booleans() | st.integers() | st.integers(-2**70, 2**70)
               | st.floats() | st.text(max_size=20) | st.sampled_from(["user", "assistant", "text"]))
    keys = st.sampled_from(FIELDS) | st.text(max_size=8)
    return st.recursive(scalars, lambda c: st.lists(c, max_size=5) | st.dictionaries(keys, c, max_size=6),
                        max_leaves=leaves)


def bodies() -> st.SearchStrategy[Any]:
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool", "x"])},
                                    optional={"content": json_values(4)})
    shaped = st.fixed_dictionaries(
        {}, optional={"messages": st.lists(message, max_size=3) | json_values(4),
                      "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 600), max_size=5)
                      | json_values(4),
                      "max_tokens": st.integers(-2, 10) | json_values(2),
                      "stream": st.booleans() | json_values(2), "stop": json_values(3),
                      "temperature": st.floats() | json_values(2), "seed": st.integers()})
    return shaped | json_values()


def alive_and_serving(router: Router, pid: int) -> None:
    assert router.popen.poll() is None, router.log()
    assert router.worker()["pid"] == pid and router.worker()["restarts"] == 0
    with router.client(api_key=KEY) as client:
        # ignore_eos: random weights sample an EOS first now and then (0 tokens, a flake)
        r = client.completions.create(model="m", prompt="ok", max_tokens=2, extra_body={"ignore_eos": True})
    assert r.usage is not None and r.usage.completion_tokens == 2


def assert_error_shape(path: str, body: Any) -> None:
    """Each API answers in its own error shape: Anthropic's under /v1/messages."""
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) >= {"type", "message"}
    else:
        assert set(body["error"]) >= {"message", "type", "param", "code"}


@pytest.mark.parametrize("path", POSTS)
def test_arbitrary_json_and_bytes_never_5xx(target: Router, path: str) -> None:
    pid = target.worker()["pid"]

    @FUZZ
    @given(body=bodies())
    def json_body(body: Any) -> None:
        text = json.dumps(body, allow_nan=True)
        r = target.http.post(path, content=text, headers={"Content-Type": "application/json"})
        assert r.status_code < 500, (text, r.text)
        if r.status_code >= 400:
            assert_error_shape(path, r.json())

    @FUZZ
    @given(raw=st.binary(max_size=200) | st.text(max_size=100).map(str.encode))
    def raw_body(raw: bytes) -> None:
        r = target.http.post(path, content=raw)
        assert r.status_code < 500, (raw, r.text)

    json_body()
    raw_body()
    alive_and_serving(target, pid)


def test_admin_restart_without_the_key_is_401_whatever_the_body(target: Router) -> None:
    @settings(FUZZ, max_examples=20)
    @given(raw=st.binary(max_size=100))
    def post(raw: bytes) -> None:
        with httpx.Client(base_url=target.url, timeout=30) as client:
            assert client.post("/admin/workers/restart", content=raw).status_code == 401

    post()


def test_schema_driven_run_finds_no_5xx_and_no_contradiction(target: Router) -> None:
    import schemathesis
    from schemathesis.checks import not_a_server_error
    from schemathesis.generation import GenerationMode
    from schemathesis.specs.openapi.checks import (
        content_type_conformance, response_schema_conformance, status_code_conformance,
    )

    pid = target.worker()["pid"]
    spec = target.http.get("/openapi.json").json()
    schema = schemathesis.openapi.from_dict(spec).exclude(path="/admin/workers/restart")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance]
    operations = [op.ok() for op in schema.get_all_operations()]
    assert len(operations) == len(ENDPOINTS) - 1
    for op in operations:
        # An operation without inputs has no invalid form to generate.
        modes = [GenerationMode.POSITIVE] + [GenerationMode.NEGATIVE] * (op.method.lower() == "post")
        for mode in modes:
            @settings(FUZZ, max_examples=15)
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case: Any) -> None:
                case.call_and_validate(base_url=target.url, headers=AUTH, checks=checks)

            run()
    alive_and_serving(target, pid)


# -- the worker link ------------------------------------------------------------------------

MSGPACK_INTS = st.integers(-2**63, 2**64 - 1)  # what msgpack can encode


def msgpack_values() -> st.SearchStrategy[Any]:
    scalars = (st.none() | st.booleans() | MSGPACK_INTS | st.floats()
               | st.text(max_size=10) | st.binary(max_size=10))
    return st.recursive(scalars, lambda c: st.lists(c, max_size=4)
                        | st.dictionaries(st.text(max_size=6) | st.integers(0, 9), c, max_size=4),
                        max_leaves=10)


def frames() -> st.SearchStrategy[bytes]:
    """Garbage, any msgpack, and maps shaped like messages (any type but hello: a well-formed
    hello is a worker introducing itself, the CURVE test's subject)."""
    names = sorted(set(MESSAGE_TYPES) - {"hello"})
    fields = sorted({f.name for cls in MESSAGE_TYPES.values() for f in dataclasses.fields(cls)})
    shaped = st.fixed_dictionaries(
        {"v": st.just(1) | MSGPACK_INTS, "type": st.sampled_from(names) | st.text(max_size=5)},
        optional={f: msgpack_values() for f in fields})
    packed = (msgpack_values() | shaped).map(lambda v: msgpack.packb(v, use_bin_type=True))
    return st.binary(max_size=300) | packed


def is_bad(frame: bytes) -> bool:
    try:
        decode(frame)
    except ProtocolError:
        return True
    return False


def test_default_max_tokens_bounds_a_request_that_names_none(target: Router) -> None:
    """(Not fuzz: this router's --default-max-tokens 8, reused.) A request without
    max_tokens or max_output_tokens gets the room left, at most the flag's number."""
    chat = target.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] == 8
    assert chat.json()["choices"][0]["finish_reason"] == "length"
    response = target.http.post("/v1/responses", json={"input": "hi", "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["output_tokens"] == 8 and response.json()["status"] == "incomplete"


def test_arbitrary_frames_into_the_routers_worker_socket(target: Router) -> None:
    pid = target.worker()["pid"]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(target.addr)
    try:
        @settings(FUZZ, max_examples=15)
        @given(batch=st.lists(frames(), min_size=1, max_size=20))
        def send(batch: list[bytes]) -> None:
            before = metric(target, "headroom_bad_frames_total")
            for frame in batch:
                sock.send(frame)
            bad = sum(map(is_bad, batch))
            wait_until(lambda: metric(target, "headroom_bad_frames_total") >= before + bad, 10,
                       f"{bad} bad frames to be counted", on_fail=target.log)

        send()
        # Several frames in one message (a ROUTER sees [identity, *frames]) are dropped too.
        before = metric(target, "headroom_bad_frames_total")
        sock.send_multipart([b"a", b"b", b"c"])
        wait_until(lambda: metric(target, "headroom_bad_frames_total") > before, 10, "multipart drop")
    finally:
        sock.close(0)
        ctx.term()
    alive_and_serving(target, pid)


def test_arbitrary_frames_into_a_worker(tmp_path: Path, cache_home: Path) -> None:
    """A stand-in router: the worker connects, says hello, takes garbage, still serves."""
    addr = f"ipc://{tmp_path}/fake.sock"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(addr)
    worker = Proc([sys.executable, "-m", "worker", "--model", "demo", "--router", addr],
                  isolated_env(cache_home, tmp_path), tmp_path / "worker.log")
    try:
        identity, hello = receive(router, Hello, worker)
        sent_bad = 0

        @settings(FUZZ, max_examples=15)
        @given(batch=st.lists(frames(), min_size=1, max_size=20))
        def send(batch: list[bytes]) -> None:
            nonlocal sent_bad
            for frame in batch:
                router.send_multipart([identity, frame])
            sent_bad += sum(map(is_bad, batch))

        send()
        router.send_multipart([identity, encode(Generate(
            incarnation=hello.incarnation, request_id="after-fuzz", prompt_ids=[5, 6, 7],
            max_tokens=3, sampling=SamplingParams(ignore_eos=True)))])
        wait_until(lambda: finished(router, worker, "after-fuzz"), 60, "the worker to serve",
                   on_fail=worker.log)
        wait_until(lambda: reported_bad(router) >= sent_bad, 30, f"{sent_bad} bad frames counted",
                   on_fail=worker.log)
        assert worker.popen.poll() is None
    finally:
        worker.stop()
        router.close(0)
        ctx.term()


def receive(sock: zmq.Socket, kind: type, proc: Proc, timeout_s: float = 90.0) -> tuple[bytes, Any]:
    def one() -> tuple[bytes, Any] | None:
        if proc.popen.poll() is not None:
            raise AssertionError(f"worker exited\n{proc.log()}")
        if not sock.poll(100):
            return None
        identity, frame = sock.recv_multipart()
        msg = decode(frame)
        return (identity, msg) if isinstance(msg, kind) else None

    return wait_until(one, timeout_s, f"a {kind.__name__} from the worker", interval=0,
                      on_fail=proc.log)


def finished(sock: zmq.Socket, proc: Proc, request_id: str) -> bool:
    _, msg = receive(sock, Tokens, proc, 30)
    return any(row.request_id == request_id and row.finish_reason is not None for row in msg.outputs)


def reported_bad(sock: zmq.Socket) -> int:
    """The worker's bad-frame count in the next status report."""
    while True:
        if not sock.poll(2000):
            return -1
        msg = decode(sock.recv_multipart()[1])
        if isinstance(msg, Status):
            return msg.report.bad_frames
