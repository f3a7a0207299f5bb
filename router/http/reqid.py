"""Request ids: the client's ``X-Request-Id`` when it is sane, else one of ours.

The id is the key of the request everywhere: the response's ``X-Request-Id`` header and
the suffix of its ``id`` (``chatcmpl-<id>``), the ``Generate`` sent to the worker, and
every log line about the request in both processes. It must therefore be unique among
live requests (the worker refuses a duplicate): a client id already in use gets a suffix.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Awaitable, Callable

from aiohttp import web

from common.log import bind_request

HEADER = "X-Request-Id"
ANTHROPIC_HEADER = "request-id"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
KEY = "request_id"  # where the handler finds it: request[KEY]
# Printable, no spaces, quotes or slashes: safe in a header, a log line and a JSON id.
_SANE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:=+-]{0,127}")
# Joins a request id and a choice's index into a row id; _SANE never lets a client use it.
ROW_SEP = "#"


def is_sane(value: str) -> bool:
    return _SANE.fullmatch(value) is not None


def make_request_id() -> str:
    return secrets.token_hex(12)


class RequestIds:
    """The middleware that names each request, and the set of ids now in use."""

    def __init__(self) -> None:
        self.live: set[str] = set()

    def claim(self, wanted: str | None) -> str:
        """The id for a new request: ``wanted`` if sane and free, else a variant or a new one."""
        if wanted is None or not is_sane(wanted):
            wanted = make_request_id()
        request_id, n = wanted, 1
        while request_id in self.live:
            n += 1
            request_id = f"{wanted[:120]}.{n}"
        self.live.add(request_id)
        return request_id

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        request_id = self.claim(request.headers.get(HEADER))
        request[KEY] = request_id
        token = bind_request(request_id)
        try:
            return await handler(request)
        finally:
            self.live.discard(request_id)
            token.var.reset(token)


async def add_header(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every response, streamed or not, error or not, names its request."""
    request_id = request.get(KEY)
    if request_id is not None:
        response.headers[HEADER] = request_id
        if request.path.startswith("/v1/messages"):  # where the anthropic client reads it
            response.headers[ANTHROPIC_HEADER] = request_id
