"""The router's queue: a bounded FIFO of waiting jobs with per-job deadlines.

Pure bookkeeping (no clocks read here: callers pass ``now``), so it is easy to test.
A job re-queued after a worker death or a stale-view reject goes back to the front.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from common.errors import QueueFull
from router.job import Job, JobState


class Backlog:
    """Waiting jobs in arrival order; O(1) push, pop, remove by id."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.waiting: OrderedDict[str, Job] = OrderedDict()

    def __len__(self) -> int:
        return len(self.waiting)

    def push(self, job: Job) -> None:
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(f"the queue is full ({self.max_queue} waiting); retry shortly")
        job.state = JobState.QUEUED
        self.waiting[job.request_id] = job

    def push_front(self, job: Job) -> None:
        """Re-queue ahead of newer arrivals; may exceed max_queue (it was admitted before)."""
        job.state = JobState.QUEUED
        self.waiting[job.request_id] = job
        self.waiting.move_to_end(job.request_id, last=False)

    def peek(self) -> Job | None:
        return next(iter(self.waiting.values()), None)

    def pop(self) -> Job:
        return self.waiting.popitem(last=False)[1]

    def remove(self, request_id: str) -> bool:
        return self.waiting.pop(request_id, None) is not None

    def remove_where(self, doomed: Callable[[Job], bool]) -> list[Job]:
        """Remove and return every waiting job for which ``doomed`` is true, in order."""
        gone = [job for job in self.waiting.values() if doomed(job)]
        for job in gone:
            del self.waiting[job.request_id]
        return gone

    def expired(self, now: float) -> list[Job]:
        """Remove and return every job whose deadline has passed."""
        gone = [job for job in self.waiting.values() if job.deadline <= now]
        for job in gone:
            del self.waiting[job.request_id]
        return gone
