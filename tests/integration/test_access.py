"""Hostile HTTP against one guarded router: the API key, the Host check, CORS, every limit,
timeouts, and a stream client that stops reading."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import wait_until
from tests.integration.conftest import NO_EOS, Router, start_router
from tests.integration.test_stream_cancel import metric

KEY = "test-key-0123456789"
ORIGIN = "https://app.example.com"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
USER = [{"role": "user", "content": "hi"}]
TIMEOUT_S = 1.5
MAX_TOKENS_LIMIT = 3000


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory, cache_home: Path) -> Iterator[Router]:
    run_dir = tmp_path_factory.mktemp("guarded")
    key_file = run_dir / "api-key"
    key_file.write_text(f"# rotated monthly\n{KEY}\n")
    key_file.chmod(0o600)
    r = start_router(
        run_dir, cache_home, "--api-key-file", str(key_file), "--cors-origin", ORIGIN,
        "--allowed-host", "llm.lan", "--max-messages", "3", "--max-tools", "2",
        "--max-schema-bytes", "300", "--max-tokens-limit", str(MAX_TOKENS_LIMIT),
        "--max-prompt-tokens", "40", "--max-header-bytes", "4096",
        "--request-timeout", str(TIMEOUT_S), "--idle-timeout", "2",
        "--stream-buffer-bytes", "4096", "--slow-reader-timeout", str(TIMEOUT_S))
    r.http.headers.update(AUTH)  # for the helpers (/v1/memory); tests below send their own
    yield r
    r.stop()


def raw(router: Router, method: str, path: str, headers: dict[str, str] | None = None,
        body: Any = None) -> httpx.Response:
    """A request with exactly these headers (no default key)."""
    content = None if body is None else body if isinstance(body, bytes) else json.dumps(body)
    with httpx.Client(base_url=router.url, timeout=30) as client:
        return client.request(method, path, headers=headers or {}, content=content)


def assert_error(resp: httpx.Response, status: int, code: str, param: str | None = None) -> str:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == code and error["message"], error
    if param is not None:
        assert error["param"] == param, error
    return str(error["message"])


# -- the API key ---------------------------------------------------------------------------

@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/models"), ("GET", "/v1/memory"), ("POST", COMPLETIONS), ("POST", CHAT),
    ("POST", "/admin/workers/restart"), ("GET", "/v1/no-such-route"), ("GET", "/admin/else"),
])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"x-api-key": "wrong"}, {"Authorization": KEY}],
                         ids=["none", "wrong-bearer", "wrong-x-api-key", "no-scheme"])
def test_guarded_routes_need_the_key(guarded: Router, method: str, path: str,
                                     headers: dict[str, str]) -> None:
    body = {"prompt": "hi", "max_tokens": 1} if method == "POST" else None
    message = assert_error(raw(guarded, method, path, headers, body), 401, "unauthorized")
    assert KEY not in message


@pytest.mark.parametrize("headers", [AUTH, {"x-api-key": KEY}, {"authorization": f"bearer {KEY}"}])
def test_the_right_key_in_either_header(guarded: Router, headers: dict[str, str]) -> None:
    assert raw(guarded, "GET", "/v1/models", headers).status_code == 200
    r = raw(guarded, "POST", COMPLETIONS, headers, {"prompt": "hi", "max_tokens": 2, **NO_EOS})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_openai_client_with_and_without_the_key(guarded: Router) -> None:
    with guarded.client(api_key="nope") as client, pytest.raises(openai.AuthenticationError):
        client.models.list()
    with guarded.client(api_key=KEY) as client:
        ok = client.chat.completions.create(model="m", messages=USER, max_tokens=2, extra_body=NO_EOS)
    assert ok.usage is not None and ok.usage.completion_tokens == 2


def test_health_is_open_and_tells_nothing_private(guarded: Router) -> None:
    resp = raw(guarded, "GET", "/health")
    assert resp.status_code == 200
    text = resp.text
    assert KEY not in text and "stderr_tail" not in text and "/" not in resp.json()["model"]
    assert resp.json()["warnings"] == []
    for path in ("/metrics", "/openapi.json", "/"):
        assert raw(guarded, "GET", path).status_code == 200, path


def test_no_request_text_and_no_key_in_the_log(guarded: Router) -> None:
    marker = "PRIVATE-PROMPT-7f3a"
    for path, body in [
        (CHAT, {"messages": [{"role": "user", "content": marker}], "max_tokens": 2}),
        (COMPLETIONS, {"prompt": marker, "max_tokens": 2, "stream": True}),
        (CHAT, {"messages": [{"role": marker, "content": "x"}]}),             # refused: role
        (COMPLETIONS, {"prompt": "hi", "stop": [marker] * 9}),                   # refused: stop
        (COMPLETIONS, {"prompt": marker * 40, "max_tokens": 1}),                 # refused: length
    ]:
        raw(guarded, "POST", path, AUTH, body)
    raw(guarded, "GET", "/v1/models", {"Authorization": f"Bearer {marker}"})
    wait_until(lambda: "refused on /v1/completions: 400 context_length_exceeded" in guarded.log(),
               10, "the last refusal to be logged")
    log = guarded.log_path.read_text(errors="replace")
    assert marker not in log and KEY not in log


def test_warning_when_bound_off_loopback_without_a_key(tmp_path: Path, cache_home: Path) -> None:
    r = Router(tmp_path, cache_home, "--host", "0.0.0.0", "--worker-mode", "external")
    try:
        health = r.wait_answering()
        assert any("without an API key" in w for w in health["warnings"]), health
        wait_until(lambda: "without an API key" in r.log(), 10, "the startup warning", on_fail=r.log)
    finally:
        r.stop()


# -- Host and CORS --------------------------------------------------------------------------

@pytest.mark.parametrize("host", ["evil.example.com", "evil.example.com:8080",
                                  "127.0.0.1.nip.io", "localhost.evil.com"])
def test_rebinding_host_is_refused_even_for_health(guarded: Router, host: str) -> None:
    for path in ("/health", "/v1/models"):
        assert_error(raw(guarded, "GET", path, {"Host": host, **AUTH}), 403, "host_not_allowed")


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]", "llm.lan", "LLM.lan"])
def test_local_and_listed_hosts_with_or_without_port(guarded: Router, host: str) -> None:
    for h in (host, f"{host}:{guarded.port}"):
        assert raw(guarded, "GET", "/v1/models", {"Host": h, **AUTH}).status_code == 200, h


def test_cors_only_for_the_listed_origin(guarded: Router) -> None:
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    ok = raw(guarded, "OPTIONS", CHAT, pre)
    assert ok.status_code == 204
    assert ok.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "authorization" in ok.headers["Access-Control-Allow-Headers"].lower()
    assert "POST" in ok.headers["Access-Control-Allow-Methods"]
    bad = raw(guarded, "OPTIONS", CHAT, {**pre, "Origin": "https://evil.example"})
    assert bad.status_code == 403 and "Access-Control-Allow-Origin" not in bad.headers
    # The real request: the header on success and on an error (so the page can read it).
    r = raw(guarded, "POST", COMPLETIONS, {"Origin": ORIGIN, **AUTH}, {"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
    r = raw(guarded, "GET", "/v1/models", {"Origin": ORIGIN})
    assert r.status_code == 401 and r.headers["Access-Control-Allow-Origin"] == ORIGIN


def test_a_foreign_page_cannot_post_even_a_simple_request(guarded: Router) -> None:
    """text/plain needs no preflight: the Origin check is what stops it spending the GPU."""
    for origin in ("https://evil.example", "null"):
        r = raw(guarded, "POST", COMPLETIONS, {"Origin": origin, "Content-Type": "text/plain", **AUTH},
                {"prompt": "hi", "max_tokens": 1})
        assert_error(r, 403, "origin_not_allowed")
        assert "Access-Control-Allow-Origin" not in r.headers
    same = raw(guarded, "GET", "/v1/models", {"Origin": guarded.url, **AUTH})
    assert same.status_code == 200


def test_cors_is_off_without_the_flag(guarded: Router) -> None:
    r = raw(guarded, "GET", "/health", {"Origin": guarded.url})
    assert "Access-Control-Allow-Origin" not in r.headers


# -- limits ---------------------------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("path, body, param, flag", [
    (CHAT, {"messages": USER * 4}, "messages", "--max-messages"),
    (CHAT, {"messages": USER, "tools": [TOOL] * 3}, "tools", "--max-tools"),
    (CHAT, {"messages": USER, "tools": [{**TOOL, "x": "y" * 400}]}, "tools[0]", "--max-schema-bytes"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema", "s": "y" * 400}},
     "response_format", "--max-schema-bytes"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": MAX_TOKENS_LIMIT + 1}, "max_tokens", "--max-tokens-limit"),
    (CHAT, {"messages": USER, "max_completion_tokens": 10**30}, "max_completion_tokens",
     "--max-tokens-limit"),
    (COMPLETIONS, {"prompt": "hi", "stop": "x" * 1025}, "stop", None),
    (COMPLETIONS, {"prompt": "word " * 100, "max_tokens": 1}, "prompt", "--max-prompt-tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 100}], "max_tokens": 1}, "messages",
     "--max-prompt-tokens"),
    # Other APIs' own shapes are held to the same limits.
    (RESPONSES, {"input": USER * 4}, "input", "--max-messages"),
    (RESPONSES, {"input": "hi", "tools": [{"type": "function", "name": "f"}] * 3}, "tools", "--max-tools"),
    (RESPONSES, {"input": "hi", "text": {"format": {"type": "json_schema", "name": "s",
                                                    "schema": {"x": "y" * 400}}}},
     "text.format", "--max-schema-bytes"),
    (MESSAGES, {"messages": USER * 4, "max_tokens": 1}, "messages", "--max-messages"),
    (MESSAGES, {"messages": USER, "max_tokens": 1, "output_config": {
        "format": {"type": "json_schema", "schema": {"x": "y" * 400}}}},
     "response_format", "--max-schema-bytes"),
    (COUNT_TOKENS, {"messages": USER, "tools": [{"name": "f", "input_schema": {
        "type": "object", "x": "y" * 400}}]}, "tools[0]", "--max-schema-bytes"),
])
def test_each_limit_is_a_clear_400(guarded: Router, path: str, body: Any, param: str,
                                   flag: str | None) -> None:
    resp = raw(guarded, "POST", path, AUTH, {"model": "demo", **body})
    if path.startswith(MESSAGES):  # Anthropic's error shape
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert resp.json()["type"] == "error" and error["type"] == "invalid_request_error"
        message = error["message"]
    else:
        code = "context_length_exceeded" if flag == "--max-prompt-tokens" else "invalid_request"
        message = assert_error(resp, 400, code, param)
    assert flag is None or flag in message


def test_body_too_large_and_nested_too_deep(guarded: Router) -> None:
    assert_error(raw(guarded, "POST", COMPLETIONS, AUTH, b'"' + b"x" * (9 << 20) + b'"'), 413,
                 "payload_too_large")
    assert_error(raw(guarded, "POST", CHAT, AUTH, b"[" * 100_000 + b"]" * 100_000), 400,
                 "invalid_request")


def test_header_too_large(guarded: Router) -> None:
    r = raw(guarded, "GET", "/health", {"X-Big": "y" * 5000})
    assert r.status_code in (400, 431)
    assert raw(guarded, "GET", "/health").status_code == 200
    # One line in the log, not an ERROR with a traceback an attacker can repeat at will.
    wait_until(lambda: "refused a malformed HTTP request" in guarded.log(), 10, "the log line")
    assert "LineTooLong" not in guarded.log_path.read_text(errors="replace")


def connect(router: Router, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", router.port))
    return sock


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_a_slow_upload_gets_408(guarded: Router) -> None:
    with connect(guarded) as sock:
        sock.sendall(f"POST {COMPLETIONS} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEY}"
                     "\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pro".encode())
        reply = b""  # it never sends the rest; the router answers anyway
        while b'"request_timeout"' not in reply and (chunk := sock.recv(65536)):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]


def test_an_idle_connection_is_closed(guarded: Router) -> None:
    with connect(guarded) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localh")  # and nothing more
        assert read_all(sock) == b""


def test_a_stream_client_that_stops_reading_is_dropped_and_its_row_freed(guarded: Router) -> None:
    slow_before = metric(guarded, "headroom_slow_readers_total")
    freed_before = metric(guarded, "headroom_cancelled_requests_total", 'where="running"')
    body = json.dumps({"prompt": "x", "max_tokens": MAX_TOKENS_LIMIT, "ignore_eos": True,
                       "stream": True, "temperature": 0}).encode()
    with connect(guarded, rcvbuf=2048) as sock:
        sock.sendall(f"POST {COMPLETIONS} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEY}"
                     f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                     .encode() + body)
        assert sock.recv(12) == b"HTTP/1.1 200"
        # ... and read nothing more.
        wait_until(lambda: metric(guarded, "headroom_slow_readers_total") > slow_before, 60,
                   "the router to drop the stream that is not read", on_fail=guarded.log)
    # The worker was still running it (it had not reached max_tokens) when it was cancelled.
    assert metric(guarded, "headroom_cancelled_requests_total", 'where="running"') > freed_before
    wait_until(lambda: guarded.memory()["workers"][0]["running"] == 0, 10, "the row to be freed")
    r = raw(guarded, "POST", COMPLETIONS, AUTH, {"prompt": "after", "max_tokens": 2})
    assert r.status_code == 200
