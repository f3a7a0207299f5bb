"""Tests for router/fleet/backlog.py: the bounded FIFO of waiting jobs (explicit ``now``)."""

from __future__ import annotations

import pytest

from common.errors import QueueFull
from router.fleet.backlog import Backlog
from router.job import Job, JobState, Sampling


def make_job(request_id: str, deadline: float = 100.0) -> Job:
    return Job(request_id=request_id, prompt_ids=[1, 2, 3], sampling=Sampling(max_tokens=4),
               deadline=deadline, enqueued_at=0.0)


def ids(backlog: Backlog) -> list[str]:
    return list(backlog.waiting)


def test_empty() -> None:
    backlog = Backlog(3)
    assert len(backlog) == 0
    assert backlog.peek() is None
    assert backlog.expired(1e9) == []
    with pytest.raises(KeyError):
        backlog.pop()


def test_fifo() -> None:
    backlog = Backlog(10)
    for name in "abcd":
        backlog.push(make_job(name))
    assert len(backlog) == 4
    assert backlog.peek().request_id == "a"  # type: ignore[union-attr]
    assert [backlog.pop().request_id for _ in range(4)] == list("abcd")
    assert len(backlog) == 0


def test_push_marks_queued() -> None:
    backlog = Backlog(1)
    job = make_job("a")
    job.state = JobState.RUNNING
    backlog.push(job)
    assert job.state is JobState.QUEUED


def test_bounded_push_raises_queue_full() -> None:
    backlog = Backlog(2)
    backlog.push(make_job("a"))
    backlog.push(make_job("b"))
    with pytest.raises(QueueFull) as info:
        backlog.push(make_job("c"))
    assert info.value.status == 429 and info.value.code == "queue_full"
    assert ids(backlog) == ["a", "b"]


def test_room_again_after_pop() -> None:
    backlog = Backlog(1)
    backlog.push(make_job("a"))
    backlog.pop()
    backlog.push(make_job("b"))
    assert ids(backlog) == ["b"]


def test_zero_capacity_refuses_everything() -> None:
    with pytest.raises(QueueFull):
        Backlog(0).push(make_job("a"))


def test_push_front_goes_first_and_may_exceed_the_bound() -> None:
    backlog = Backlog(2)
    backlog.push(make_job("a"))
    backlog.push(make_job("b"))
    retried = make_job("r")
    retried.state = JobState.RUNNING
    backlog.push_front(retried)
    assert retried.state is JobState.QUEUED
    assert ids(backlog) == ["r", "a", "b"]
    assert len(backlog) == 3
    with pytest.raises(QueueFull):
        backlog.push(make_job("c"))


def test_push_front_order_of_several_requeues() -> None:
    """Each push_front goes ahead of everything, so the last re-queued runs first."""
    backlog = Backlog(10)
    backlog.push(make_job("new"))
    backlog.push_front(make_job("x"))
    backlog.push_front(make_job("y"))
    assert ids(backlog) == ["y", "x", "new"]


def test_push_front_of_a_job_already_waiting_moves_it() -> None:
    backlog = Backlog(10)
    for name in "abc":
        backlog.push(make_job(name))
    backlog.push_front(backlog.waiting["c"])
    assert ids(backlog) == ["c", "a", "b"]


def test_remove() -> None:
    backlog = Backlog(10)
    for name in "abc":
        backlog.push(make_job(name))
    assert backlog.remove("b") is True
    assert backlog.remove("b") is False
    assert backlog.remove("nope") is False
    assert ids(backlog) == ["a", "c"]
    assert [backlog.pop().request_id for _ in range(2)] == ["a", "c"]


def test_expired_by_deadline() -> None:
    backlog = Backlog(10)
    backlog.push(make_job("late", deadline=5.0))
    backlog.push(make_job("ok", deadline=50.0))
    backlog.push(make_job("edge", deadline=10.0))
    assert backlog.expired(4.9) == []
    gone = backlog.expired(10.0)
    assert [j.request_id for j in gone] == ["late", "edge"]  # deadline == now is expired
    assert ids(backlog) == ["ok"]
    assert backlog.expired(10.0) == []
    assert [j.request_id for j in backlog.expired(1e9)] == ["ok"]
    assert len(backlog) == 0


def test_expired_frees_room() -> None:
    backlog = Backlog(1)
    backlog.push(make_job("a", deadline=1.0))
    backlog.expired(2.0)
    backlog.push(make_job("b"))
    assert ids(backlog) == ["b"]
