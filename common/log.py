"""setup_logging(): called once per main(). Text for people, JSON lines for machines.

Every line carries its context without threading arguments through the code: the process's
fixed fields (``model``; the worker's ``incarnation``) are given to ``setup_logging``, and
the request a line is about comes from ``extra=about(request_id)`` or, on the router's
request path, from a context variable the HTTP middleware sets (``bind_request``).
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from collections.abc import Mapping, Sequence

__all__ = ["about", "bind_model", "bind_request", "current_request_id", "setup_logging"]

# The request the running task serves; asyncio copies it into tasks the handler starts.
_REQUEST: contextvars.ContextVar[dict[str, object] | None] = contextvars.ContextVar(
    "headroom_request", default=None)


def bind_request(request_id: str, **fields: object) -> contextvars.Token[dict[str, object] | None]:
    """Tag every line logged from here on in this task (and tasks it starts) with the request."""
    return _REQUEST.set({"request_id": request_id, **fields})


def current_request_id() -> str | None:
    ctx = _REQUEST.get()
    return None if ctx is None else str(ctx["request_id"])


def about(request_id: str, incarnation: int | None = None, model: str | None = None) -> dict[str, object]:
    """``extra=`` for a line about a request logged outside its task (dispatcher, worker)."""
    extra: dict[str, object] = {"request_id": request_id}
    if incarnation is not None:
        extra["incarnation"] = incarnation
    if model:
        extra["model"] = model
    return extra


def bind_model(model: str) -> None:
    """The request this task serves is for ``model``: its lines say so (not the process's
    list of every model it offers)."""
    ctx = _REQUEST.get()
    if ctx is not None:
        ctx["model"] = model  # the same dict the tasks it started see


class ContextFilter(logging.Filter):
    """Adds the request and process fields to each record; ``extra=`` given by the call wins."""

    def __init__(self, fixed: Mapping[str, object]) -> None:
        super().__init__()
        self.fixed = dict(fixed)

    def filter(self, record: logging.LogRecord) -> bool:
        request = _REQUEST.get()
        for source in (request or {}, self.fixed):
            for key, value in source.items():
                if value is not None and not hasattr(record, key):
                    setattr(record, key, value)
        return True


class TextFormatter(logging.Formatter):
    """The classic line, with ``[request id]`` before the message when it is about one."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        request_id = getattr(record, "request_id", None)
        if request_id is None:
            return line
        head, sep, message = line.partition(": ")
        return f"{head}{sep}[{request_id}] {message}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line; extra fields given with ``extra=`` are kept."""

    _SKIP = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message"}

    def format(self, record: logging.LogRecord) -> str:
        body = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.created % 1 * 1e6):06d}Z",  # microseconds: stages of one request
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in self._SKIP:
                body[key] = value
        if record.exc_info:
            body["exc"] = self.formatException(record.exc_info)
        return json.dumps(body, default=str)


def config_error_line(process: str, message: str, argv: Sequence[str], env: Mapping[str, str]) -> str:
    """The one line a process that cannot start writes (before logging exists): JSON when
    its command line or environment asked for JSON logs, so a log reader parses every line."""
    section = process.removeprefix("mlx-").upper()
    wants_json = env.get(f"MLX_{section}_LOG_FORMAT") == "json" or "--log-format=json" in argv or any(
        a == "--log-format" and b == "json" for a, b in zip(argv, argv[1:]))
    if not wants_json:
        return f"{process}: {message}"
    record = logging.makeLogRecord({"name": process, "levelno": logging.ERROR,
                                    "levelname": "ERROR", "msg": message})
    return JsonFormatter().format(record)  # the shape of every other JSON line


def setup_logging(level: str, fmt: str = "text", *, process: str,
                  context: Mapping[str, object] | None = None) -> None:
    """Log to stderr (launchd and systemd capture it); one handler on the root logger.

    ``context``: fields every line of this process carries (``model``, ``incarnation``).
    """
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            TextFormatter(f"%(asctime)s {process}[%(process)d] %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(ContextFilter(context or {}))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Third-party chatter at INFO is noise in an operator's log.
    for noisy in ("aiohttp.access", "asyncio", "transformers", "httpx"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
