"""HTTP errors: the one place any error becomes a response.

Handlers raise ``HeadroomError``s; the middleware from ``make_error_middleware`` turns any
error into HTTP, with the right status and ``Retry-After``, in the error shape of the API
whose path was called (OpenAI's unless another claims the prefix). The server's own
troubles reach the client only as "internal server error"; their detail goes to the log.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from aiohttp import web

from common.errors import ConfigError, HeadroomError, PayloadTooLarge, ProtocolError, RequestQuarantined

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]
# An API's error body for an error (OpenAI's is HeadroomError.to_body).
ErrorBody = Callable[[HeadroomError], dict[str, Any]]
# Errors that are the server's own trouble, never the client's business in detail.
INTERNAL_ERRORS = (HeadroomError, ConfigError, ProtocolError)


class HttpError(HeadroomError):
    """aiohttp's own refusals (404, 405, ...), carried to the error shapes with their status."""

    def __init__(self, exc: web.HTTPException) -> None:
        super().__init__(exc.reason)
        self.status = exc.status  # type: ignore[misc]  # per instance: any HTTP status
        self.type = "invalid_request_error"  # type: ignore[misc]
        self.code = str(exc.status)  # type: ignore[misc]


def make_error_middleware(shapes: Mapping[str, ErrorBody]) -> Middleware:
    """The middleware that answers every error; ``shapes`` maps a path prefix to its API's body."""

    def body_for(path: str, exc: HeadroomError) -> dict[str, Any]:
        for prefix, shape in shapes.items():
            if path == prefix or path.startswith(prefix + "/"):
                return shape(exc)
        return exc.to_body()

    @web.middleware
    async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except HeadroomError as exc:
            error = public_error(exc)
        except web.HTTPRequestEntityTooLarge:
            error = PayloadTooLarge("the request body is too large")
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            error = HttpError(exc)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            error = HeadroomError("internal server error")
        return web.json_response(body_for(request.path, error), status=error.status,
                                 headers=error_headers(error))

    return error_middleware


_QUOTED = re.compile(r"""('[^']*'|"[^"]*")""")


def renamed(exc: HeadroomError, names: Sequence[tuple[str, str]]) -> HeadroomError:
    """``exc`` with the fields it names (message and ``param``) as another API names them:
    ``names`` are (pattern, replacement) pairs. A Messages or Responses request is checked
    as the chat request it translates to, so its errors name chat's fields."""
    # Quoted values are the client's own (a tool named "messages"): never renamed
    parts = _QUOTED.split(exc.message)
    param = exc.param
    for pattern, replacement in names:
        parts[::2] = [re.sub(pattern, replacement, part) for part in parts[::2]]
        param = re.sub(pattern, replacement, param) if param is not None else None
    message = "".join(parts)
    if message == exc.message and param == exc.param:
        return exc
    out = copy.copy(exc)
    out.message, out.param, out.args = message, param, (message,)
    return out


# Every error in OpenAI's shape (the app adds the other APIs' shapes by path prefix).
error_middleware = make_error_middleware({})


def public_error(exc: HeadroomError) -> HeadroomError:
    """The error a client may see: the server's own troubles are told only in the log."""
    if type(exc) not in INTERNAL_ERRORS:
        return exc
    # Its message may name files (a model folder, a config path): keep it in the log.
    log.error("internal error answered as a 500: %s", exc.message)
    return HeadroomError("internal server error")


def error_headers(exc: HeadroomError) -> dict[str, str]:
    headers: dict[str, str] = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(exc.retry_after_s)
    if isinstance(exc, RequestQuarantined):
        headers["x-should-retry"] = "false"
    return headers
