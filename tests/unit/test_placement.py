"""Tests for router/fleet/placement.py: where a model's worker may load within the host budget."""

from __future__ import annotations

import pytest

from common.config import parse_duration
from common.errors import ConfigError
from router.fleet.placement import Action, Footprint, Plan, Resident, expired, lease_mb, plan_load

MIB = 1 << 20
FP = Footprint(fixed_bytes=40 * MIB, min_request_bytes=20 * MIB, full_request_bytes=300 * MIB)


def resident(key: int, lease_mb_: int, *, busy: bool = False, pinned: bool = False,
             used_at: float = 0.0) -> Resident:
    return Resident(key=key, model=f"m{key}", lease_bytes=lease_mb_ * MIB, busy=busy,
                    pinned=pinned, last_used_at=used_at)


def test_loads_with_what_it_wants_when_free() -> None:
    assert plan_load(1000 * MIB, FP, []) == Plan(Action.LOAD, lease_bytes=340 * MIB)


def test_takes_what_is_free_down_to_its_need() -> None:
    assert plan_load(1000 * MIB, FP, [resident(1, 900)]) == Plan(Action.LOAD, lease_bytes=100 * MIB)
    assert plan_load(1000 * MIB, FP, [resident(1, 940)]) == Plan(Action.LOAD, lease_bytes=60 * MIB)


def test_the_cap_bounds_the_lease() -> None:
    assert plan_load(1000 * MIB, FP, [], cap_bytes=100 * MIB).lease_bytes == 100 * MIB


def test_never_fits_alone_is_refused() -> None:
    assert plan_load(59 * MIB, FP, []).action is Action.NEVER
    assert plan_load(1000 * MIB, FP, [], cap_bytes=59 * MIB).action is Action.NEVER


def test_evicts_idle_least_recently_used_first_and_only_as_many_as_needed() -> None:
    residents = [resident(1, 50, used_at=5.0), resident(2, 50, used_at=1.0),
                 resident(3, 50, used_at=3.0)]
    assert plan_load(160 * MIB, FP, residents) == Plan(Action.EVICT, evict=(2,))
    assert plan_load(150 * MIB, FP, residents) == Plan(Action.EVICT, evict=(2, 3))


def test_never_evicts_a_busy_or_pinned_worker() -> None:
    residents = [resident(1, 100, busy=True, used_at=0.0), resident(2, 100, pinned=True)]
    assert plan_load(200 * MIB, FP, residents).action is Action.WAIT
    residents.append(resident(3, 100, used_at=9.0))
    assert plan_load(300 * MIB, FP, residents) == Plan(Action.EVICT, evict=(3,))


def test_a_second_replica_never_evicts() -> None:
    assert plan_load(100 * MIB, FP, [resident(1, 100)], may_evict=False).action is Action.WAIT


def test_leases_never_add_up_past_the_budget() -> None:
    budget = 500 * MIB
    residents: list[Resident] = []
    for key in range(10):
        plan = plan_load(budget, FP, residents)
        if plan.action is not Action.LOAD:
            break
        residents.append(Resident(key, "m", plan.lease_bytes, True, False, 0.0))
        assert sum(r.lease_bytes for r in residents) <= budget


def test_expiry() -> None:
    assert not expired(10.0, 5.0, 14.9) and expired(10.0, 5.0, 15.0)
    assert expired(10.0, 0.0, 10.0)
    assert not expired(0.0, -1.0, 1e12)


def test_lease_mb_never_rounds_up() -> None:
    assert lease_mb(100 * MIB + 5) == 100 and lease_mb(10) == 1


@pytest.mark.parametrize(("text", "seconds"), [
    ("30s", 30.0), ("5m", 300.0), ("1h", 3600.0), ("1h30m", 5400.0), ("250ms", 0.25),
    ("0", 0.0), ("-1", -1.0), ("-5m", -1.0), ("42", 42.0), ("1.5", 1.5), (10, 10.0),
    (0, 0.0), (-1, -1.0), (2.5, 2.5), (" 5m ", 300.0),
])
def test_parse_duration(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["", "5x", "m5", "5 m", "abc", "1h-5m", True, None, [1], "nan", "inf"])
def test_parse_duration_refuses(bad: object) -> None:
    with pytest.raises(ConfigError):
        parse_duration(bad)
