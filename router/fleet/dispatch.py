"""Send each job to a worker of its model that has room for it; route answers back.

The channel (router/fleet/channel.py) moves frames; each worker incarnation is a link
(router/fleet/link.py); which worker gets a job is router/fleet/routing.py's choice; whether a worker
is alive is the supervisor's judgement. This module keeps the books between them: one
queue per model, the jobs in flight on each link, and what happens to them when a worker
is lost (answered at once, or re-queued for the model's other workers if it had produced
nothing and was not yet retried). Frames from an unknown incarnation are dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

from prometheus_client import Counter

from common.costmodel import CostModel
from common.errors import (
    BadRequest, ContextLengthExceeded, HeadroomError, InsufficientMemory, MemoryPressure, NoWorker,
    QueueFull, QueueTimeout, RequestFailed, RequestQuarantined, WorkerLost,
)
from common.log import about
from common.protocol import (
    Cancel, FinishReason, Generate, Heartbeat, Hello, Message, Reject, RejectReason, Shutdown,
    Status, Tokens,
)
from router.fleet import admission, routing
from router.fleet.backlog import Backlog
from router.fleet.channel import Channel
from router.fleet.link import Liveness, WorkerLink
from router.fleet.quarantine import Quarantine
from router.job import Job, JobState, TokenEvent

log = logging.getLogger(__name__)

# Backlog deadlines are checked this often.
EXPIRY_INTERVAL_S = 0.25


class DispatchMetrics(Protocol):
    """What the dispatcher counts (router/ops/status.py's Metrics has it)."""

    dispatched: Counter
    cancelled: Counter
    generated_tokens: Counter
    worker_rejects: Counter


class Dispatcher:
    """The queues per model and the jobs in flight on every worker link."""

    def __init__(self, channel: Channel, max_queue: int, metrics: DispatchMetrics,
                 clock: Callable[[], float] = time.monotonic,
                 assign: Callable[[Hello], str | None] = lambda hello: hello.model_id) -> None:
        self.max_queue = max_queue
        self.metrics = metrics
        self.clock = clock
        self.assign = assign            # hello → the model alias it serves (None: refuse it)
        self.channel = channel          # built by the composition root (app.py); started here
        self.quarantine = Quarantine()
        self.links: dict[int, WorkerLink] = {}
        self.backlogs: dict[str, Backlog] = {}
        self.hello_listeners: list[Callable[[Hello], None]] = []
        self.change_listeners: list[Callable[[str], None]] = []  # a model's work or workers changed
        self.on_shutdown: Callable[[int, str], None] = lambda incarnation, reason: None
        self.unavailable: dict[str, str] = {}   # model → why no worker will come (failed, ...)
        self._ready: dict[str, asyncio.Event] = {}
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        await self.channel.start(self._handle)
        self._tasks = [asyncio.create_task(self._expiry_loop(), name="dispatch-expiry")]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.channel.stop()

    # -- what others read ------------------------------------------------------------

    def backlog(self, model: str) -> Backlog:
        if model not in self.backlogs:
            self.backlogs[model] = Backlog(self.max_queue)
        return self.backlogs[model]

    def ready(self, model: str) -> asyncio.Event:
        """Set while a worker of ``model`` has said hello (or none will come: ``unavailable``)."""
        if model not in self._ready:
            self._ready[model] = asyncio.Event()
        return self._ready[model]

    def num_queued(self, model: str | None = None) -> int:
        if model is not None:
            return len(self.backlogs.get(model, ()))
        return sum(len(b) for b in self.backlogs.values())

    def links_of(self, model: str) -> list[WorkerLink]:
        return [link for link in self.links.values() if link.model_alias == model]

    def first_link(self, model: str) -> WorkerLink | None:
        return next(iter(self.links_of(model)), None)

    def num_in_flight(self, model: str) -> int:
        return sum(len(link.in_flight) for link in self.links_of(model))

    # -- requests --------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        reason = self.unavailable.get(job.model)
        if reason is not None:
            raise NoWorker(reason)
        if self.quarantine.is_quarantined(job.fingerprint, self.clock()):
            raise RequestQuarantined(
                "this request was running when the worker died twice; it is quarantined")
        if self.num_queued() >= self.max_queue:
            raise QueueFull(f"the queue is full ({self.max_queue} waiting); retry shortly")
        backlog = self.backlog(job.model)
        backlog.push(job)
        log.debug("queued for %s: %d prompt tokens, max_tokens %d, %d waiting", job.model,
                  len(job.prompt_ids), job.sampling.max_tokens, len(backlog),
                  extra=about(job.request_id, model=job.model))
        self._changed(job.model)
        self.pump(job.model)

    def cancel(self, job: Job) -> None:
        """The client is gone or a stop string matched: free the job's queue slot or row."""
        self.cancel_all([job])

    def cancel_all(self, jobs: Sequence[Job]) -> None:
        """Free the queue slots and rows of one request's jobs, then send what waits. One
        pump, after all of them: a pump per job would send the request's next queued row to
        a worker only to cancel it the next moment (a 512-row request: 288 Generate frames)."""
        for job in jobs:
            self._cancel(job)
        for model in dict.fromkeys(job.model for job in jobs):
            self.pump(model)

    def _cancel(self, job: Job) -> None:
        if job.state is JobState.QUEUED:
            if self.backlog(job.model).remove(job.request_id):
                self.metrics.cancelled.labels(where="queued").inc()
                log.debug("cancelled while queued", extra=about(job.request_id, model=job.model))
        elif job.state is JobState.RUNNING and job.incarnation in self.links:
            link = self.links[job.incarnation]
            if link.in_flight.pop(job.request_id, None) is not None:
                link.last_used_at = self.clock()
                self._send(link, Cancel(incarnation=link.incarnation, request_id=job.request_id))
                self.metrics.cancelled.labels(where="running").inc()
                log.debug("cancelled while running", extra=about(job.request_id, job.incarnation, job.model))
        was_done = job.state is JobState.DONE
        job.state = JobState.DONE
        if not was_done:
            self._changed(job.model)

    def pump(self, model: str | None = None) -> None:
        """Send queued jobs, in order, to the model's workers while one has room."""
        for name in [model] if model is not None else list(self.backlogs):
            backlog = self.backlogs.get(name)
            if not backlog:
                continue
            links = [link for link in self.links_of(name) if not link.retiring]
            while backlog and links:
                job = backlog.peek()
                assert job is not None
                now = self.clock()
                candidates = [routing.Candidate(link.view(now), link.totals()) for link in links]
                chosen = routing.pick(candidates, len(job.prompt_ids), job.sampling.max_tokens)
                if chosen is None:
                    break
                backlog.pop()
                self._dispatch(links[chosen], job)

    def _dispatch(self, link: WorkerLink, job: Job) -> None:
        job.state = JobState.RUNNING
        job.incarnation = link.incarnation
        job.num_dispatches += 1
        job.dispatched_at = link.last_used_at = self.clock()
        if not link.in_flight:
            link.liveness.work_started(job.dispatched_at)  # idle until now: start the stall clock
        link.in_flight[job.request_id] = job
        self.metrics.dispatched.inc()
        log.debug("dispatched (try %d) after %.3fs queued", job.num_dispatches,
                  job.dispatched_at - job.enqueued_at, extra=about(job.request_id, link.incarnation, job.model))
        s = job.sampling
        self._send(link, Generate(incarnation=link.incarnation, request_id=job.request_id,
                                  prompt_ids=job.prompt_ids, max_tokens=s.max_tokens,
                                  sampling=s.params, boundaries=job.boundaries))

    def _send(self, link: WorkerLink, msg: Message) -> None:
        link.unreachable = not self.channel.send(link.identity, msg)

    def send_to(self, incarnation: int, msg: Message) -> bool:
        """A control message (heartbeat, shutdown, trim, limit) to one worker, if linked."""
        link = self.links.get(incarnation)
        if link is None:
            return False
        self._send(link, msg)
        return True

    # -- worker lifecycle ------------------------------------------------------------

    def set_unavailable(self, model: str, reason: str | None) -> None:
        """No worker of ``model`` will come until an operator acts: answer its queue now."""
        if reason is None:
            self.unavailable.pop(model, None)
            if not self.links_of(model):
                self.ready(model).clear()
            return
        self.unavailable[model] = reason
        backlog = self.backlog(model)
        while backlog:
            backlog.pop().fail(NoWorker(reason))
        self.ready(model).set()  # wake requests waiting for a hello; they will see `unavailable`

    def fail_all(self, error: HeadroomError) -> int:
        """Answer every job, running or queued, with ``error`` (a shutdown past its drain
        deadline); running rows are cancelled on their workers. Returns how many."""
        n = 0
        for link in self.links.values():
            for request_id, job in list(link.in_flight.items()):
                del link.in_flight[request_id]
                self._send(link, Cancel(incarnation=link.incarnation, request_id=request_id))
                job.fail(error)
                n += 1
        for backlog in self.backlogs.values():
            while backlog:
                backlog.pop().fail(error)
                n += 1
        return n

    def fail_queued(self, model: str, error: BadRequest | NoWorker) -> None:
        """Answer every job waiting for ``model`` (a load that can never fit)."""
        backlog = self.backlog(model)
        while backlog:
            backlog.pop().fail(error)

    def worker_lost(self, incarnation: int, why: str, *, died: bool = True) -> bool:
        """Answer or re-queue every job of a dead worker. True if a quarantined prompt is to blame.
        ``died`` False: it was stopped (an operator's restart, an unload, a clean exit),
        which is no evidence against what it ran: nothing is counted toward quarantine."""
        link = self.links.pop(incarnation, None)
        if link is None:
            return False
        model = link.model_alias
        if not self.links_of(model):
            self.ready(model).clear()
        jobs = list(link.in_flight.values())
        now = self.clock()
        newly = self.quarantine.record_death({j.fingerprint() for j in jobs}, now) if died else set()
        backlog = self.backlog(model)
        for job in reversed(jobs):  # reversed + push_front keeps their original order
            if job.fingerprint() in newly:
                job.fail(RequestQuarantined(
                    "this request was running at two worker deaths and is quarantined; "
                    "it is likely what kills the worker"))
            elif job.num_output_tokens == 0 and job.num_dispatches < 2:
                log.debug("re-queued: its worker was lost before its first token",
                          extra=about(job.request_id, incarnation, job.model))
                backlog.push_front(job)
            else:
                # Only the cause's name: an external worker's reason may carry its
                # exception text (paths, values), which belongs in the log, not to clients.
                what = "died" if died else "was stopped"
                job.fail(WorkerLost(f"the worker {what} while running this request "
                                    f"({why.split(':')[0]}); it is being restarted, retry shortly"))
        log.warning("worker %d (%s) lost (%s): %d in flight, %d quarantined", incarnation, model,
                    why, len(jobs), len(newly))
        self._changed(model)
        self.pump(model)  # the model's other workers take what was re-queued
        return bool(newly)

    def _changed(self, model: str) -> None:
        for listener in self.change_listeners:
            listener(model)

    # -- input -----------------------------------------------------------------------

    def _handle(self, identity: bytes, msg: Message) -> None:
        if isinstance(msg, Hello):
            self._on_hello(identity, msg)
            return
        link = self.links.get(msg.incarnation)
        if link is None:
            return  # from an old incarnation, or before its hello
        now = self.clock()
        link.liveness.heard(now)
        link.unreachable = False
        if isinstance(msg, Tokens):
            self._on_tokens(link, msg)
        elif isinstance(msg, Status):
            self._on_status(link, msg, now)
        elif isinstance(msg, Heartbeat):
            link.liveness.beat(msg.step, msg.has_work, now)
        elif isinstance(msg, Reject):
            self._on_reject(link, msg)
        elif isinstance(msg, Shutdown):
            self.on_shutdown(link.incarnation, msg.reason)

    def _on_hello(self, identity: bytes, hello: Hello) -> None:
        known = self.links.get(hello.incarnation)
        if known is not None:
            known.identity = identity  # a duplicate hello (e.g. resent after reconnect)
            return
        model = self.assign(hello)
        if model is None:
            log.warning("worker %d (pid %d) serves %s, which no model here matches; ignored",
                        hello.incarnation, hello.pid, hello.model_id)
            return
        for old in [link for link in self.links.values() if link.identity == identity]:
            self.worker_lost(old.incarnation, "replaced by a new incarnation")
        now = self.clock()
        link = WorkerLink(hello=hello, identity=identity, model_alias=model,
                          cost_model=CostModel.from_dict(hello.cost_model), connected_at=now,
                          liveness=Liveness(heard_at=now, step_changed_at=now), last_used_at=now)
        self.links[hello.incarnation] = link
        log.info("worker %d (pid %d) ready: model %s (%s), context %d, admission %s",
                 hello.incarnation, hello.pid, model, hello.model_id, hello.context_length,
                 "on" if hello.admission else "OFF")
        self.ready(model).set()
        for listener in self.hello_listeners:
            listener(hello)
        self.recheck_queued(link)
        self._changed(model)
        self.pump(model)

    def _on_status(self, link: WorkerLink, msg: Status, now: float) -> None:
        link.status, link.status_at, link.held = msg.report, now, False
        if msg.report.cost_model:
            # The worker grows its model when it measures more than it predicted.
            model = CostModel.from_dict(msg.report.cost_model)
            if model != link.cost_model:
                link.cost_model = model
                self.recheck_queued(link)
        self.pump(link.model_alias)

    def recheck_queued(self, link: WorkerLink) -> None:
        """The cost model, budget or limit changed: a queued request that can now never fit
        is answered at once, never left to wait for a condition that cannot change."""
        refused: dict[str, BadRequest] = {}
        if any(other.cost_model.budget_bytes > link.cost_model.budget_bytes
               for other in self.links_of(link.model_alias)):
            return  # a larger replica may still take it

        def never(job: Job) -> bool:
            if job.room_left:  # it asked for no number: the room is what fits now
                shrink_to(job, admission.room_left(link.cost_model, link.hello.admission,
                                                   len(job.prompt_ids), job.sampling.max_tokens))
            error = admission.check_ever(link.cost_model, link.hello.admission,
                                         len(job.prompt_ids), job.sampling.max_tokens)
            if error is not None:
                refused[job.request_id] = error
            return error is not None

        for job in self.backlog(link.model_alias).remove_where(never):
            log.info("can no longer fit (cost model scale %.3f, budget %d B); refused",
                     link.cost_model.scale, link.cost_model.budget_bytes,
                     extra=about(job.request_id, model=job.model))
            job.fail(refused[job.request_id])

    def _on_tokens(self, link: WorkerLink, msg: Tokens) -> None:
        now = self.clock()
        finished = False
        for row in msg.outputs:  # rows the decoder checked, a TokenRow each
            request_id, ids, finish = row.request_id, row.token_ids, row.finish_reason
            job = link.in_flight.get(request_id)
            if job is None:
                continue  # cancelled here already
            if job.first_token_at is None:
                job.first_token_at = now
                log.debug("first token after %.3fs", now - job.enqueued_at,
                          extra=about(request_id, link.incarnation, link.model_alias))
            # A prompt's logprobs are output too: a job that sent them is never retried
            job.num_output_tokens += len(ids) + (row.prompt_logprobs is not None)
            if finish is not None:
                del link.in_flight[request_id]
                link.last_used_at, finished = now, True
            if finish == FinishReason.ERROR:
                job.fail(WorkerLost("the worker failed this request (memory error); retry shortly"))
            elif finish == FinishReason.EVICTED:
                job.fail(MemoryPressure("another process took the memory this request was "
                                        "promised; it was stopped, retry shortly"))
            else:
                if finish is not None:
                    job.state = JobState.DONE
                job.events.put_nowait(TokenEvent(ids, finish, row.logprobs,
                                                 msg.cached_tokens.get(request_id, 0), row.prompt_logprobs))
        self.metrics.generated_tokens.inc(sum(len(r.token_ids) for r in msg.outputs))
        if finished:
            self._changed(link.model_alias)

    def _on_reject(self, link: WorkerLink, msg: Reject) -> None:
        job = link.in_flight.pop(msg.request_id, None)
        if job is None:
            return
        self.metrics.worker_rejects.labels(reason=msg.reason).inc()
        log.debug("worker said %s: %s", msg.reason, msg.message,
                  extra=about(msg.request_id, link.incarnation, link.model_alias))
        if msg.reason == RejectReason.NOT_NOW:
            link.held = True  # our view was stale: wait for a fresh report before sending more
            job.num_dispatches -= 1
            self.backlog(link.model_alias).push_front(job)
            return
        room = msg.max_request_tokens - len(job.prompt_ids)
        if (msg.reason == RejectReason.NEVER_FITS and job.room_left and msg.needed_bytes
                and shrink_to(job, room)):
            # The worker's cost model moved past ours: a room-left default takes its room
            job.num_dispatches -= 1
            self.backlog(link.model_alias).push_front(job)
            self.pump(link.model_alias)
            return
        error: HeadroomError
        if msg.reason == RejectReason.REQUEST_FAILED:
            error = RequestFailed(msg.message)
        elif msg.reason == RejectReason.BAD_GRAMMAR:
            error = BadRequest(msg.message, param=job.grammar_param)
        elif msg.reason == RejectReason.NEVER_FITS and msg.needed_bytes:
            error = InsufficientMemory(msg.message, param="max_tokens", needed_bytes=msg.needed_bytes,
                                       max_request_tokens=msg.max_request_tokens)
        elif msg.reason == RejectReason.NEVER_FITS:
            error = ContextLengthExceeded(msg.message, param="max_tokens")
        else:
            error = BadRequest(msg.message)
        job.fail(error)
        self._changed(link.model_alias)

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_INTERVAL_S)
            now = self.clock()
            for model, backlog in self.backlogs.items():
                expired = backlog.expired(now)
                for job in expired:
                    job.fail(QueueTimeout("the request waited in the queue past --queue-timeout"))
                if expired:
                    self._changed(model)
            self.pump()  # a fresh report may have aged out; re-evaluate


def shrink_to(job: Job, max_tokens: int) -> bool:
    """Lower a room-left job's max_tokens to ``max_tokens`` (at least 1); whether it did."""
    if not 1 <= max_tokens < job.sampling.max_tokens:
        return False
    job.sampling = replace(job.sampling, max_tokens=max_tokens)
    return True
