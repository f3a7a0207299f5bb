"""Where a model's worker may load within the host budget: a pure decision over numbers.

The router keeps one host budget for every worker it spawns and gives each worker a lease
(its ``--memory-limit-mb``); the leases never add up to more than the budget, so no two
workers can together cross it. A load needs the model's fixed part (weights and the
worker's runtime baseline) plus a minimal request; it asks for one full-context request
more, and takes what is free up to that. When too little is free, idle unpinned workers
are stopped, least recently used first — never one with work in flight or queued; if that
cannot make room the load waits, and one that could never fit even alone is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Footprint:
    """What a worker of one model costs, estimated from its files or learned from a load."""

    fixed_bytes: int            # weights + runtime baseline (+ the worker's margin)
    min_request_bytes: int      # the smallest request a worker must be able to hold
    full_request_bytes: int     # one request of the whole context

    @property
    def need_bytes(self) -> int:
        return self.fixed_bytes + self.min_request_bytes

    @property
    def want_bytes(self) -> int:
        return self.fixed_bytes + max(self.min_request_bytes, self.full_request_bytes)


@dataclass(frozen=True, slots=True)
class Resident:
    """A worker holding a lease (loading, serving, or still exiting)."""

    key: int
    model: str
    lease_bytes: int
    busy: bool                  # requests in flight or queued for its model, or loading
    pinned: bool
    last_used_at: float


class Action(StrEnum):
    LOAD = "load"               # spawn now with ``lease_bytes``
    EVICT = "evict"             # stop ``evict`` (and wait for their exit), then plan again
    WAIT = "wait"               # nothing can make room now: the request stays queued
    NEVER = "never"             # it cannot fit even alone: 400 insufficient_memory


@dataclass(frozen=True, slots=True)
class Plan:
    action: Action
    lease_bytes: int = 0
    evict: tuple[int, ...] = ()


def never_fits(budget_bytes: int, footprint: Footprint, cap_bytes: int | None = None) -> bool:
    limit = budget_bytes if cap_bytes is None else min(budget_bytes, cap_bytes)
    return footprint.need_bytes > limit


def free_bytes(budget_bytes: int, residents: list[Resident]) -> int:
    return budget_bytes - sum(r.lease_bytes for r in residents)


def plan_load(budget_bytes: int, footprint: Footprint, residents: list[Resident], *,
              cap_bytes: int | None = None, may_evict: bool = True) -> Plan:
    """Load now, make room first, wait, or refuse. ``cap_bytes``: --memory-limit-mb."""
    if never_fits(budget_bytes, footprint, cap_bytes):
        return Plan(Action.NEVER)
    free = free_bytes(budget_bytes, residents)
    if free >= footprint.need_bytes:
        lease = min(free, footprint.want_bytes, cap_bytes if cap_bytes is not None else free)
        return Plan(Action.LOAD, lease_bytes=lease)
    if not may_evict:
        return Plan(Action.WAIT)
    if free + sum(r.lease_bytes for r in residents if not r.pinned) < footprint.need_bytes:
        # Only pinned workers (never stopped, their leases never shrink) hold the rest: the
        # wait would never end.
        return Plan(Action.NEVER)
    victims: list[int] = []
    idle = sorted((r for r in residents if not r.busy and not r.pinned),
                  key=lambda r: r.last_used_at)
    for r in idle:
        victims.append(r.key)
        free += r.lease_bytes
        if free >= footprint.need_bytes:
            return Plan(Action.EVICT, evict=tuple(victims))
    return Plan(Action.WAIT)


def expired(last_used_at: float, keep_alive_s: float, now: float) -> bool:
    """Idle past its keep-alive (negative: for ever)."""
    return keep_alive_s >= 0 and now - last_used_at >= keep_alive_s


def lease_mb(lease_bytes: int) -> int:
    """The worker's --memory-limit-mb for a lease (rounded down: never above the lease)."""
    return max(1, lease_bytes // MIB)
