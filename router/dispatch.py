"""ZeroMQ to the worker: send what it has room for, route its answers back to jobs.

The router binds a ROUTER socket; workers connect with DEALER sockets (a main one and a
heartbeat one). Everything a worker sends carries its incarnation; frames from any
incarnation but the current one are dropped. When a worker is lost, every job it held is
answered at once (or re-queued, if it had produced nothing and was not yet retried).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from common.costmodel import CostModel
from common.log import about
from common.errors import (
    BadRequest, ConfigError, ContextLengthExceeded, InsufficientMemory, MemoryPressure, NoWorker,
    ProtocolError, QueueTimeout, RequestQuarantined, WorkerLost,
)
from common.protocol import (
    MAX_FRAME_BYTES, PROTOCOL_VERSION, Cancel, FinishReason, Generate, Heartbeat, Hello,
    Reject, RejectReason, Shutdown, Status, Tokens, decode, encode, peek_hello,
)
from router import admission
from router.backlog import Backlog
from router.curve import CurveServer
from router.job import Job, JobState, TokenEvent
from router.quarantine import Quarantine

log = logging.getLogger(__name__)

# Backlog deadlines are checked this often.
EXPIRY_INTERVAL_S = 0.25
# Most frames handled per wakeup before yielding to the HTTP side.
MAX_DRAIN = 256


@dataclass(slots=True)
class WorkerLink:
    """The router's live view of one worker incarnation."""

    hello: Hello
    identity: bytes
    model: CostModel
    connected_at: float
    status: dict[str, Any] | None = None
    status_at: float = 0.0
    heartbeat_at: float = 0.0
    step: int = 0
    step_changed_at: float = 0.0
    has_work: bool = False
    held: bool = False
    in_flight: dict[str, Job] = field(default_factory=dict)

    @property
    def incarnation(self) -> int:
        return self.hello.incarnation

    @property
    def max_running(self) -> int:
        if self.status and isinstance(self.status.get("max_running_requests"), int):
            return self.status["max_running_requests"]
        return 1


class Dispatcher:
    """Owns the socket, the backlog and the in-flight jobs of the current worker."""

    def __init__(self, addr: str, backlog: Backlog, metrics: Any,
                 clock: Callable[[], float] = time.monotonic,
                 curve: CurveServer | None = None) -> None:
        self.addr = addr
        self.backlog = backlog
        self.metrics = metrics
        self.clock = clock
        self.quarantine = Quarantine()
        self.curve = curve
        self.link: WorkerLink | None = None
        self.num_bad_frames = 0
        self.hello_listeners: list[Callable[[Hello], None]] = []
        self.on_shutdown: Callable[[int, str], None] = lambda incarnation, reason: None
        self.ready = asyncio.Event()          # set while a worker has said hello
        self.unavailable: str | None = None   # why no worker will come (failed, draining)
        self.refused: dict[str, Any] | None = None  # the last worker refused for its version
        # A plain (synchronous) socket read from the event loop's reader callback: no
        # Future per message or per wakeup on the token path, and a failed send raises
        # here instead of in a Future nobody awaits.
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._sock.setsockopt(zmq.SNDHWM, 10_000)
        self._sock.setsockopt(zmq.RCVHWM, 10_000)
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_scheduled = False

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        if self.curve is not None:
            self.curve.secure(self._ctx, self._sock)
        elif self.addr.startswith("tcp://"):  # config refuses it too; never bind it open
            raise ConfigError(f"refusing to bind {self.addr} without CURVE keys")
        self._sock.bind(self.addr)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.FD, self._on_readable)
        self._tasks = [asyncio.create_task(self._expiry_loop(), name="dispatch-expiry")]
        self._on_readable()  # anything that arrived before the reader was registered

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._loop is not None:
            self._loop.remove_reader(self._sock.FD)
        if self.curve is not None:
            await self.curve.stop(self._sock)
        self._sock.close(0)
        self._ctx.term()

    # -- requests --------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        if self.unavailable is not None:
            raise NoWorker(self.unavailable)
        if self.quarantine.is_quarantined(job.fingerprint(), self.clock()):
            raise RequestQuarantined(
                "this request was running when the worker died twice; it is quarantined")
        self.backlog.push(job)
        log.debug("queued: %d prompt tokens, max_tokens %d, %d waiting", len(job.prompt_ids),
                  job.sampling.max_tokens, len(self.backlog), extra=about(job.request_id))
        self.pump()

    def cancel(self, job: Job) -> None:
        """The client is gone or a stop string matched: free the job's queue slot or row."""
        if job.state is JobState.QUEUED:
            if self.backlog.remove(job.request_id):
                self.metrics.cancelled.labels(where="queued").inc()
                log.debug("cancelled while queued", extra=about(job.request_id))
        elif job.state is JobState.RUNNING and self.link and job.incarnation == self.link.incarnation:
            if self.link.in_flight.pop(job.request_id, None) is not None:
                self._send(Cancel(incarnation=self.link.incarnation, request_id=job.request_id))
                self.metrics.cancelled.labels(where="running").inc()
                log.debug("cancelled while running", extra=about(job.request_id, job.incarnation))
        job.state = JobState.DONE
        self.pump()

    def pump(self) -> None:
        """Send queued jobs, in order, while the worker has room for them."""
        link = self.link
        while link is not None and self.backlog:
            job = self.backlog.peek()
            assert job is not None
            view = admission.WorkerView(
                model=link.model, admission=link.hello.admission, max_running=link.max_running,
                report_age_s=self.clock() - link.status_at, held=link.held)
            totals = [j.total_tokens for j in link.in_flight.values()]
            if admission.can_dispatch(view, totals, len(job.prompt_ids), job.sampling.max_tokens) \
                    is not admission.Verdict.DISPATCH:
                return
            self.backlog.pop()
            self._dispatch(link, job)

    def _dispatch(self, link: WorkerLink, job: Job) -> None:
        job.state = JobState.RUNNING
        job.incarnation = link.incarnation
        job.num_dispatches += 1
        job.dispatched_at = self.clock()
        if not link.in_flight:
            link.step_changed_at = job.dispatched_at  # idle until now: start the stall clock
        link.in_flight[job.request_id] = job
        self.metrics.dispatched.inc()
        log.debug("dispatched (try %d) after %.3fs queued", job.num_dispatches,
                  job.dispatched_at - job.enqueued_at, extra=about(job.request_id, link.incarnation))
        s = job.sampling
        self._send(Generate(incarnation=link.incarnation, request_id=job.request_id,
                            prompt_ids=job.prompt_ids, max_tokens=s.max_tokens, sampling=s.params,
                            boundaries=job.boundaries))

    def _send(self, msg: Any) -> None:
        link = self.link
        if link is None:
            return
        try:
            self._sock.send_multipart([link.identity, encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY) or queue full
            request_id = getattr(msg, "request_id", None)
            log.warning("send %s to worker %d failed: %s", msg.type, link.incarnation, exc,
                        extra=about(request_id, link.incarnation) if request_id else None)
        self._check_readable()

    # -- worker lifecycle ------------------------------------------------------------

    def set_unavailable(self, reason: str | None) -> None:
        """No worker will come until an operator acts: answer the queue now, not at timeout."""
        self.unavailable = reason
        if reason is None:
            if self.link is None:
                self.ready.clear()
            return
        while self.backlog:
            self.backlog.pop().fail(NoWorker(reason))
        self.ready.set()  # wake requests waiting for a hello; they will see `unavailable`

    def request_shutdown(self, reason: str) -> None:
        """Ask the current worker to finish up and exit (it is ours to stop)."""
        if self.link is not None:
            self._send(Shutdown(incarnation=self.link.incarnation, reason=reason))

    def send_heartbeat(self) -> None:
        if self.link is not None:
            self._send(Heartbeat(incarnation=self.link.incarnation))

    def worker_lost(self, incarnation: int, why: str) -> bool:
        """Answer or re-queue every job of a dead worker. True if a quarantined prompt is to blame."""
        link = self.link
        if link is None or link.incarnation != incarnation:
            return False
        self.link = None
        self.ready.clear()
        jobs = list(link.in_flight.values())
        now = self.clock()
        newly = self.quarantine.record_death({j.fingerprint() for j in jobs}, now)
        for job in reversed(jobs):  # reversed + push_front keeps their original order
            if job.fingerprint() in newly:
                job.fail(RequestQuarantined(
                    "this request was running at two worker deaths and is quarantined; "
                    "it is likely what kills the worker"))
            elif job.num_output_tokens == 0 and job.num_dispatches < 2:
                log.debug("re-queued: its worker was lost before its first token",
                          extra=about(job.request_id, incarnation))
                self.backlog.push_front(job)
            else:
                job.fail(WorkerLost(f"the worker died while running this request ({why}); "
                                    "it is being restarted, retry shortly"))
        log.warning("worker %d lost (%s): %d in flight, %d quarantined", incarnation, why,
                    len(jobs), len(newly))
        return bool(newly)

    # -- input -----------------------------------------------------------------------

    def _on_readable(self) -> None:
        """Drain what is waiting, a bounded batch at a time so the loop is never starved.

        ZeroMQ's FD is edge-triggered: it signals once for a batch and again only after
        the socket was read dry (or its EVENTS were read), so a drain that stops early
        schedules itself again, and a send checks EVENTS (``_check_readable``).
        """
        self._drain_scheduled = False
        for _ in range(MAX_DRAIN):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                log.error("router socket error: %s", exc)
                return
            self._on_frames(frames)
        self._schedule_drain()

    def _check_readable(self) -> None:
        try:
            readable = bool(self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)
        except zmq.ZMQError:
            return
        if readable:
            self._schedule_drain()

    def _schedule_drain(self) -> None:
        if self._loop is not None and not self._drain_scheduled:
            self._drain_scheduled = True
            self._loop.call_soon(self._on_readable)

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self._count_bad("wrong number of frames")
            return
        identity, payload = frames
        try:
            msg = decode(payload)
        except ProtocolError as exc:
            self._count_bad(exc.message)
            self._note_mismatch(payload)
            return
        try:
            self._handle(identity, msg)
        except Exception:  # a bug in one handler must not end the receive loop
            log.exception("error handling a %s message", msg.type)

    def _note_mismatch(self, frame: bytes) -> None:
        """A worker speaking another protocol version is refused, and shown in /health."""
        hello = peek_hello(frame)
        if hello is None or hello.get("v") == PROTOCOL_VERSION:
            return
        if self.refused != hello:
            log.error("refused a worker (pid %s, version %s) speaking protocol %s; this router "
                      "speaks %d: upgrade one of them", hello.get("pid"),
                      hello.get("package_version"), hello.get("v"), PROTOCOL_VERSION)
        self.refused = hello

    def _count_bad(self, why: str) -> None:
        self.num_bad_frames += 1
        self.metrics.bad_frames.inc()
        log.warning("dropped a bad frame from a worker (%d so far): %s", self.num_bad_frames, why)

    def _handle(self, identity: bytes, msg: Any) -> None:
        if isinstance(msg, Hello):
            self._on_hello(identity, msg)
            return
        link = self.link
        if link is None or msg.incarnation != link.incarnation:
            return  # from an old incarnation, or before its hello
        now = self.clock()
        link.heartbeat_at = now
        if isinstance(msg, Tokens):
            self._on_tokens(link, msg)
        elif isinstance(msg, Status):
            link.status, link.status_at, link.held = msg.report, now, False
            if isinstance(msg.report.get("cost_model"), dict):
                # The worker grows its model when it measures more than it predicted.
                model = CostModel.from_dict(msg.report["cost_model"])
                if model != link.model:
                    link.model = model
                    self.recheck_queued(link)
            self.pump()
        elif isinstance(msg, Heartbeat):
            # The stall clock runs only while work waits: it restarts when the counter moves
            # and when an idle worker becomes busy (an idle worker's counter stands still).
            if msg.step != link.step or (msg.has_work and not link.has_work):
                link.step, link.step_changed_at = msg.step, now
            link.has_work = msg.has_work
        elif isinstance(msg, Reject):
            self._on_reject(link, msg)
        elif isinstance(msg, Shutdown):
            self.on_shutdown(link.incarnation, msg.reason)

    def _on_hello(self, identity: bytes, hello: Hello) -> None:
        if self.link is not None and self.link.incarnation == hello.incarnation:
            return  # a duplicate hello (e.g. resent after reconnect)
        if self.link is not None:
            self.worker_lost(self.link.incarnation, "replaced by a new incarnation")
        now = self.clock()
        self.link = WorkerLink(hello=hello, identity=identity, model=CostModel.from_dict(hello.cost_model),
                               connected_at=now, heartbeat_at=now, step_changed_at=now)
        log.info("worker %d (pid %d) ready: model %s, context %d, admission %s", hello.incarnation,
                 hello.pid, hello.model_id, hello.context_length, "on" if hello.admission else "OFF")
        self.ready.set()
        for listener in self.hello_listeners:
            listener(hello)
        self.recheck_queued(self.link)
        self.pump()

    def recheck_queued(self, link: WorkerLink) -> None:
        """The cost model, budget or limit changed: a queued request that can now never fit
        is answered at once, never left to wait for a condition that cannot change."""
        refused: dict[str, BadRequest] = {}

        def never(job: Job) -> bool:
            error = admission.check_ever(link.model, link.hello.admission, len(job.prompt_ids),
                                         job.sampling.max_tokens)
            if error is not None:
                refused[job.request_id] = error
            return error is not None

        for job in self.backlog.remove_where(never):
            log.info("can no longer fit (cost model scale %.3f, budget %d B); refused",
                     link.model.scale, link.model.budget_bytes, extra=about(job.request_id))
            job.fail(refused[job.request_id])

    def _on_tokens(self, link: WorkerLink, msg: Tokens) -> None:
        now = self.clock()
        for row in msg.outputs:
            if not (isinstance(row, list) and len(row) in (3, 4) and isinstance(row[0], str)):
                self._count_bad("bad tokens row")
                continue
            request_id, ids, finish = row[:3]
            logprobs = row[3] if len(row) == 4 and isinstance(row[3], list) else None
            job = link.in_flight.get(request_id)
            if job is None:
                continue  # cancelled here already
            if job.first_token_at is None:
                job.first_token_at = now
                log.debug("first token after %.3fs", now - job.enqueued_at,
                          extra=about(request_id, link.incarnation))
            job.num_output_tokens += len(ids)
            if finish == FinishReason.ERROR:
                del link.in_flight[request_id]
                job.fail(WorkerLost("the worker failed this request (memory error); retry shortly"))
                continue
            if finish == FinishReason.EVICTED:
                del link.in_flight[request_id]
                job.fail(MemoryPressure("another process took the memory this request was "
                                        "promised; it was stopped, retry shortly"))
                continue
            if finish is not None:
                del link.in_flight[request_id]
                job.state = JobState.DONE
            job.events.put_nowait(TokenEvent(ids, finish, logprobs, msg.cached_tokens.get(request_id, 0)))
        self.metrics.generated_tokens.inc(sum(len(r[1]) for r in msg.outputs if len(r) in (3, 4)))

    def _on_reject(self, link: WorkerLink, msg: Reject) -> None:
        job = link.in_flight.pop(msg.request_id, None)
        if job is None:
            return
        self.metrics.worker_rejects.labels(reason=msg.reason).inc()
        log.debug("worker said %s: %s", msg.reason, msg.message,
                  extra=about(msg.request_id, link.incarnation))
        if msg.reason == RejectReason.NOT_NOW:
            link.held = True  # our view was stale: wait for a fresh report before sending more
            job.num_dispatches -= 1
            self.backlog.push_front(job)
            return
        error: BadRequest
        if msg.reason == RejectReason.NEVER_FITS and msg.needed_bytes:
            error = InsufficientMemory(msg.message, param="max_tokens", needed_bytes=msg.needed_bytes,
                                       max_request_tokens=msg.max_request_tokens)
        elif msg.reason == RejectReason.NEVER_FITS:
            error = ContextLengthExceeded(msg.message, param="max_tokens")
        else:
            error = BadRequest(msg.message)
        job.fail(error)

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_INTERVAL_S)
            for job in self.backlog.expired(self.clock()):
                job.fail(QueueTimeout("the request waited in the queue past --queue-timeout"))
            self.pump()  # a fresh report may have aged out; re-evaluate
