"""Dispatcher bookkeeping with a fake clock: liveness, the stall clock, stale incarnations,
and routing among the workers of a model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from common.costmodel import CostModel
from common.protocol import Heartbeat, Hello, MemoryReport, TokenRow, Tokens
from router.fleet.channel import Channel
from router.fleet.dispatch import Dispatcher
from router.fleet.link import Liveness, stall_timeout_s
from router.job import Job, JobState, Sampling, TokenEvent
from router.ops.status import Metrics

MODEL = CostModel(kv_bytes_per_token=1024, num_layers=2, prefill_a_bytes=10.0, prefill_c_bytes=1.0,
                  budget_bytes=1 << 30, context_length=4096, prefill_step_tokens=256)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def dispatcher() -> Iterator[tuple[Dispatcher, Clock]]:
    clock = Clock()
    metrics = Metrics()
    d = Dispatcher(Channel("inproc://unused", metrics), 8, metrics, clock=clock)
    d.sent = []  # type: ignore[attr-defined]
    d._send = lambda link, msg: d.sent.append((link.incarnation, msg))  # type: ignore[method-assign,attr-defined]
    hello = Hello(incarnation=7, pid=1, package_version="t", model_id="m", fingerprint="f",
                  context_length=4096, tokenizer_path="/x", eos_token_ids=[0], admission=True,
                  cost_model=MODEL.to_dict())
    d._handle(b"w7", hello)
    yield d, clock
    d.channel.close()


def test_idle_worker_that_becomes_busy_restarts_the_stall_clock(dispatcher: tuple[Dispatcher, Clock]) -> None:
    d, clock = dispatcher
    d._handle(b"w7-hb", Heartbeat(incarnation=7, step=5, has_work=False))
    clock.now = 60.0  # a minute idle: the step counter stood still, rightly
    d._handle(b"w7-hb", Heartbeat(incarnation=7, step=5, has_work=True))
    assert clock.now - d.links[7].liveness.step_changed_at < stall_timeout_s(None)


def test_dispatch_to_an_idle_worker_restarts_the_stall_clock(dispatcher: tuple[Dispatcher, Clock]) -> None:
    d, clock = dispatcher
    clock.now = 100.0
    job = _submit_to_worker_7(d, enqueued_at=clock.now)
    assert job.state is JobState.RUNNING
    assert d.links[7].liveness.step_changed_at == 100.0


def test_frames_from_an_old_incarnation_are_dropped(dispatcher: tuple[Dispatcher, Clock]) -> None:
    d, clock = dispatcher
    job = _submit_to_worker_7(d)
    d._handle(b"w6", Tokens(incarnation=6, step=1, outputs=[TokenRow("r1", [9], "length")]))
    assert job.events.empty()
    d._handle(b"w7", Tokens(incarnation=7, step=1, outputs=[TokenRow("r1", [9], "length")]))
    event = job.events.get_nowait()
    assert isinstance(event, TokenEvent) and event.token_ids == [9]


def test_worker_lost_requeues_jobs_without_output_once(dispatcher: tuple[Dispatcher, Clock]) -> None:
    d, clock = dispatcher
    job = _submit_to_worker_7(d)
    assert d.worker_lost(7, "killed") is False
    assert job.state is JobState.QUEUED and d.num_queued("m") == 1


def test_stall_timeout_follows_the_slowest_step() -> None:
    assert stall_timeout_s(None) == 10.0
    assert stall_timeout_s(MemoryReport(worst_step_s=0.1)) == 10.0
    assert stall_timeout_s(MemoryReport(worst_step_s=4.0)) == 20.0
    # --stall-timeout moves the floor; the slowest step still raises it.
    assert stall_timeout_s(MemoryReport(worst_step_s=0.1), 2.0) == 2.0
    assert stall_timeout_s(MemoryReport(worst_step_s=4.0), 2.0) == 20.0


def test_a_lower_stall_timeout_judges_a_frozen_counter_sooner() -> None:
    life = Liveness(heard_at=0.0, step=5, step_changed_at=0.0, has_work=True)
    life.heard(3.0)
    assert life.verdict(3.0, None) is None
    assert life.verdict(3.0, None, stall_floor_s=2.0) == "engine loop wedged for 3.0s"


def _submit_to_worker_7(d: Dispatcher, enqueued_at: float = 0.0) -> Job:
    """Worker 7 reports in, then job r1 (3 prompt tokens, 4 to generate) is submitted."""
    d._handle(b"w7", _status(7))
    job = Job(request_id="r1", prompt_ids=[1, 2, 3], sampling=Sampling(max_tokens=4),
              deadline=1e9, enqueued_at=enqueued_at, model="m")
    d.submit(job)
    return job


def _status(incarnation: int) -> object:
    from common.protocol import Status

    return Status(incarnation=incarnation, report=MemoryReport(max_running_requests=4))


def test_queued_requests_are_rechecked_when_the_cost_model_grows(dispatcher: tuple[Dispatcher, Clock]) -> None:
    """A grown scale makes a queued request never fit: it gets its 400 at once; one that
    still fits stays queued."""
    import dataclasses

    from common import costmodel
    from common.errors import InsufficientMemory
    from common.protocol import Status

    d, clock = dispatcher
    d._handle(b"w7", Status(incarnation=7, report=MemoryReport(max_running_requests=0)))  # hold everything
    small = Job(request_id="small", prompt_ids=[1] * 100, sampling=Sampling(max_tokens=100),
                deadline=1e9, enqueued_at=0.0, model="m")
    big = Job(request_id="big", prompt_ids=[1] * 3000, sampling=Sampling(max_tokens=1000),
              deadline=1e9, enqueued_at=0.0, model="m")
    d.submit(small)
    d.submit(big)
    assert d.num_queued("m") == 2
    # Find a scale at which the big one can never fit but the small one still can.
    scale = 1.0
    while not costmodel.never_fits(dataclasses.replace(MODEL, scale=scale), 3000, 1000):
        scale *= 1.5
    grown = dataclasses.replace(MODEL, scale=scale)
    assert not costmodel.never_fits(grown, 100, 100)
    d._handle(b"w7", Status(incarnation=7, report=MemoryReport(
        max_running_requests=0, cost_model=grown.to_dict())))
    event = big.events.get_nowait()
    assert isinstance(event, InsufficientMemory)
    assert event.extra["needed_bytes"] == costmodel.request_cost_bytes(grown, 3000, 1000)
    assert event.extra["max_request_tokens"] == costmodel.max_request_tokens(grown) < 4000
    assert small.state is JobState.QUEUED and small.events.empty()
    assert list(d.backlog("m").waiting) == ["small"]


def _hello(incarnation: int) -> Hello:
    return Hello(incarnation=incarnation, pid=incarnation, package_version="t", model_id="m",
                 fingerprint="f", context_length=4096, tokenizer_path="/x", eos_token_ids=[0],
                 admission=True, cost_model=MODEL.to_dict())


def _job(request_id: str, model: str = "m") -> Job:
    return Job(request_id=request_id, prompt_ids=[1, 2, 3], sampling=Sampling(max_tokens=4),
               deadline=1e9, enqueued_at=0.0, model=model)


def _two_workers_four_jobs(d: Dispatcher) -> list[Job]:
    """Workers 7 and 8 of model m report room for 4 each; four jobs are submitted."""
    from common.protocol import Status

    d._handle(b"w8", _hello(8))
    for incarnation in (7, 8):
        d._handle(b"w", Status(incarnation=incarnation, report=MemoryReport(max_running_requests=4)))
    jobs = [_job(f"r{i}") for i in range(4)]
    for job in jobs:
        d.submit(job)
    return jobs


def test_jobs_spread_over_the_workers_of_their_model(dispatcher: tuple[Dispatcher, Clock]) -> None:
    d, clock = dispatcher
    _two_workers_four_jobs(d)
    assert sorted(len(link.in_flight) for link in d.links.values()) == [2, 2]
    # A job for another model waits for a worker of that model, whatever room these have.
    other = _job("x", model="other")
    d.submit(other)
    assert other.state is JobState.QUEUED and d.num_queued("other") == 1


def test_a_lost_worker_s_unstarted_jobs_go_to_the_other_worker(dispatcher: tuple[Dispatcher, Clock]) -> None:
    d, clock = dispatcher
    _two_workers_four_jobs(d)
    on_7 = list(d.links[7].in_flight.values())
    d.worker_lost(7, "killed")
    assert all(job.incarnation == 8 and job.state is JobState.RUNNING for job in on_7)
    assert len(d.links[8].in_flight) == 4 and 7 not in d.links


def test_a_retiring_worker_gets_no_new_job(dispatcher: tuple[Dispatcher, Clock]) -> None:
    from common.protocol import Status

    d, clock = dispatcher
    d._handle(b"w7", Status(incarnation=7, report=MemoryReport(max_running_requests=4)))
    d.links[7].retiring = True
    job = _job("r1")
    d.submit(job)
    assert job.state is JobState.QUEUED


def test_a_room_left_default_shrinks_with_the_room_rather_than_fail(
        dispatcher: tuple[Dispatcher, Clock]) -> None:
    """A queued request that named no max_tokens got the room left then; when the cost
    model grows it takes the room left now, where one that asked for a number gets its 400."""
    import dataclasses

    from common import costmodel
    from common.errors import InsufficientMemory
    from common.protocol import Status
    from router.fleet.admission import room_left

    d, _ = dispatcher
    d._handle(b"w7", Status(incarnation=7, report=MemoryReport(max_running_requests=0)))  # hold everything
    prompt = [1] * 3000
    defaulted = Job(request_id="room", prompt_ids=prompt, room_left=True, deadline=1e9,
                    enqueued_at=0.0, model="m",
                    sampling=Sampling(max_tokens=room_left(MODEL, True, 3000, None)))
    asked = Job(request_id="asked", prompt_ids=prompt, sampling=Sampling(max_tokens=1000),
                deadline=1e9, enqueued_at=0.0, model="m")
    d.submit(defaulted)
    d.submit(asked)
    scale = 1.0
    while not costmodel.never_fits(dataclasses.replace(MODEL, scale=scale), 3000, 1000):
        scale *= 1.5
    grown = dataclasses.replace(MODEL, scale=scale)
    d._handle(b"w7", Status(incarnation=7, report=MemoryReport(
        max_running_requests=0, cost_model=grown.to_dict())))
    assert isinstance(asked.events.get_nowait(), InsufficientMemory)
    assert defaulted.state is JobState.QUEUED and defaulted.events.empty()
    assert defaulted.sampling.max_tokens == costmodel.max_new_tokens(grown, 3000) < 1000


def test_a_worker_s_never_fits_shrinks_a_room_left_default(dispatcher: tuple[Dispatcher, Clock]) -> None:
    """The worker's own cost model moved past the router's: a room-left request goes back
    to the queue's front with the room the worker says it has; an asked-for one fails."""
    from common.errors import InsufficientMemory
    from common.protocol import Generate, Reject, RejectReason

    d, _ = dispatcher
    job = _submit_to_worker_7(d)
    job.room_left = True
    assert job.state is JobState.RUNNING
    d._handle(b"w7", Reject(incarnation=7, request_id="r1", reason=RejectReason.NEVER_FITS,
                            message="no", needed_bytes=10, max_request_tokens=5))
    assert job.events.empty() and job.sampling.max_tokens == 2  # 5 in all, 3 of them prompt
    assert job.state is JobState.RUNNING  # sent again at once
    sent = [m.max_tokens for _, m in d.sent if isinstance(m, Generate)]  # type: ignore[attr-defined]
    assert sent == [4, 2]
    d._handle(b"w7", Reject(incarnation=7, request_id="r1", reason=RejectReason.NEVER_FITS,
                            message="no", needed_bytes=10, max_request_tokens=5))
    assert isinstance(job.events.get_nowait(), InsufficientMemory)  # no smaller room: its 400


def test_cancelling_a_request_s_rows_sends_none_of_its_queued_rows(dispatcher: tuple[Dispatcher, Clock]) -> None:
    """Four rows run (the worker's room), four wait: cancelling the request frees all eight
    and sends the worker nothing but four cancels (a pump per row once sent each waiting
    row only to cancel it the next moment)."""
    from common.protocol import Cancel, Generate

    d, _ = dispatcher
    d._handle(b"w7", _status(7))
    jobs = [_job(f"r#{i}") for i in range(8)]
    for job in jobs:
        d.submit(job)
    assert [j.state for j in jobs] == [JobState.RUNNING] * 4 + [JobState.QUEUED] * 4
    d.sent.clear()  # type: ignore[attr-defined]
    d.cancel_all(jobs)
    assert all(j.state is JobState.DONE for j in jobs) and d.num_queued("m") == 0
    sent = [msg for _, msg in d.sent]  # type: ignore[attr-defined]
    assert not any(isinstance(m, Generate) for m in sent)
    assert sorted(m.request_id for m in sent if isinstance(m, Cancel)) == [f"r#{i}" for i in range(4)]


@pytest.mark.parametrize("died", [True, False])
def test_only_deaths_count_toward_quarantine_not_an_operators_restarts(
        dispatcher: tuple[Dispatcher, Clock], died: bool) -> None:
    """A request running at two worker deaths is quarantined; at two operator restarts (or
    clean exits) it is not: those say nothing against it."""
    from common.errors import RequestQuarantined

    d, _ = dispatcher
    job = _submit_to_worker_7(d)
    for incarnation in (7, 8):
        assert job.state is JobState.RUNNING and job.incarnation == incarnation
        d.worker_lost(incarnation, "restart requested by an operator", died=died)
        d._handle(b"w8", _hello(8))
        d._handle(b"w8", _status(8))
    again = Job(request_id="r2", prompt_ids=[1, 2, 3], sampling=Sampling(max_tokens=4), deadline=1e9,
                enqueued_at=0.0, model="m")
    if died:
        with pytest.raises(RequestQuarantined):
            d.submit(again)
    else:
        d.submit(again)
        assert again.state is JobState.RUNNING
