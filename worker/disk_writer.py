"""The prompt cache's background disk writer: a bounded queue drained while the engine is quiet.

Both disk tiers use it: whole-sequence entries (``worker/disk_cache.py``) and KV blocks
(``worker/block_disk.py``). ``submit`` only queues (bounded: a full queue or too many
pending bytes drops, and the caller counts it); the writer thread calls the tier's
``write(job)`` and drops its reference to the job's arrays as soon as that returns.

It writes while the engine is idle (``engine_busy``, told by the worker's loop): a write
reads the arrays back from the device, and on the H200 a write at a request's end put
19-23 ms on the next request's time to first token (0.9 ms without the writer), while
writes made during decode steps slowed them. A job waits at most ``max_defer_s`` (a
worker that dies under steady traffic loses only that much), and queued jobs keep their
arrays, so when the gate needs that memory (``hurry``) the writer goes at once.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

MAX_PENDING = 8
WRITER_CLOSE_TIMEOUT_S = 60.0
# The writer waits for the engine to have been idle this long (the next request of a client
# that sends one after another comes within a few ms of the last answer; an agent's next
# turn, after its tools ran, much later), but never longer than MAX_DEFER_S after a job
# was queued. Under steady traffic the bounded queue then drops (and counts) what it cannot
# hold, so the writes that compete with steps are at most MAX_PENDING per MAX_DEFER_S.
QUIET_S = 0.2
MAX_DEFER_S = 30.0


@dataclass(slots=True)
class Job:
    key: str
    payload: Any                # what ``write`` needs (the arrays among it); None once written
    nbytes: int
    queued_at: float
    seq: int = 0                # its place in the queue: hurry() covers every job up to one


class DiskWriter:
    """One thread that runs ``write(job)`` for queued jobs, when the engine is quiet."""

    def __init__(self, write: Callable[[Job], None], *, name: str = "prompt-cache-disk",
                 max_pending: int = MAX_PENDING, max_pending_bytes: int | None = None,
                 quiet_s: float = QUIET_S, max_defer_s: float = MAX_DEFER_S) -> None:
        self._write = write
        self.quiet_s = quiet_s
        self.max_defer_s = max_defer_s
        self.max_pending_bytes = max_pending_bytes
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}      # key -> bytes its arrays hold, until written
        self.num_dropped = 0
        self.num_errors = 0
        self._closed = False
        # The engine's state as the worker's loop last said (idle since boot until told).
        self._quiet = threading.Condition()
        self._busy = False
        self._idle_since = -math.inf
        self._seq = 0                   # jobs queued so far
        self._hurry_upto = 0            # jobs up to this one are written now (hurry)
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_pending)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, key: str, nbytes: int, payload: Any) -> bool:
        """Queue a job; never blocks. False (and counted as dropped) when the queue or the
        pending bytes are full, or the writer is closed."""
        with self._lock:
            if self._closed:
                return False
            if key in self._pending:
                return True
            pending = sum(self._pending.values())
            if self.max_pending_bytes is not None and pending + nbytes > self.max_pending_bytes:
                self.num_dropped += 1
                return False
            self._pending[key] = nbytes
        with self._quiet:
            self._seq += 1
            seq = self._seq
        try:
            self._queue.put_nowait(Job(key, payload, nbytes, time.monotonic(), seq))
        except queue.Full:
            with self._lock:
                self._pending.pop(key, None)
                self.num_dropped += 1
            return False
        return True

    def is_pending(self, key: str) -> bool:
        with self._lock:
            return key in self._pending

    def pending_keys(self) -> frozenset[str]:
        """Keys whose arrays the writer still holds (queued or being written)."""
        with self._lock:
            return frozenset(self._pending)

    def pending_bytes(self) -> int:
        with self._lock:
            return sum(self._pending.values())

    def engine_busy(self, busy: bool) -> None:
        """The worker's loop says whether the engine has work (cheap when nothing changed)."""
        if busy == self._busy:
            return
        with self._quiet:
            self._busy = busy
            if not busy:
                self._idle_since = time.monotonic()
            self._quiet.notify_all()

    def hurry(self) -> None:
        """Write what is queued now, busy or not: the memory its arrays hold is wanted.
        (Jobs queued later wait for an idle engine again.)"""
        with self._quiet:
            if self._hurry_upto < self._seq:
                self._hurry_upto = self._seq
                self._quiet.notify_all()

    def close(self, timeout_s: float = WRITER_CLOSE_TIMEOUT_S) -> None:
        """Write what is queued, then stop the thread (bounded: a stuck disk is logged)."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
        with self._quiet:
            self._quiet.notify_all()  # what is queued is written now, busy or not
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            log.warning("prompt cache: writer still busy after %.0f s; not waiting", timeout_s)
            return
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("prompt cache: writer did not finish in %.0f s", timeout_s)

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self._wait_for_quiet(job)
                self._write(job)
            except Exception:  # a disk or format error must not end the writer
                log.warning("prompt cache: could not write %s", job.key, exc_info=True)
                with self._lock:
                    self.num_errors += 1
            finally:
                job.payload = None
                with self._lock:
                    self._pending.pop(job.key, None)
            del job  # no reference to the arrays outlives the write

    def _wait_for_quiet(self, job: Job) -> None:
        """Until the engine has been idle ``quiet_s``, the job's deadline passes, the gate
        hurries it or the writer closes."""
        deadline = job.queued_at + self.max_defer_s
        with self._quiet:
            while not (self._closed or job.seq <= self._hurry_upto):
                wake = deadline if self._busy else min(deadline, self._idle_since + self.quiet_s)
                now = time.monotonic()
                if now >= wake:
                    return
                self._quiet.wait(wake - now)
