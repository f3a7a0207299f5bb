"""The router's view of one worker incarnation: who it is, what it runs, what it reported.

A link is bookkeeping only: the channel moves its frames, the dispatcher fills it and
records what its frames say of its life (``Liveness``), the supervisor acts on the
liveness verdict, and routing reads its ``view()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.costmodel import CostModel
from common.protocol import Hello, MemoryReport
from router.fleet import admission
from router.job import Job

HEARTBEAT_TIMEOUT_S = 3.0       # silent this long → dead (spawned) or down (external)
STALL_TIMEOUT_S = 10.0          # step counter frozen this long while work waits → wedged (--stall-timeout)
STALL_STEP_FACTOR = 5.0         # ... or this many times the worker's slowest step


def stall_timeout_s(report: MemoryReport | None, floor_s: float = STALL_TIMEOUT_S) -> float:
    """A frozen step counter means wedged only well past the slowest step seen so far."""
    if report is not None and report.worst_step_s > 0:
        return max(floor_s, STALL_STEP_FACTOR * report.worst_step_s)
    return floor_s


@dataclass(slots=True)
class Liveness:
    """What the frames say about a worker's life; ``verdict`` judges it (the supervisor's call).

    The dispatcher records what it hears; the stall clock runs only while work waits: it
    restarts when the step counter moves and when an idle worker becomes busy (an idle
    worker's counter stands still, rightly)."""

    heard_at: float
    step: int = 0
    step_changed_at: float = 0.0
    has_work: bool = False

    def heard(self, now: float) -> None:
        self.heard_at = now

    def beat(self, step: int, has_work: bool, now: float) -> None:
        if step != self.step or (has_work and not self.has_work):
            self.step, self.step_changed_at = step, now
        self.has_work = has_work

    def work_started(self, now: float) -> None:
        self.step_changed_at = now

    def verdict(self, now: float, report: MemoryReport | None,
                stall_floor_s: float = STALL_TIMEOUT_S) -> str | None:
        """Why the worker is to be treated as dead, or None while it is alive."""
        silent_s = now - self.heard_at
        stalled_s = now - self.step_changed_at if self.has_work else 0.0
        if silent_s > HEARTBEAT_TIMEOUT_S:
            return f"silent for {silent_s:.1f}s"
        if stalled_s > stall_timeout_s(report, stall_floor_s):
            return f"engine loop wedged for {stalled_s:.1f}s"
        return None


@dataclass(slots=True)
class WorkerLink:
    """One worker incarnation as the router sees it."""

    hello: Hello
    identity: bytes
    model_alias: str              # the catalog entry it serves
    cost_model: CostModel
    connected_at: float
    liveness: Liveness
    status: MemoryReport | None = None
    status_at: float = 0.0
    held: bool = False            # it said "not now": wait for a fresh report before sending more
    last_used_at: float = 0.0     # the last dispatch or finish: keep-alive counts from here
    retiring: bool = False        # being stopped: no new job goes to it
    # The last send failed: its peer is not connected (ROUTER_MANDATORY). Cleared by any
    # frame from it, so a reconnect after a network blip undoes it.
    unreachable: bool = False
    in_flight: dict[str, Job] = field(default_factory=dict)

    @property
    def incarnation(self) -> int:
        return self.hello.incarnation

    @property
    def max_running(self) -> int:
        return self.status.max_running_requests if self.status is not None else 1

    def view(self, now: float) -> admission.WorkerView:
        return admission.WorkerView(model=self.cost_model, admission=self.hello.admission,
                                    max_running=self.max_running,
                                    report_age_s=now - self.status_at, held=self.held)

    def totals(self) -> list[int]:
        return [j.total_tokens for j in self.in_flight.values()]
