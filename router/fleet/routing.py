"""Which worker gets a job: a pure choice among the workers of the job's model.

Each candidate is a worker's view (cost model, live report age, held) and what it runs;
the ones with room by ``admission.can_dispatch`` qualify, and the least loaded of them
wins (fewest rows in flight, then the most budget left unpromised), so replicas share the
load and a request never waits behind another worker's long batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from common import costmodel
from router.fleet import admission


@dataclass(frozen=True, slots=True)
class Candidate:
    view: admission.WorkerView
    in_flight_totals: list[int]


def pick(candidates: list[Candidate], prompt_tokens: int, max_tokens: int) -> int | None:
    """The index of the worker to send this job to, or None: it stays queued."""
    best: tuple[int, int] | None = None
    chosen: int | None = None
    for i, c in enumerate(candidates):
        if admission.can_dispatch(c.view, c.in_flight_totals, prompt_tokens, max_tokens) \
                is not admission.Verdict.DISPATCH:
            continue
        promised = costmodel.batch_cost_bytes(c.view.model, len(c.in_flight_totals),
                                              max(c.in_flight_totals, default=0), 0, 0, 0) \
            if c.in_flight_totals else 0
        key = (len(c.in_flight_totals), promised - c.view.model.budget_bytes)
        if best is None or key < best:
            best, chosen = key, i
    return chosen
