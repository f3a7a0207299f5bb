"""The router's view of one worker incarnation: who it is, what it runs, what it reported.

A link is bookkeeping only: the channel moves its frames, the dispatcher fills it, the
supervisor judges its liveness, and routing reads its ``view()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.costmodel import CostModel
from common.protocol import Hello, MemoryReport
from router import admission
from router.job import Job
from router.supervisor import Liveness


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
