"""The request path every API shares: parse, validate, admit, enqueue, answer.

Each HTTP API is an `Endpoint`: its parser, which turns a body into the internal request
(`Parsed`), and its presenter, which turns the output back into that API's shapes. The
OpenAI endpoints are here; router/http/anthropic_api.py and router/http/responses_api.py add theirs,
so queueing, admission, cancellation, keepalives, slow readers and worker loss are one
code path. Handlers raise ``HeadroomError``s, which router/http/http_errors.py answers;
router/http/sse.py writes the answer (a JSON body or an SSE stream).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from common.config import parse_duration
from common.errors import (
    BadRequest, ConfigError, HeadroomError, ModelNotFound, NoWorker, QueueTimeout, RequestTimeout,
)
from common.log import about, bind_model
from common.protocol import BOUNDARIES_ALL, Hello
from router.chat.plan import plan_output, template_tools
from router.chat.sampling_params import check_token_ids
from router.chat.schema import Parsed, parse_chat, parse_completion
from router.chat.tokenizer import RouterTokenizer
from router.fleet import admission
from router.fleet.dispatch import Dispatcher
from router.fleet.fleet import Fleet, Served
from router.http.limits import Limits, check_body, check_max_tokens, check_prompt_tokens
from router.http.output import ChatPresenter, Collector, Formatter, Presenter, Shown
from router.http.reqid import ROW_SEP, KEY as REQUEST_ID, make_request_id
from router.http.rows import Rows
from router.http.sse import ClientGone, Responder, SlowReader
from router.job import ROOM_LEFT, ChoiceEvents, Job, JobState, Sampling, TokenEvent
from router.ops.status import Metrics

log = logging.getLogger(__name__)
# Prompts up to this many characters are tokenized on the event loop: a few tens of
# microseconds, less than the two thread wakeups a pool hop costs (measured 0.46 -> 0.27 ms
# from arrival to queue on 2 cores). Longer ones go to the pool, where the batch encode
# releases the GIL and a huge prompt cannot stall every other stream.
INLINE_TOKENIZE_CHARS = 2048
CLIENT_CLOSED_REQUEST = 499
CLIENT_CLOSED = "client_closed"  # request key: the router dropped a client that stopped reading
# A JSON escape of a UTF-16 surrogate (\ud800-\udfff): only a body with one can hold a lone
# surrogate, which no tokenizer can encode.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def strings(value: Any) -> Iterator[str]:
    """Every string in a parsed JSON value, keys included (iterative: any depth)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            yield v
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def text_chars(value: Any) -> int:
    return sum(len(s) for s in strings(value))


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One HTTP API's two ends of the shared path."""

    name: str                                        # metrics label and log name
    id_prefix: str                                   # of the response id the client sees
    parse: Callable[[Any, int | None, int], Parsed]  # (body, default max_tokens, max n) -> Parsed
    # (body, parsed, rows, model id, tokenizer) -> the API's presenter
    present: Callable[[Any, Parsed, Rows, str, RouterTokenizer], Presenter]
    # Another API's body as the chat body it asks for: the size limits (router/http/limits.py)
    # are checked on that too, so no API's own shape (Responses' `input`, Anthropic's
    # `output_config.format`) is a way around them.
    as_chat: Callable[[Any], Any] | None = None


def _openai_presenter(body: Any, parsed: Parsed, rows: Rows, model_id: str,
                      tok: RouterTokenizer) -> Presenter:
    return ChatPresenter(Formatter(parsed, rows.request_id, model_id, tok.token_bytes))


CHAT = Endpoint("chat", "chatcmpl-", parse_chat, _openai_presenter)
COMPLETIONS = Endpoint("completions", "cmpl-", parse_completion, _openai_presenter)


def _log_preload_failure(task: asyncio.Future[RouterTokenizer]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("could not load the tokenizer: %s", task.exception())


class Api:
    """The OpenAI-compatible endpoints."""

    def __init__(self, *, dispatcher: Dispatcher, fleet: Fleet, metrics: Metrics,
                 default_max_tokens: int | None, queue_timeout_s: float, limits: Limits,
                 is_draining: Callable[[], bool], trust_remote_code: bool = False,
                 max_n: int = 1, tool_parser: str = "auto") -> None:
        self.dispatcher = dispatcher
        self.fleet = fleet
        self.metrics = metrics
        # A request that names no max_tokens gets the room left after its prompt, at most this
        # (parsers get no default: they mark it ROOM_LEFT, resolved once the prompt is tokenized)
        self.max_default_tokens = min((n for n in (default_max_tokens, limits.max_tokens)
                                       if n is not None), default=None)
        self.max_n = max_n
        self.tool_parser = tool_parser
        self.queue_timeout_s = queue_timeout_s
        self.limits = limits
        self.trust_remote_code = trust_remote_code
        self.is_draining = is_draining
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self._tokenizers: dict[str, RouterTokenizer] = {}   # by tokenizer path
        self._tokenizer_lock = asyncio.Lock()
        self._tokenizer_task: asyncio.Future[RouterTokenizer] | None = None
        self.num_in_flight = 0
        self.respond = Responder(cancel=dispatcher.cancel, limits=limits, metrics=metrics)

    async def models(self, request: web.Request) -> web.Response:
        data = self._model_entries()
        return web.json_response({"object": "list", "data": data, "has_more": False,
                                  "first_id": data[0]["id"] if data else None,
                                  "last_id": data[-1]["id"] if data else None})

    async def model(self, request: web.Request) -> web.Response:
        """One model by name (OpenAI's and Anthropic's retrieve), resolved as a request's
        ``model`` is: with one model served, any name is it."""
        served = self._resolve(request.match_info["model_id"])
        [entry] = [m for m in self._model_entries() if m["id"] == served.spec.alias]
        return web.json_response(entry)

    def _model_entries(self) -> list[dict[str, Any]]:
        # OpenAI's model object and Anthropic's in one: each client reads its fields, ignores
        # the rest; ``state`` and ``memory`` say what is loaded and what it holds.
        return [{"id": m["id"], "object": "model", "created": 0, "owned_by": "headroom",
                 "type": "model", "display_name": m["id"], "created_at": "1970-01-01T00:00:00Z",
                 **{k: v for k, v in m.items() if k != "id"}}
                for m in self.fleet.describe_models()]

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, CHAT)

    async def count_prompt_tokens(self, request: web.Request, parse: Callable[[Any, int | None, int], Parsed],
                                  as_chat: Callable[[Any], Any] | None = None) -> int:
        """The prompt tokens ``serve`` would admit for this body: same template, tools, tokenizer."""
        body = await self._json(request)
        self._check_limits(body, as_chat)
        parsed = parse(body, None, self.max_n)
        served = self._served(parsed.model)
        tokenizer = await self._tokenizer_for(served, time.monotonic() + self.queue_timeout_s)
        prompts, _, _ = await self._tokenize(tokenizer, parsed, with_boundaries=False)
        return sum(len(ids) for ids in prompts)

    def _check_limits(self, body: Any, as_chat: Callable[[Any], Any] | None) -> None:
        check_body(body, self.limits)
        if as_chat is not None and isinstance(body, dict):
            check_body(as_chat(body), self.limits)

    async def serve(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        """The whole life of one generation request, for any API."""
        arrived = time.monotonic()
        status = 500
        request_id = request.get(REQUEST_ID) or make_request_id()
        try:
            if self.is_draining():
                raise NoWorker("the server is shutting down")
            body = await self._json(request)
            self._check_limits(body, endpoint.as_chat)
            parsed = endpoint.parse(body, None, self.max_n)
            check_max_tokens(parsed.sampling.max_tokens, self.limits)
            served = self._served(parsed.model)
            self.fleet.check_fits(served)
            self.fleet.note_request(served, keep_alive_of(body))
            rows = await self._admit(served, parsed, arrived, request_id, endpoint.id_prefix)
            response = await self._run(request, body, parsed, rows, endpoint)
            status = CLIENT_CLOSED_REQUEST if request.get(CLIENT_CLOSED) else response.status
            return response
        except asyncio.CancelledError:  # the client went away (aiohttp cancels its handler)
            status = CLIENT_CLOSED_REQUEST
            raise
        except HeadroomError as exc:
            status = exc.status
            if exc.status != 500:
                self.metrics.rejections.labels(code=exc.code).inc()
                self.metrics.history.note_rejection(time.time(), request_id, endpoint.name, exc)
            # The message may quote the request: only its code at INFO.
            log.info("refused on /v1/%s: %d %s (param %s)", endpoint.name, exc.status, exc.code,
                     exc.param, extra=about(request_id))
            log.debug("refused: %s", exc.message, extra=about(request_id))
            raise
        finally:
            self.metrics.requests.labels(endpoint=endpoint.name, status=str(status)).inc()

    async def _json(self, request: web.Request) -> Any:
        try:
            async with asyncio.timeout(self.limits.request_timeout_s):
                raw = await request.read()
        except TimeoutError:
            raise RequestTimeout("the request body did not arrive within "
                                 f"{self.limits.request_timeout_s:g}s (--request-timeout)") from None
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("the request body is not valid JSON") from None
        except RecursionError:
            raise BadRequest("the request body is nested too deeply") from None
        if _SURROGATE_ESCAPE.search(raw):
            for s in strings(body):
                try:
                    s.encode("utf-8")
                except UnicodeEncodeError:
                    raise BadRequest("the request body has a lone UTF-16 surrogate (\\ud800-\\udfff) "
                                     "in a string: it is not text") from None
        return body

    def _served(self, name: str) -> Served:
        served = self._resolve(name)
        bind_model(served.spec.alias)
        return served

    def _resolve(self, name: str) -> Served:
        served = self.fleet.resolve(name)
        if served is None:
            known = ", ".join(sorted(self.fleet.models))
            raise ModelNotFound(f"the model {name!r} does not exist here; served: {known}",
                                param="model")
        return served

    def preload_tokenizer(self, hello: Hello) -> None:
        """Load the tokenizer as soon as a worker says hello, not at the first request."""
        if hello.tokenizer_path not in self._tokenizers:
            task = asyncio.ensure_future(self._load_tokenizer(hello.tokenizer_path))
            task.add_done_callback(_log_preload_failure)
            self._tokenizer_task = task

    async def import_tokenizer_backend(self) -> None:
        """While the worker boots: its hello then finds the tokenizer stack imported. Under
        the load lock: transformers' lazy module is not safe to import from two threads."""
        async with self._tokenizer_lock:
            try:
                await asyncio.get_running_loop().run_in_executor(self.pool, RouterTokenizer.import_backend)
            except ImportError as exc:  # the first load says so, with its folder
                log.warning("could not import the tokenizer stack: %s", exc)

    def has_tokenizer(self, path: str) -> bool:
        return path in self._tokenizers

    async def _load_tokenizer(self, path: str) -> RouterTokenizer:
        async with self._tokenizer_lock:
            if path not in self._tokenizers:
                loop = asyncio.get_running_loop()
                self._tokenizers[path] = await loop.run_in_executor(
                    self.pool, functools.partial(RouterTokenizer.load, path,
                                                 trust_remote_code=self.trust_remote_code))
            return self._tokenizers[path]

    async def _tokenizer_for(self, served: Served, deadline: float) -> RouterTokenizer:
        """The model's tokenizer: from its folder at once, or (a repo id, demo) from its first
        worker's hello, waiting for the load until the queue deadline."""
        alias = served.spec.alias
        d = self.dispatcher
        with self.fleet.waiting(served):
            while served.tokenizer_path is None:
                if alias in d.unavailable:
                    raise NoWorker(d.unavailable[alias])
                try:
                    async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                        await d.ready(alias).wait()
                except TimeoutError:
                    raise QueueTimeout("no worker became ready before the request's queue "
                                       "timeout") from None
                if served.tokenizer_path is None and alias not in d.unavailable:
                    d.ready(alias).clear()  # a stale wakeup: wait again
            # Still waiting: the worker loads while the tokenizer does.
            path = served.tokenizer_path
            return self._tokenizers.get(path) or await self._load_tokenizer(path)

    async def _admit(self, served: Served, parsed: Parsed, arrived: float, request_id: str,
                     id_prefix: str) -> Rows:
        """Tokenize, refuse what can never fit, and queue one job per choice (one row each).
        A model not loaded yet is checked against what its last worker published, and again
        by the dispatcher when a worker says hello."""
        if parsed.num_choices > self.dispatcher.max_queue:
            # Never queued whole: a 429 would be retried forever.
            raise BadRequest(f"{parsed.num_choices} choices (prompts x n) are more than the queue "
                             f"holds ({self.dispatcher.max_queue}, the server's --max-queue)",
                             param="n" if parsed.n > 1 else "prompt")
        deadline = arrived + self.queue_timeout_s
        tokenizer = await self._tokenizer_for(served, deadline)
        link = self.dispatcher.first_link(served.spec.alias)
        cost_model = link.cost_model if link is not None else served.cost_model
        admits = link.hello.admission if link is not None else True
        # Never-fits by max_tokens alone needs no tokenizing (a prompt has ≥ 1 token).
        error = admission.check_max_tokens_only(cost_model, admits, parsed.sampling.max_tokens) \
            if cost_model is not None else None
        if error is not None:
            raise error
        check_token_ids(parsed.sampling.params, tokenizer.vocab_size)
        prompts, prompt_text, boundaries = await self._tokenize(
            tokenizer, parsed, wanted=link.hello.boundaries if link is not None else BOUNDARIES_ALL)
        plan = plan_output(parsed, tokenizer, self.tool_parser, prompt_text)
        sampling = parsed.sampling
        if plan.grammar is not None:
            sampling = replace(sampling, params=replace(sampling.params, grammar=plan.grammar))
        room_left = sampling.max_tokens == ROOM_LEFT
        scoring = sampling.params.prompt_logprobs is not None
        row_max_tokens = []  # per prompt: a request that named no max_tokens gets the room left
        for ids in prompts:
            check_prompt_tokens(len(ids), self.limits,
                                "messages" if parsed.messages is not None else "prompt")
            max_tokens = admission.room_left(cost_model, admits, len(ids), self.max_default_tokens,
                                             served.spec.context_length) \
                if room_left else sampling.max_tokens
            error = admission.check_ever(cost_model, admits, len(ids), max_tokens, scoring=scoring) \
                if cost_model is not None else None
            if error is not None:
                raise error
            row_max_tokens.append(max_tokens)
        # The response id ends with the request id, so a client can quote either; a choice's
        # row is the request id with its index after a "#", which no client id may contain:
        # a client sending "abc-0" must not take over the row of another's request "abc".
        rows = Rows(id_prefix + request_id, prompt_tokens=sum(len(ids) for ids in prompts), plan=plan,
                    model_id=served.spec.alias, tokenizer=tokenizer)
        now = time.monotonic()
        for index in range(parsed.num_choices):
            row_id = request_id if parsed.num_choices == 1 else f"{request_id}{ROW_SEP}{index}"
            prompt = index // parsed.n
            rows.jobs.append(Job(request_id=row_id, prompt_ids=prompts[prompt],
                                 sampling=row_sampling(replace(sampling, max_tokens=row_max_tokens[prompt]),
                                                       index % parsed.n),
                                 deadline=deadline, enqueued_at=now, arrived_at=arrived,
                                 events=ChoiceEvents(rows.events, index), model=served.spec.alias,
                                 boundaries=boundaries, room_left=room_left,
                                 grammar_param=plan.grammar_param))
        try:
            for job in rows.jobs:
                if job.sampling.max_tokens == 0 and not scoring:
                    # Echo alone: the answer is the prompt, known here; no worker is asked.
                    job.state = JobState.DONE
                    job.events.put_nowait(TokenEvent([], "length"))
                else:
                    self.dispatcher.submit(job)
        except BaseException:
            self.dispatcher.cancel_all(rows.jobs)
            raise
        self.metrics.prompt_tokens.inc(rows.prompt_tokens)
        return rows

    async def _tokenize(self, tokenizer: RouterTokenizer, parsed: Parsed, *, with_boundaries: bool = True,
                        wanted: str = BOUNDARIES_ALL) -> tuple[list[list[int]], str, list[int]]:
        """Each prompt's ids, a chat's rendered text (for the output plan) and its message
        boundaries (where the worker may keep the prompt's KV for reuse: those it uses,
        ``wanted``, as its hello said)."""
        if parsed.messages is not None:
            tools = template_tools(parsed)
            # Every string the template may render: content, reasoning, tool calls' arguments.
            num_chars = text_chars(parsed.messages) + (text_chars(tools) if tools else 0)

            def render_and_encode(messages: list[dict[str, Any]]) -> tuple[list[int], str, list[int]]:
                text = tokenizer.render_chat(messages, tools, parsed.template_kwargs,
                                             continue_final=parsed.continue_final)
                ids = tokenizer.encode_rendered(text)
                ends = tokenizer.message_boundaries(messages, tools, parsed.template_kwargs, text, ids,
                                                    wanted) if with_boundaries else []
                return ids, text, ends

            ids, text, boundaries = await self._encode(render_and_encode, parsed.messages,
                                                       num_chars * (4 if with_boundaries else 1))
            return [ids], text, boundaries
        assert parsed.prompts is not None
        out = []
        for prompt in parsed.prompts:
            if isinstance(prompt, str):
                out.append(await self._encode(tokenizer.encode, prompt, len(prompt)))
            elif min(prompt) < 0 or max(prompt) >= tokenizer.vocab_size:
                raise BadRequest(f"token ids must be in [0, {tokenizer.vocab_size})", param="prompt")
            else:
                out.append(prompt)
        return out, "", []

    async def _encode(self, encode: Callable[[Any], Any], what: Any, num_chars: int) -> Any:
        if num_chars <= INLINE_TOKENIZE_CHARS:  # cheaper here than the two thread wakeups of a pool hop
            return encode(what)
        return await asyncio.get_running_loop().run_in_executor(self.pool, encode, what)

    async def _run(self, request: web.Request, body: Any, parsed: Parsed, rows: Rows,
                   endpoint: Endpoint) -> web.StreamResponse:
        tok = rows.tokenizer
        plan = rows.plan
        try:
            # The jobs are queued already: a client gone during this await (the handler is
            # cancelled) must not leave their rows running, nor free their id for reuse.
            shown = await self._shown(parsed, rows)
            collectors = [Collector(tok.make_detokenizer(plan.keep_markers), parsed.stop,
                                    len(job.prompt_ids), i, plan.parser(),
                                    inline_reasoning=not parsed.separate_reasoning, shown=shown[i])
                          for i, job in enumerate(rows.jobs)]
            present = endpoint.present(body, parsed, rows, rows.model_id, tok)
        except BaseException:
            self.dispatcher.cancel_all(rows.jobs)
            raise
        self.num_in_flight += 1
        try:
            if parsed.stream:
                try:
                    return await self.respond.stream(request, rows, collectors, present)
                except SlowReader as exc:
                    request[CLIENT_CLOSED] = True  # dropped: counted as a client that left
                    return exc.response  # the jobs are cancelled below, their rows freed
                except ClientGone:
                    # Never sent (aiohttp drops it quietly); 499, nginx's "client closed
                    # request", is what the request metric counts. The jobs are cancelled below.
                    return web.Response(status=CLIENT_CLOSED_REQUEST)
            return await self.respond.collect(rows, collectors, present)
        finally:
            self.num_in_flight -= 1
            left = [job.state is not JobState.DONE for job in rows.jobs]
            self.dispatcher.cancel_all(rows.jobs)  # no-op when done; frees the rows when the client left
            for job, collector, client_left in zip(rows.jobs, collectors, left):
                self._observe(job, collector, client_left)

    async def _shown(self, parsed: Parsed, rows: Rows) -> list[Shown | None]:
        """What each choice's answer shows of its prompt: the echoed text (a text prompt as
        sent, token ids decoded), each token's offset in it when logprobs are asked for, and
        the ids its prompt logprobs are of. The choices of one prompt share one."""
        if not parsed.echo and parsed.prompt_logprobs is None:
            return [None] * len(rows.jobs)
        tok = rows.tokenizer
        offsets_wanted = parsed.echo and parsed.sampling.params.num_logprobs is not None
        by_prompt: dict[int, Shown] = {}
        for i, job in enumerate(rows.jobs):
            prompt = i // parsed.n
            if prompt in by_prompt:
                continue
            given, ids = parsed.prompts[prompt] if parsed.prompts is not None else None, job.prompt_ids
            echo = (given if isinstance(given, str) else tok.decode(ids)) if parsed.echo else None
            offsets = await self._encode(tok.text_offsets, ids, len(ids)) if offsets_wanted else []
            by_prompt[prompt] = Shown(ids, echo, offsets, job.sampling.params.prompt_logprobs is not None)
        return [by_prompt[i // parsed.n] for i in range(len(rows.jobs))]

    def _observe(self, job: Job, collector: Collector, client_left: bool) -> None:
        """Metrics, and the one INFO line per row (no prompt text at INFO)."""
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
        # Where a first token's time went besides the worker: before the queue (parsing,
        # checks, tokenizing) and from its arrival here to its first byte on the stream.
        before_ms = (job.enqueued_at - job.arrived_at) * 1e3 if job.arrived_at is not None else None
        sent_ms = ((job.first_sent_at - job.first_token_at) * 1e3
                   if job.first_sent_at is not None and job.first_token_at is not None else None)
        log.info("finished: %s, prompt %d tokens, completion %d tokens, queued %.3fs, ttft %s, "
                 "total %.3fs (HTTP before the queue %s, first token to first byte %s)", outcome,
                 len(job.prompt_ids), collector.completion_tokens, queued_s,
                 f"{ttft_s:.3f}s" if ttft_s is not None else "-", now - job.enqueued_at,
                 f"{before_ms:.2f}ms" if before_ms is not None else "-",
                 f"{sent_ms:.2f}ms" if sent_ms is not None else "-",
                 extra=about(job.request_id, job.incarnation, job.model))


def row_sampling(sampling: Sampling, index: int) -> Sampling:
    """Choice ``index`` of a prompt (of ``n``): a seeded request gives each of a prompt's
    choices its own seed, the same for every prompt (as vLLM's), so a prompt's answer does
    not depend on where it is in a list of prompts."""
    seed = sampling.params.seed
    if index == 0 or seed is None:
        return sampling
    return replace(sampling, params=replace(sampling.params, seed=(seed + index) % 2**64))


def keep_alive_of(body: Any) -> float | None:
    """The request's ``keep_alive`` (Ollama's field): how long its model stays loaded after."""
    value = body.get("keep_alive") if isinstance(body, dict) else None
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ConfigError as exc:
        raise BadRequest(exc.message, param="keep_alive") from None
