"""Bad input over raw HTTP: a clear OpenAI-shaped error naming the parameter, nothing dies."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.integration.conftest import Router

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def post(router: Router, path: str, body: Any, **kw: Any) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return router.http.post(path, content=content, headers={"Content-Type": "application/json"}, **kw)


def assert_error(resp: httpx.Response, status: int, code: str, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["code"] == code, error
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, b"{not json", None),
    (COMPLETIONS, [1, 2, 3], None),
    (COMPLETIONS, {"prompt": 42}, "prompt"),
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {"prompt": ["a", ""]}, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "temperature": 7}, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "top_p": -0.1}, "top_p"),
    (COMPLETIONS, {"prompt": "hi", "n": 99}, "n"),
    (COMPLETIONS, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    (COMPLETIONS, {"prompt": "hi", "stream": "yes"}, "stream"),
    (COMPLETIONS, {"prompt": "hi", "seed": "x"}, "seed"),
    (COMPLETIONS, {"prompt": "hi", "presence_penalty": 5}, "presence_penalty"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 6}, "logprobs"),
    (COMPLETIONS, {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    (COMPLETIONS, {"prompt": [1, 2, 100000]}, None),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, "tools[0]"),
    (CHAT, {"messages": USER, "response_format": {"type": "yaml"}}, "response_format"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"messages": USER, "echo": True}, "echo"),
    # More rows than the queue holds (64 prompts x n 8 > 256): once a 429 retried forever.
    (COMPLETIONS, {"prompt": ["hi"] * 64, "n": 8, "max_tokens": 1}, "n"),
    # A lone UTF-16 surrogate is no text any tokenizer encodes (once a 500).
    (COMPLETIONS, b'{"prompt": "a\\ud800b", "max_tokens": 1}', None),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 1}', None),
])
def test_bad_input_is_a_400_naming_the_parameter(router: Router, path: str, body: Any,
                                                 param: str | None) -> None:
    assert_error(post(router, path, body), 400, "invalid_request", param)


def test_context_length_exceeded(router: Router) -> None:
    error = assert_error(post(router, COMPLETIONS, {"prompt": "hi", "max_tokens": 4096}), 400,
                         "context_length_exceeded")
    assert "4096" in error["message"]
    long_prompt = "word " * 5000
    assert_error(post(router, COMPLETIONS, {"prompt": long_prompt, "max_tokens": 10}), 400,
                 "context_length_exceeded")


def test_neutral_unsupported_parameters_are_accepted(router: Router) -> None:
    resp = post(router, CHAT, {"messages": USER, "max_tokens": 3, "presence_penalty": 0,
                               "frequency_penalty": 0.0, "logit_bias": {}, "logprobs": False,
                               "n": 1, "user": "u1", "tool_choice": "none", "top_k": -1})
    assert resp.status_code == 200, resp.text


def test_token_id_prompt(router: Router) -> None:
    resp = post(router, COMPLETIONS, {"prompt": [10, 20, 30, 40], "max_tokens": 4})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == 4


def test_body_too_large_is_413(router: Router) -> None:
    body = json.dumps({"prompt": "x" * (9 * 1024 * 1024)})
    assert_error(post(router, COMPLETIONS, body), 413, "payload_too_large")


def test_unknown_path_is_openai_shaped_404(router: Router) -> None:
    resp = router.http.get("/v1/nothing")
    assert resp.status_code == 404
    assert "error" in resp.json()


def test_nothing_sent_kills_anything(router: Router) -> None:
    before = router.worker()
    for body in (b"\x00\xff" * 100, b"[]" * 1000, json.dumps({"prompt": "\udcff"}).encode(),
                 json.dumps({"messages": [{"role": "user", "content": "\u0000" * 50}], "max_tokens": 2})):
        resp = post(router, CHAT, body)
        assert resp.status_code in (200, 400), resp.text
    after = router.worker()
    assert after["pid"] == before["pid"] and after["state"] == "ready"
    ok = post(router, COMPLETIONS, {"prompt": "still alive?", "max_tokens": 3})
    assert ok.status_code == 200
