"""The request path every API shares: parse, validate, admit, enqueue, stream.

Each HTTP API is an `Endpoint`: its parser, which turns a body into the internal request
(`Parsed`), and its presenter, which turns the output back into that API's shapes. The
OpenAI endpoints are here; router/anthropic_api.py and router/responses_api.py add theirs,
so queueing, admission, cancellation, keepalives and worker loss are one code path.

Handlers raise ``HeadroomError``s; the middleware from ``make_error_middleware`` is the one
place that turns any error into HTTP, with the right status and ``Retry-After``, in the
error shape of the API whose path was called (OpenAI's unless another claims the prefix).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from common.errors import (
    BadRequest, HeadroomError, NoWorker, PayloadTooLarge, QueueTimeout, RequestQuarantined,
    Unauthorized,
)
from router import admission
from common.protocol import Hello
from router.dispatch import Dispatcher
from router.job import Job, JobState, TokenEvent
from router.output import ChatPresenter, Collector, Formatter, Presenter
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
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


# An API's error body for an error (OpenAI's is HeadroomError.to_body).
ErrorBody = Callable[[HeadroomError], dict[str, Any]]


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
            error: HeadroomError = exc
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


def error_headers(exc: HeadroomError) -> dict[str, str]:
    headers: dict[str, str] = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(exc.retry_after_s)
    if isinstance(exc, RequestQuarantined):
        headers["x-should-retry"] = "false"
    return headers


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One HTTP API's two ends of the shared path."""

    name: str                                        # metrics label and log name
    id_prefix: str                                   # of the request id the client sees
    parse: Callable[[Any, int], Parsed]              # (body, default max_tokens) -> Parsed
    present: Callable[[Any, Parsed, Job, str], Presenter]  # (body, parsed, job, model id)


def _openai_presenter(body: Any, parsed: Parsed, job: Job, model_id: str) -> Presenter:
    return ChatPresenter(Formatter(parsed, job.request_id, model_id))


CHAT = Endpoint("chat", "chatcmpl-", parse_chat, _openai_presenter)
COMPLETIONS = Endpoint("completions", "cmpl-", parse_completion, _openai_presenter)


def _log_preload_failure(task: asyncio.Future[RouterTokenizer]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("could not load the tokenizer: %s", task.exception())


class Api:
    """The OpenAI-compatible endpoints."""

    def __init__(self, *, dispatcher: Dispatcher, metrics: Metrics, model_id: str,
                 default_max_tokens: int, queue_timeout_s: float, api_key: str | None,
                 is_draining: Callable[[], bool]) -> None:
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.model_id = model_id
        self.default_max_tokens = default_max_tokens
        self.queue_timeout_s = queue_timeout_s
        self.api_key = api_key
        self.is_draining = is_draining
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self._tokenizer: RouterTokenizer | None = None
        self._tokenizer_path: str | None = None
        self._tokenizer_lock = asyncio.Lock()
        self._tokenizer_task: asyncio.Future[RouterTokenizer] | None = None
        self.num_in_flight = 0

    def check_auth(self, request: web.Request) -> None:
        """``Authorization: Bearer KEY`` (OpenAI clients) or ``x-api-key: KEY`` (Anthropic's)."""
        if self.api_key is None:
            return
        expected = self.api_key.encode()
        bearer = request.headers.get("Authorization", "")
        offered = [request.headers.get("x-api-key", ""),
                   bearer[7:] if bearer[:7].lower() == "bearer " else ""]
        # compare_digest on each, never short-circuited: the time says nothing about the key
        matches = [hmac.compare_digest(key.encode(), expected) for key in offered]
        if not any(matches):
            raise Unauthorized("missing or invalid API key (Authorization: Bearer ... or x-api-key)")

    async def models(self, request: web.Request) -> web.Response:
        self.check_auth(request)
        # OpenAI's list and Anthropic's in one body: each client reads its fields, ignores the rest
        model = {"id": self.model_id, "object": "model", "created": 0, "owned_by": "headroom",
                 "type": "model", "display_name": self.model_id,
                 "created_at": "1970-01-01T00:00:00Z"}
        return web.json_response({"object": "list", "data": [model], "has_more": False,
                                  "first_id": self.model_id, "last_id": self.model_id})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, CHAT)

    async def serve(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        """The whole life of one generation request, for any API."""
        arrived = time.monotonic()
        status = 500
        try:
            self.check_auth(request)
            if self.is_draining():
                raise NoWorker("the server is shutting down")
            body = await self._json(request)
            parsed = endpoint.parse(body, self.default_max_tokens)
            job = await self._admit(parsed, arrived, endpoint.id_prefix)
            present = endpoint.present(body, parsed, job, self.model_id)
            response = await self._run(request, parsed, job, present)
            status = response.status
            return response
        except HeadroomError as exc:
            status = exc.status
            if exc.status != 500:
                self.metrics.rejections.labels(code=exc.code).inc()
            log.info("request refused on /v1/%s: %d %s: %s", endpoint.name, exc.status, exc.code,
                     exc.message)
            raise
        finally:
            self.metrics.requests.labels(endpoint=endpoint.name, status=str(status)).inc()

    async def count_prompt_tokens(self, request: web.Request,
                                  parse: Callable[[Any, int], Parsed]) -> int:
        """The prompt tokens ``serve`` would admit for this body, with the same tokenizer."""
        self.check_auth(request)
        parsed = parse(await self._json(request), self.default_max_tokens)
        tokenizer, _ = await self._tokenizer_for(time.monotonic() + self.queue_timeout_s)
        return len(await self._tokenize(tokenizer, parsed))

    async def _json(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("the request body is not valid JSON") from None

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
                self._tokenizer = await loop.run_in_executor(self.pool, RouterTokenizer.load, path)
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

    async def _admit(self, parsed: Parsed, arrived: float, id_prefix: str) -> Job:
        deadline = arrived + self.queue_timeout_s
        tokenizer, link = await self._tokenizer_for(deadline)
        # Never-fits by max_tokens alone needs no tokenizing (a prompt has ≥ 1 token).
        error = admission.check_max_tokens_only(link.model, link.hello.admission,
                                                parsed.sampling.max_tokens)
        if error is None:
            ids = await self._tokenize(tokenizer, parsed)
            error = admission.check_ever(link.model, link.hello.admission, len(ids),
                                         parsed.sampling.max_tokens)
        if error is not None:
            raise error
        job = Job(request_id=id_prefix + uuid.uuid4().hex, prompt_ids=ids, sampling=parsed.sampling,
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

    async def _run(self, request: web.Request, parsed: Parsed, job: Job,
                   present: Presenter) -> web.StreamResponse:
        assert self._tokenizer is not None
        collector = Collector(self._tokenizer.make_detokenizer(), parsed.stop, len(job.prompt_ids))
        self.num_in_flight += 1
        try:
            if parsed.stream:
                return await self._stream(request, job, collector, present)
            return await self._collect(job, collector, present)
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
        outcome = "client gone" if client_left and not collector.finished else (
            collector.finish_reason or "error")
        log.info("request %s: %s, prompt %d tokens, completion %d tokens, queued %.3fs, "
                 "ttft %s, total %.3fs", job.request_id, outcome, len(job.prompt_ids),
                 collector.completion_tokens, queued_s,
                 f"{ttft_s:.3f}s" if ttft_s is not None else "-", now - job.enqueued_at)

    async def _collect(self, job: Job, collector: Collector, present: Presenter) -> web.Response:
        while not collector.finished:
            event = await job.events.get()
            if isinstance(event, HeadroomError):
                raise event
            collector.feed(event)
        return web.json_response(present.body([collector], len(job.prompt_ids)))

    async def _stream(self, request: web.Request, job: Job, collector: Collector,
                      present: Presenter) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        while not collector.finished:
            try:
                async with asyncio.timeout(KEEPALIVE_S):
                    event = await job.events.get()
            except TimeoutError:
                response = response or await self._start_stream(request)
                await response.write(present.keepalive())
                continue
            if isinstance(event, HeadroomError):
                if response is None:
                    raise event  # nothing sent yet: a plain HTTP error is clearer
                await response.write(present.error(event))
                return response
            response = response or await self._start_stream(request)
            chunk = self._drain(job, collector, present, event)
            if chunk:
                await response.write(chunk)
        assert response is not None
        await response.write(present.tail([collector], len(job.prompt_ids)))
        return response

    def _drain(self, job: Job, collector: Collector, present: Presenter, event: TokenEvent) -> bytes:
        """Feed this event and any already waiting, and return one SSE write for them."""
        collector.feed(event)
        while not collector.finished and not job.events.empty():
            more = job.events.get_nowait()
            if isinstance(more, HeadroomError):
                job.events.put_nowait(more)  # keep it for the loop: flush the text first
                break
            collector.feed(more)
        return present.delta(collector)

    async def _start_stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers=SSE_HEADERS)
        await response.prepare(request)
        return response
