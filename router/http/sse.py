"""Answering a request's rows: one JSON body, or an SSE stream.

A stream's headers wait for its first token: a request refused before it (the worker's
re-check, the quarantine, a lost worker) gets the same HTTP status and JSON body as one
that does not stream. Until then the keepalive timer only looks for a client that left.
Once the stream has begun it sends keepalive comments while nothing else is said (a tool
call being written), writes every event already waiting as one chunk, ends with an error
event (never a hang) when its worker is lost, and drops a client that stops reading, so a
slow reader cannot make the router hold its output without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
import time
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import Counter

from common.errors import HeadroomError, RequestFailed
from common.log import about
from router.http.http_errors import public_error
from router.http.limits import Limits
from router.http.output import Collector, Presenter
from router.http.rows import Rows
from router.job import TokenEvent

log = logging.getLogger(__name__)

# A started stream with nothing to say for ``Limits.keepalive_s`` (--sse-keepalive, 5 s)
# sends an SSE comment, so a vanished client is noticed (the write fails); before its first
# token (queued, or in a long prefill) the same timer checks the connection instead.
# How often a stream whose client is behind looks at its buffer again (only while behind).
DRAIN_POLL_S = 0.05


class _Stream(web.StreamResponse):
    """A stream whose headers go out with its first chunk: one send on the first token's
    path instead of two (aiohttp sends a StreamResponse's headers at ``prepare`` unless it
    opts into buffering them, as its own ``web.Response`` does)."""

    _send_headers_immediately = False


SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


class SlowReader(Exception):
    """The client stopped reading its stream; its connection is already closed."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("the client stopped reading its stream")
        self.response = response


class ClientGone(Exception):
    """The client closed its connection before its stream began; nothing was sent."""


def is_client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


class StreamMetrics(Protocol):
    """What a stream counts (router/ops/status.py's Metrics has it)."""

    slow_readers: Counter


class Responder:
    """Feeds a request's events to its collectors and writes what the presenter makes of them."""

    def __init__(self, *, cancel: Any, limits: Limits, metrics: StreamMetrics) -> None:
        self.cancel = cancel          # frees a finished choice's worker row at once
        self.limits = limits
        self.metrics = metrics

    def feed(self, rows: Rows, collectors: list[Collector], index: int, event: TokenEvent) -> None:
        c = collectors[index]
        try:
            c.feed(event)
        except Exception as exc:  # its detokenizer, stop strings or parser: this request's failure
            log.exception("reading a row's output back failed", extra=about(rows.jobs[index].request_id))
            raise RequestFailed(f"reading the output back failed: {type(exc).__name__}: {exc}") from exc
        if c.finished:  # a stop string may end a choice while its row still runs
            self.cancel(rows.jobs[index])

    async def collect(self, rows: Rows, collectors: list[Collector], present: Presenter) -> web.Response:
        while not all(c.finished for c in collectors):
            index, event = await rows.events.get()
            if isinstance(event, HeadroomError):
                raise event
            self.feed(rows, collectors, index, event)
        return web.json_response(present.body(collectors, rows.prompt_tokens))

    async def stream(self, request: web.Request, rows: Rows, collectors: list[Collector],
                      present: Presenter) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        # Timed from the last write, not the last event: tokens of a tool call being written
        # arrive all along but say nothing until the call is whole (a proxy's read timeout
        # counts bytes).
        quiet_since = time.monotonic()
        while not all(c.finished for c in collectors):
            try:
                async with asyncio.timeout(max(0.0, quiet_since + self.limits.keepalive_s - time.monotonic())):
                    index, event = await rows.events.get()
            except TimeoutError:
                quiet_since = time.monotonic()
                if response is not None:
                    await self.write(request, response, present.keepalive())
                elif is_client_gone(request):
                    raise ClientGone() from None  # the API cancels its queued or running rows
                continue
            if isinstance(event, HeadroomError):
                if response is None:
                    raise event  # nothing sent yet: the status and body a non-streamed request gets
                await self.write(request, response, present.error(public_error(event)))
                return response
            try:
                chunk = self.drain(rows, collectors, present, index, event)
            except RequestFailed as exc:
                if response is None:
                    raise
                await self.write(request, response, present.error(exc))
                return response
            response = response or await self.start_stream(request)
            if chunk:
                await self.write(request, response, chunk)
                sent = quiet_since = time.monotonic()
                for job in rows.jobs:  # the first token's first byte, for the finished log line
                    if job.first_sent_at is None and job.first_token_at is not None:
                        job.first_sent_at = sent
            elif time.monotonic() - quiet_since >= self.limits.keepalive_s:
                await self.write(request, response, present.keepalive())
                quiet_since = time.monotonic()
        assert response is not None
        await self.write(request, response, present.tail(collectors, rows.prompt_tokens))
        return response

    async def write(self, request: web.Request, response: web.StreamResponse, data: bytes) -> None:
        """Write to the stream; a client that leaves the buffer full too long is dropped.

        ``write`` waits while the transport holds more than --stream-buffer-bytes, so a
        client that stops reading cannot make the router hold its output without bound; past
        --slow-reader-timeout the request is cancelled (the API frees its worker row) and
        the connection closed.
        """
        transport = request.transport
        try:
            async with asyncio.timeout(self.limits.slow_reader_timeout_s):
                await response.write(data)
                # aiohttp waits for the socket only every 64 KiB written; hold to our bound.
                while transport is not None and \
                        transport.get_write_buffer_size() > self.limits.stream_buffer_bytes // 2:
                    await asyncio.sleep(DRAIN_POLL_S)
        except TimeoutError:
            self.metrics.slow_readers.inc()
            log.info("dropping a stream whose client stopped reading for %.0fs",
                     self.limits.slow_reader_timeout_s)
            if transport is not None:
                transport.abort()
            raise SlowReader(response) from None

    def drain(self, rows: Rows, collectors: list[Collector], present: Presenter, index: int,
               event: TokenEvent) -> bytes:
        """Feed this event and any already waiting, and return one SSE write for them."""
        touched = {index: None}
        self.feed(rows, collectors, index, event)
        while not rows.events.empty():
            more_index, more = rows.events.get_nowait()
            if isinstance(more, HeadroomError):
                rows.events.put_nowait((more_index, more))  # keep it for the loop: flush the text first
                break
            touched[more_index] = None
            self.feed(rows, collectors, more_index, more)
        return b"".join(present.delta(collectors[i]) for i in touched)

    async def start_stream(self, request: web.Request) -> web.StreamResponse:
        # --stream-buffer-bytes is shared: half in the kernel's send buffer, half in the
        # transport's (``write``), so a client that stops reading holds no more than it.
        response = _Stream(status=200, headers=SSE_HEADERS)
        await response.prepare(request)
        sock = request.transport.get_extra_info("socket") if request.transport else None
        if sock is not None:
            # The kernel's send buffer autotunes to megabytes for a peer that does not read;
            # a token stream needs far less, and this keeps the whole buffer bounded.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _kernel_share(self.limits.stream_buffer_bytes))
        return response


def _kernel_share(buffer_bytes: int) -> int:
    """SO_SNDBUF for half of ``buffer_bytes``: Linux doubles the value it is given (for its
    own bookkeeping), other systems take it as is."""
    return buffer_bytes // 4 if sys.platform.startswith("linux") else buffer_bytes // 2
