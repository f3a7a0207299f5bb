"""OpenAI handlers: parse, validate, admit, enqueue, stream. Errors become HTTP here only.

Handlers raise ``HeadroomError``s; ``error_middleware`` is the one place that turns any
error into the OpenAI error shape with the right status and ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from common.errors import (
    BadRequest, ConfigError, HeadroomError, NoWorker, PayloadTooLarge, ProtocolError, QueueTimeout,
    RequestQuarantined, RequestTimeout,
)
from router import admission
from common.log import about
from common.protocol import Hello
from router.dispatch import Dispatcher
from router.job import Job, JobState, TokenEvent
from router.limits import Limits, check_body, check_max_tokens, check_prompt_tokens
from router.output import Collector, Formatter
from router.reqid import KEY as REQUEST_ID, make_request_id
from router.schema import Parsed, parse_chat, parse_completion
from router.status import Metrics
from router.tokenizer import RouterTokenizer

log = logging.getLogger(__name__)
# Prompts up to this many characters are tokenized on the event loop: a few tens of
# microseconds, less than the two thread wakeups a pool hop costs (measured 0.46 -> 0.27 ms
# from arrival to queue on 2 cores). Longer ones go to the pool, where the batch encode
# releases the GIL and a huge prompt cannot stall every other stream.
INLINE_TOKENIZE_CHARS = 2048

# A stream with nothing to say for this long sends an SSE comment, so a vanished client is
# noticed (the write fails) even during a long prefill or wait in the queue.
KEEPALIVE_S = 5.0
# How often a stream whose client is behind looks at its buffer again (only while behind).
DRAIN_POLL_S = 0.05
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Errors that are the server's own trouble, never the client's business in detail.
INTERNAL_ERRORS = (HeadroomError, ConfigError, ProtocolError)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except HeadroomError as exc:
        return error_response(public_error(exc))
    except web.HTTPRequestEntityTooLarge:
        return error_response(PayloadTooLarge("the request body is too large"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        body = {"error": {"message": exc.reason, "type": "invalid_request_error", "param": None,
                          "code": str(exc.status)}}
        return web.json_response(body, status=exc.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(HeadroomError("internal server error"))


class SlowReader(Exception):
    """The client stopped reading its stream; its connection is already closed."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("the client stopped reading its stream")
        self.response = response


def public_error(exc: HeadroomError) -> HeadroomError:
    """The error a client may see: the server's own troubles are told only in the log."""
    if type(exc) not in INTERNAL_ERRORS:
        return exc
    # Its message may name files (a model folder, a config path): keep it in the log.
    log.error("internal error answered as a 500: %s", exc.message)
    return HeadroomError("internal server error")


def error_response(exc: HeadroomError) -> web.Response:
    headers: dict[str, str] = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(exc.retry_after_s)
    if isinstance(exc, RequestQuarantined):
        headers["x-should-retry"] = "false"
    return web.json_response(exc.to_body(), status=exc.status, headers=headers)


def sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _log_preload_failure(task: asyncio.Future[RouterTokenizer]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("could not load the tokenizer: %s", task.exception())


class Api:
    """The OpenAI-compatible endpoints."""

    def __init__(self, *, dispatcher: Dispatcher, metrics: Metrics, model_id: str,
                 default_max_tokens: int, queue_timeout_s: float, limits: Limits,
                 is_draining: Callable[[], bool], trust_remote_code: bool = False) -> None:
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.model_id = model_id
        self.default_max_tokens = default_max_tokens
        self.queue_timeout_s = queue_timeout_s
        self.limits = limits
        self.trust_remote_code = trust_remote_code
        self.is_draining = is_draining
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self._tokenizer: RouterTokenizer | None = None
        self._tokenizer_path: str | None = None
        self._tokenizer_lock = asyncio.Lock()
        self._tokenizer_task: asyncio.Future[RouterTokenizer] | None = None
        self.num_in_flight = 0

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": 0, "owned_by": "headroom"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, parse_completion, "completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, parse_chat, "chat")

    async def _serve(self, request: web.Request, parse: Callable[[Any, int], Parsed],
                     endpoint: str) -> web.StreamResponse:
        arrived = time.monotonic()
        status = 500
        request_id = request.get(REQUEST_ID) or make_request_id()
        try:
            if self.is_draining():
                raise NoWorker("the server is shutting down")
            body = await self._json(request)
            check_body(body, self.limits)
            parsed = parse(body, self.default_max_tokens)
            check_max_tokens(parsed.sampling.max_tokens, self.limits)
            job = await self._admit(parsed, arrived, request_id)
            response = await self._run(request, parsed, job)
            status = response.status
            return response
        except HeadroomError as exc:
            status = exc.status
            if exc.status != 500:
                self.metrics.rejections.labels(code=exc.code).inc()
                self.metrics.history.note_rejection(time.time(), request_id, endpoint, exc)
            # The message may quote the request: only its code at INFO.
            log.info("refused on /v1/%s: %d %s (param %s)", endpoint, exc.status, exc.code,
                     exc.param, extra=about(request_id))
            log.debug("refused: %s", exc.message, extra=about(request_id))
            raise
        finally:
            self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()

    async def _json(self, request: web.Request) -> Any:
        try:
            async with asyncio.timeout(self.limits.request_timeout_s):
                raw = await request.read()
        except TimeoutError:
            raise RequestTimeout("the request body did not arrive within "
                                 f"{self.limits.request_timeout_s:g}s (--request-timeout)") from None
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("the request body is not valid JSON") from None
        except RecursionError:
            raise BadRequest("the request body is nested too deeply") from None

    def preload_tokenizer(self, hello: Hello) -> None:
        """Load the tokenizer as soon as a worker says hello, not at the first request."""
        if self._tokenizer_path != hello.tokenizer_path:
            task = asyncio.ensure_future(self._load_tokenizer(hello.tokenizer_path))
            task.add_done_callback(_log_preload_failure)
            self._tokenizer_task = task

    @property
    def tokenizer_ready(self) -> bool:
        link = self.dispatcher.link
        return self._tokenizer is not None and link is not None \
            and self._tokenizer_path == link.hello.tokenizer_path

    async def _load_tokenizer(self, path: str) -> RouterTokenizer:
        async with self._tokenizer_lock:
            if self._tokenizer is None or self._tokenizer_path != path:
                loop = asyncio.get_running_loop()
                self._tokenizer = await loop.run_in_executor(
                    self.pool, functools.partial(RouterTokenizer.load, path,
                                                 trust_remote_code=self.trust_remote_code))
                self._tokenizer_path = path
            return self._tokenizer

    async def _tokenizer_for(self, deadline: float) -> tuple[RouterTokenizer, Any]:
        """Wait (until the queue deadline) for a worker's hello, then its tokenizer."""
        d = self.dispatcher
        while d.link is None:
            if d.unavailable is not None:
                raise NoWorker(d.unavailable)
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await d.ready.wait()
            except TimeoutError:
                raise QueueTimeout("no worker became ready before the request's queue timeout") from None
        link = d.link
        tokenizer = self._tokenizer
        if tokenizer is None or self._tokenizer_path != link.hello.tokenizer_path:
            tokenizer = await self._load_tokenizer(link.hello.tokenizer_path)
        return tokenizer, link

    async def _admit(self, parsed: Parsed, arrived: float, request_id: str) -> Job:
        deadline = arrived + self.queue_timeout_s
        tokenizer, link = await self._tokenizer_for(deadline)
        # Never-fits by max_tokens alone needs no tokenizing (a prompt has ≥ 1 token).
        error = admission.check_max_tokens_only(link.model, link.hello.admission,
                                                parsed.sampling.max_tokens)
        if error is None:
            ids = await self._tokenize(tokenizer, parsed)
            check_prompt_tokens(len(ids), self.limits,
                                "messages" if parsed.messages is not None else "prompt")
            error = admission.check_ever(link.model, link.hello.admission, len(ids),
                                         parsed.sampling.max_tokens)
        if error is not None:
            raise error
        job = Job(request_id=request_id, prompt_ids=ids, sampling=parsed.sampling,
                  deadline=deadline, enqueued_at=time.monotonic())
        self.dispatcher.submit(job)
        self.metrics.prompt_tokens.inc(len(ids))
        return job

    async def _tokenize(self, tokenizer: RouterTokenizer, parsed: Parsed) -> list[int]:
        if parsed.prompt_ids is not None:
            if min(parsed.prompt_ids) < 0 or max(parsed.prompt_ids) >= tokenizer.vocab_size:
                raise BadRequest(f"token ids must be in [0, {tokenizer.vocab_size})", param="prompt")
            return parsed.prompt_ids
        small = (len(parsed.prompt_text) if parsed.messages is None else
                 sum(len(str(m.get("content") or "")) for m in parsed.messages)) <= INLINE_TOKENIZE_CHARS
        if small:  # cheaper here than the two thread wakeups of a pool hop
            if parsed.messages is not None:
                return tokenizer.encode_chat(parsed.messages)
            return tokenizer.encode(parsed.prompt_text)
        loop = asyncio.get_running_loop()
        if parsed.messages is not None:
            return await loop.run_in_executor(self.pool, tokenizer.encode_chat, parsed.messages)
        return await loop.run_in_executor(self.pool, tokenizer.encode, parsed.prompt_text)

    async def _run(self, request: web.Request, parsed: Parsed, job: Job) -> web.StreamResponse:
        assert self._tokenizer is not None
        collector = Collector(self._tokenizer.make_detokenizer(), parsed.stop, len(job.prompt_ids))
        # The response id ends with the request id, so a client can quote either.
        prefix = "chatcmpl-" if parsed.kind == "chat" else "cmpl-"
        fmt = Formatter(parsed, prefix + job.request_id, self.model_id)
        self.num_in_flight += 1
        try:
            if parsed.stream:
                try:
                    return await self._stream(request, job, collector, fmt, parsed.include_usage)
                except SlowReader as exc:
                    return exc.response  # the job is cancelled below, its row freed
            return await self._collect(job, collector, fmt)
        finally:
            self.num_in_flight -= 1
            client_left = job.state is not JobState.DONE
            self.dispatcher.cancel(job)  # no-op when done; frees the row when the client left
            self._observe(job, collector, client_left)

    def _observe(self, job: Job, collector: Collector, client_left: bool) -> None:
        """Metrics, and the one INFO line per request (no prompt text at INFO)."""
        now = time.monotonic()
        queued_s = (job.dispatched_at or now) - job.enqueued_at
        ttft_s = (job.first_token_at - job.enqueued_at) if job.first_token_at else None
        if job.dispatched_at is not None:
            self.metrics.queue_wait.observe(queued_s)
        if ttft_s is not None:
            self.metrics.ttft.observe(ttft_s)
            self.metrics.history.note_ttft(time.time(), ttft_s)
        outcome = "client gone" if client_left and not collector.finished else (
            collector.finish_reason or "error")
        log.info("finished: %s, prompt %d tokens, completion %d tokens, queued %.3fs, ttft %s, "
                 "total %.3fs", outcome, len(job.prompt_ids), collector.completion_tokens, queued_s,
                 f"{ttft_s:.3f}s" if ttft_s is not None else "-", now - job.enqueued_at,
                 extra=about(job.request_id, job.incarnation))

    async def _collect(self, job: Job, collector: Collector, fmt: Formatter) -> web.Response:
        while not collector.finished:
            event = await job.events.get()
            if isinstance(event, HeadroomError):
                raise event
            collector.feed(event)
        return web.json_response(fmt.full(collector))

    async def _stream(self, request: web.Request, job: Job, collector: Collector, fmt: Formatter,
                      include_usage: bool) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        while not collector.finished:
            try:
                async with asyncio.timeout(KEEPALIVE_S):
                    event = await job.events.get()
            except TimeoutError:
                response = response or await self._start_stream(request)
                await self._write(request, response, b": keepalive\n\n")
                continue
            if isinstance(event, HeadroomError):
                if response is None:
                    raise event  # nothing sent yet: a plain HTTP error is clearer
                await self._write(request, response,
                                  sse(event.to_body(), event="error") + b"data: [DONE]\n\n")
                return response
            response = response or await self._start_stream(request)
            chunk = self._drain(job, collector, fmt, event)
            if chunk is not None:
                await self._write(request, response, chunk)
        assert response is not None
        tail = sse(fmt.final_chunk(collector))
        if include_usage:
            tail += sse(fmt.usage_chunk(collector))
        await self._write(request, response, tail + b"data: [DONE]\n\n")
        return response

    async def _write(self, request: web.Request, response: web.StreamResponse, data: bytes) -> None:
        """Write to the stream; a client that leaves the buffer full too long is dropped.

        ``write`` waits while the transport holds more than --stream-buffer-bytes, so a
        client that stops reading cannot make the router hold its output without bound; past
        --slow-reader-timeout the request is cancelled (``_run`` frees its worker row) and
        the connection closed.
        """
        transport = request.transport
        try:
            async with asyncio.timeout(self.limits.slow_reader_timeout_s):
                await response.write(data)
                # aiohttp waits for the socket only every 64 KiB written; hold to our bound.
                while transport is not None and \
                        transport.get_write_buffer_size() > self.limits.stream_buffer_bytes:
                    await asyncio.sleep(DRAIN_POLL_S)
        except TimeoutError:
            self.metrics.slow_readers.inc()
            log.info("dropping a stream whose client stopped reading for %.0fs",
                     self.limits.slow_reader_timeout_s)
            if transport is not None:
                transport.abort()
            raise SlowReader(response) from None

    def _drain(self, job: Job, collector: Collector, fmt: Formatter, event: TokenEvent) -> bytes | None:
        """Feed this event and any already waiting, and return one SSE write for them."""
        collector.feed(event)
        while not collector.finished and not job.events.empty():
            more = job.events.get_nowait()
            if isinstance(more, HeadroomError):
                job.events.put_nowait(more)  # keep it for the loop: flush the text first
                break
            collector.feed(more)
        delta = collector.take_delta()
        if not delta and not fmt.needs_first_chunk():
            return None
        return sse(fmt.chunk(delta))

    async def _start_stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers=SSE_HEADERS)
        await response.prepare(request)
        sock = request.transport.get_extra_info("socket") if request.transport else None
        if sock is not None:
            # The kernel's send buffer autotunes to megabytes for a peer that does not read;
            # a token stream needs far less, and this keeps the whole buffer bounded.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.limits.stream_buffer_bytes)
        return response
