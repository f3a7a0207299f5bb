"""The Headroom error tree. Each class knows its HTTP status, OpenAI type and code.

    HeadroomError
    ├── BadRequest (400)                  not recoverable by retrying the same request
    │   ├── ContextLengthExceeded         prompt + max_tokens over the model's context
    │   └── InsufficientMemory            could never fit, even on an idle worker
    ├── Unauthorized (401)
    ├── Forbidden (403)                   not recoverable: the client is not allowed in
    │   ├── HostNotAllowed                Host header not this server's (DNS rebinding)
    │   └── OriginNotAllowed              a browser page of another origin
    ├── ModelNotFound (404)               the request names a model this router does not serve
    ├── RequestTimeout (408)              the body did not arrive within --request-timeout
    ├── PayloadTooLarge (413)
    ├── QueueFull (429)                   recoverable: retry later
    ├── RequestFailed (500)               the request's own grammar or sampler failed; it alone
    ├── Unavailable (503)                 recoverable: retry later (Retry-After)
    │   ├── NoWorker                      no worker can serve (failed, shutting down)
    │   ├── QueueTimeout                  waited past --queue-timeout
    │   ├── WorkerLost                    its worker died while it ran
    │   ├── MemoryPressure                evicted: another process took the memory
    │   └── RequestQuarantined            in flight at two worker deaths: do not retry
    ├── ProtocolError                     a bad frame; counted and dropped, never reaches HTTP
    └── ConfigError                       a bad flag, env var or config file entry

Only the middleware of ``router/http/http_errors.py`` turns these into HTTP responses.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "HeadroomError",
    "BadRequest",
    "ContextLengthExceeded",
    "InsufficientMemory",
    "Unauthorized",
    "Forbidden",
    "HostNotAllowed",
    "OriginNotAllowed",
    "ModelNotFound",
    "RequestTimeout",
    "PayloadTooLarge",
    "QueueFull",
    "RequestFailed",
    "Unavailable",
    "NoWorker",
    "QueueTimeout",
    "WorkerLost",
    "MemoryPressure",
    "RequestQuarantined",
    "ProtocolError",
    "ConfigError",
]


class HeadroomError(Exception):
    """Base of every error this project raises on purpose."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    code: ClassVar[str] = "internal_error"
    retry_after_s: ClassVar[int | None] = None

    def __init__(self, message: str, *, param: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.extra = extra

    def to_body(self) -> dict[str, Any]:
        """The OpenAI error shape, also used as the data of an SSE ``error`` event."""
        error: dict[str, Any] = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.code,
        }
        error.update(self.extra)
        return {"error": error}


class BadRequest(HeadroomError, ValueError):
    """The request is invalid; retrying it unchanged will fail again."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class ContextLengthExceeded(BadRequest):
    """Prompt plus max_tokens exceed the model's context length. Not recoverable.

    ``sizes`` (prompt tokens, max_tokens, the limit), where known: an API whose clients read
    their own wording of this error (Anthropic's) writes it from them."""

    code = "context_length_exceeded"

    def __init__(self, message: str, *, param: str | None = None,
                 sizes: tuple[int, int, int] | None = None, **extra: Any) -> None:
        super().__init__(message, param=param, **extra)
        self.sizes = sizes


class InsufficientMemory(BadRequest):
    """Even an idle worker could not hold this request. Not recoverable."""

    code = "insufficient_memory"


class Unauthorized(HeadroomError):
    """Missing or wrong API key."""

    status = 401
    type = "authentication_error"
    code = "unauthorized"


class Forbidden(HeadroomError):
    """The client may not use this server. Not recoverable by retrying."""

    status = 403
    type = "permission_error"
    code = "forbidden"


class HostNotAllowed(Forbidden):
    """The Host header names another server: likely DNS rebinding from a web page."""

    code = "host_not_allowed"


class OriginNotAllowed(Forbidden):
    """A browser request from an origin not given with --cors-origin."""

    code = "origin_not_allowed"


class ModelNotFound(HeadroomError):
    """The request names a model this router does not serve; not recoverable by retrying."""

    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class RequestTimeout(HeadroomError):
    """The request body did not arrive in time. Recoverable with a faster upload."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class PayloadTooLarge(HeadroomError):
    """The request body is over the router's size limit. Not recoverable."""

    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class QueueFull(HeadroomError):
    """The router's queue is full. Recoverable: retry after a moment."""

    status = 429
    type = "rate_limit_error"
    code = "queue_full"
    retry_after_s = 1


class RequestFailed(HeadroomError):
    """The request's own work failed in the worker (its grammar matcher, sampler or logits
    processor raised): it ended alone, the rest of the batch went on. Not recoverable by
    retrying the same request."""

    status = 500
    type = "server_error"
    code = "request_failed"


class Unavailable(HeadroomError):
    """The service cannot answer now. Recoverable: retry after Retry-After."""

    status = 503
    type = "server_error"
    code = "unavailable"
    retry_after_s = 1


class NoWorker(Unavailable):
    """No worker can take requests (failed, or the router is shutting down)."""

    code = "no_worker"
    retry_after_s = 5


class QueueTimeout(Unavailable, TimeoutError):
    """The request waited in the queue past its deadline. Recoverable."""

    code = "queue_timeout"


class WorkerLost(Unavailable):
    """The worker running this request died. Recoverable: the worker is being restarted."""

    code = "worker_lost"
    retry_after_s = 2


class MemoryPressure(Unavailable):
    """Evicted because another process took the memory it was promised. Recoverable."""

    code = "memory_pressure"
    retry_after_s = 5


class RequestQuarantined(Unavailable):
    """This request was in flight at two worker deaths. Not recoverable by retrying."""

    code = "request_quarantined"
    retry_after_s = 60


class ProtocolError(HeadroomError):
    """A malformed, unknown or mismatched frame. The reader counts and drops it."""


class ConfigError(HeadroomError, ValueError):
    """A bad flag, environment variable or config file entry. Fatal at startup."""
