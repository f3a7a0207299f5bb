"""router/http/api.py's error middleware: the server's own failures reach clients without paths,
messages or tracebacks; the log keeps them."""

from __future__ import annotations

import logging

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from common.errors import BadRequest, ConfigError, ProtocolError
from router.http.http_errors import error_middleware

SECRET = "/Users/someone/models/private-model"


async def crash(request: web.Request) -> web.Response:
    raise RuntimeError(f"boom in {SECRET}/weights.safetensors")


async def bad_config(request: web.Request) -> web.Response:
    raise ConfigError(f"model folder {SECRET} does not exist", param="model")


async def bad_frame(request: web.Request) -> web.Response:
    raise ProtocolError(f"undecodable frame from {SECRET}")


async def bad_request(request: web.Request) -> web.Response:
    raise BadRequest("max_tokens must be a positive integer", param="max_tokens")


@pytest.mark.parametrize("handler", [crash, bad_config, bad_frame])
async def test_internal_errors_tell_the_client_nothing(
    handler: web.RequestHandler, caplog: pytest.LogCaptureFixture  # type: ignore[type-arg]
) -> None:
    app = web.Application(middlewares=[error_middleware])
    app.router.add_get("/x", handler)
    async with TestClient(TestServer(app)) as client:
        with caplog.at_level(logging.ERROR, logger="router.http.http_errors"):
            resp = await client.get("/x")
            text = await resp.text()
    assert resp.status == 500
    body = await resp.json()
    assert body["error"]["message"] == "internal server error"
    assert body["error"]["code"] == "internal_error"
    assert SECRET not in text and "Traceback" not in text and "File " not in text
    assert SECRET in caplog.text  # the operator still learns what happened


async def test_client_errors_keep_their_message() -> None:
    app = web.Application(middlewares=[error_middleware])
    app.router.add_get("/x", bad_request)
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/x")
        body = await resp.json()
    assert resp.status == 400 and body["error"]["param"] == "max_tokens"
    assert "positive integer" in body["error"]["message"]


async def test_each_api_prefix_gets_its_own_error_shape() -> None:
    from router.http.anthropic_output import error_body
    from router.http.http_errors import make_error_middleware

    app = web.Application(middlewares=[make_error_middleware({"/v1/messages": error_body})])
    app.router.add_post("/v1/messages", bad_request)
    app.router.add_post("/v1/chat/completions", bad_request)
    async with TestClient(TestServer(app)) as client:
        anthropic = await client.post("/v1/messages")
        openai = await client.post("/v1/chat/completions")
        missing = await client.get("/v1/messages/nothing")
        assert anthropic.status == openai.status == 400
        assert await anthropic.json() == {"type": "error", "error": {
            "type": "invalid_request_error", "message": "max_tokens must be a positive integer"}}
        assert (await openai.json())["error"]["param"] == "max_tokens"
        assert missing.status == 404
        assert (await missing.json())["error"]["type"] == "not_found_error"
