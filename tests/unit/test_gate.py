"""Tests for worker/gate.py: every promise of the worker's memory gate, on fake readings.

No MLX, no sockets: a ``FakeProbe`` stands for the device, ``now`` for the clock and an
``EngineView`` for the engine.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common import costmodel
from common.costmodel import CostModel
from common.protocol import RejectReason
from tests.fakes import FakeProbe
from worker.gate import (
    CAUGHT_ERRORS_TO_EXIT, GROWTH_MARGIN, SCALE_WINDOW_S, CacheLedger, EngineView, MemoryGate, ScaleTracker,
    is_memory_error, moved_budget,
)
from worker.memory import MemoryState

MIB = 1 << 20
WEIGHTS = 100 * MIB
LIMIT = 1024 * MIB


def make_model(**overrides: Any) -> CostModel:
    values: dict[str, Any] = dict(
        kv_bytes_per_token=64 * 1024, num_layers=4, prefill_a_bytes=20_000.0, prefill_c_bytes=8.0,
        prefill_b_bytes=4 * MIB, budget_bytes=800 * MIB, context_length=8192,
        prefill_step_tokens=512, prefill_batch_size=8)
    values.update(overrides)
    return CostModel(**values)


def make_gate(model: CostModel | None = None, *, admission: bool = True, max_running: int = 8,
              limit: int = LIMIT) -> tuple[MemoryGate, FakeProbe]:
    probe = FakeProbe(limit_bytes=limit, active_bytes=WEIGHTS)
    memory = MemoryState(probe=probe, model=model or make_model(), weights_bytes=WEIGHTS, baseline_bytes=0)
    gate = MemoryGate(memory, fitted=memory.model, admission=admission, max_running=max_running, now=0.0)
    return gate, probe


def view(*totals: int, prefilling: int = 0) -> EngineView:
    return EngineView(running_totals=list(totals), prefilling=prefilling, prefill_rows=prefilling)


# -- admission: ask, then commit ---------------------------------------------------------


def test_asking_changes_nothing_and_commit_reserves_the_batch_worst_case() -> None:
    gate, _ = make_gate()
    decision = gate.can_admit(view(), 500, 100)
    assert decision.admit and gate.memory.reserved_bytes == 0  # asking is free
    gate.reserve(decision)
    assert gate.memory.reserved_bytes == decision.worst_bytes > 0


def test_no_admit_without_room() -> None:
    gate, probe = make_gate()
    first = gate.can_admit(view(), 2000, 500)
    gate.reserve(first)
    # Another process takes most of the memory: live headroom no longer covers the increment.
    probe.active_bytes = LIMIT - 10 * MIB
    decision = gate.can_admit(view(2500), 2000, 500)
    assert decision.reason is RejectReason.NOT_NOW and decision.needed_bytes > 0


def test_the_buffer_cache_is_cleared_before_saying_no_room() -> None:
    gate, probe = make_gate()
    probe.cache_bytes = LIMIT - WEIGHTS  # all of it reclaimable
    decision = gate.can_admit(view(), 1000, 100)
    assert decision.admit and probe.cleared == 1


def test_a_request_bigger_than_an_idle_worker_never_fits() -> None:
    gate, _ = make_gate(make_model(budget_bytes=64 * MIB))
    decision = gate.can_admit(view(), 4000, 4000)
    assert decision.reason is RejectReason.NEVER_FITS
    assert decision.needed_bytes == costmodel.request_cost_bytes(gate.model, 4000, 4000)


def test_running_cap_and_pressure_hold_requests_back() -> None:
    gate, _ = make_gate(max_running=1)
    assert gate.can_admit(view(300), 10, 10).reason is RejectReason.NOT_NOW
    gate, _ = make_gate()
    gate.under_pressure = True
    assert gate.can_admit(view(), 10, 10).reason is RejectReason.NOT_NOW


def test_without_admission_only_the_context_is_checked() -> None:
    gate, _ = make_gate(make_model(budget_bytes=0), admission=False)
    decision = gate.can_admit(view(), 4000, 4000)
    assert decision.admit
    gate.reserve(decision)
    assert gate.memory.reserved_bytes == 0
    assert gate.can_admit(view(), 8000, 500).reason is RejectReason.NEVER_FITS


def test_reservations_are_released_on_finish_and_cancel() -> None:
    gate, _ = make_gate(make_model(kv_bytes_per_token=16 * 1024))
    d1 = gate.can_admit(view(), 3000, 500)
    gate.reserve(d1)
    d2 = gate.can_admit(view(3500), 100, 100)
    gate.reserve(d2)
    assert gate.memory.reserved_bytes == d2.worst_bytes > d1.worst_bytes
    gate.rebase(view(200))  # the long one finished (or was cancelled): no more padding to it
    assert gate.memory.reserved_bytes == costmodel.batch_cost_bytes(gate.model, 1, 200, 0, 0, 0)
    assert gate.memory.reserved_bytes < d1.worst_bytes
    gate.rebase(view())
    assert gate.memory.reserved_bytes == 0


# -- chunk and pressure -------------------------------------------------------------------


def test_the_chunk_is_the_largest_whose_step_fits_beside_the_cache() -> None:
    gate, _ = make_gate(make_model(kv_bytes_per_token=1024, budget_bytes=12 * MIB,
                                   prefill_b_bytes=4 * MIB, prefill_c_bytes=0.0))
    v = view(1000, prefilling=1)
    chunk = gate.chunk(v, paced=512)

    def cost(n: int) -> int:
        return costmodel.batch_cost_bytes(gate.model, 1, 1000, n, 1, 1000)

    assert 32 < chunk < 512
    assert cost(chunk) <= gate.model.budget_bytes < cost(chunk + 1)
    assert gate.chunk(v, paced=16) == 16  # never above the pace


def test_pressure_stops_admitting_then_evicts_only_if_needed() -> None:
    gate, probe = make_gate()
    d = gate.can_admit(view(), 3000, 1000)
    gate.reserve(d)
    probe.system_available_bytes = 1 * MIB  # another app took nearly everything
    action = gate.pressure(view(4000, 4000, 4000), chunk_tokens=512, now=0.0)
    assert not action.admit and gate.under_pressure
    assert action.chunk_tokens <= 512 and action.evict >= 1
    probe.system_available_bytes = 1 << 40  # it gave the memory back
    gate.rebase(view(4000))
    action = gate.pressure(view(4000), chunk_tokens=512, now=0.0)
    assert action.admit and not gate.under_pressure


def test_pressure_that_comes_and_goes_is_logged_loudly_at_most_every_quiet_period(
        caplog: pytest.LogCaptureFixture) -> None:
    # As on the H200 under a tight limit: in and out of pressure every second, nothing stopped.
    gate, probe = make_gate()
    gate.reserve(gate.can_admit(view(), 3000, 1000))
    caplog.set_level(logging.DEBUG, logger="worker.gate")
    for t in range(0, 40, 2):  # 40 s: a change every second
        probe.system_available_bytes = 100 * MIB
        assert not gate.pressure(view(4000), 512, now=float(t)).admit
        probe.system_available_bytes = 1 << 40
        assert gate.pressure(view(4000), 512, now=t + 1.0).admit
    lines = [r for r in caplog.records if "memory pressure" in r.getMessage()]
    loud = [r.getMessage().split(":")[0] for r in lines if r.levelno == logging.WARNING]
    assert len(lines) == 40 and gate.pressure_changes == 40
    # At 0 s, its end at 1 s (a loud start always gets its end), then at 31 s, the first
    # change 30 s after the last loud line, with the count of those between.
    assert loud == ["memory pressure began", "memory pressure ended", "memory pressure ended"]
    assert "29 more changes since the last such line" in [
        r.getMessage() for r in lines if r.levelno == logging.WARNING][2]
    assert gate.scale_report(now=40.0)["pressure_changes"] == 40
    # The last rows leaving ends a pressure too: counted, and logged since its start was.
    probe.system_available_bytes = 100 * MIB
    gate.pressure(view(4000), 512, now=100.0)
    caplog.clear()
    assert gate.pressure(view(), 512, now=101.0).admit and not gate.under_pressure
    assert gate.pressure_changes == 42
    assert [r.levelno for r in caplog.records if "memory pressure ended" in r.getMessage()] == [logging.WARNING]


def test_mlx_buffer_cache_may_keep_only_what_nobody_was_promised() -> None:
    gate, probe = make_gate()
    budget = gate.model.budget_bytes
    assert probe.pool_limit == budget                       # idle: the whole budget
    d = gate.can_admit(view(), 3000, 1000)
    gate.reserve(d)
    assert probe.pool_limit == budget - d.worst_bytes       # a promise shrinks it at once
    gate.rebase(view())
    assert probe.pool_limit == budget                       # and its end gives it back
    gate.move_limit(LIMIT // 2)
    assert probe.pool_limit == gate.model.budget_bytes < budget


def test_mlx_may_hold_weights_baseline_and_budget_before_it_waits_for_the_device() -> None:
    """MLX's own memory limit (kernels queued ahead of the device wait past it) is the
    weights, MLX's idle baseline and the budget: it follows the budget when the limit moves
    or the runtime's memory is set aside, and a promise does not lower it (promised memory
    is MLX's to use)."""
    gate, probe = make_gate()
    memory = gate.memory
    first = probe.active_limit
    assert first == memory.idle_active_bytes + gate.fitted.budget_bytes <= probe.limit_bytes
    gate.reserve(gate.can_admit(view(), 3000, 1000))
    assert probe.active_limit == first
    # The runtime's own memory seen beyond MLX's count is set aside: MLX may hold less.
    probe.footprint_bytes = probe.active_bytes + 700 * MIB
    gate.pressure(view(4000), 512, now=1.0)
    assert memory.runtime_bytes > 0
    assert probe.active_limit == memory.idle_active_bytes + gate.fitted.budget_bytes < first
    gate.move_limit(LIMIT // 2)
    assert probe.active_limit == memory.idle_active_bytes + gate.fitted.budget_bytes <= probe.limit_bytes
    assert probe.active_limit < LIMIT // 2
    gate.set_fitted(make_model(budget_bytes=100 * MIB))  # a re-fit moves it too
    assert probe.active_limit == memory.idle_active_bytes + 100 * MIB


def test_mlx_limit_stays_within_the_operators_limit_when_a_grown_scale_inflates_the_promises() -> None:
    # A step at 1.6x its prediction grows the scale; the rows' promise, re-derived at that
    # scale when one of them ends, is then far above the budget. MLX's limit stays at the
    # budget: past it the process would be past the operator's limit, and queued kernels
    # must wait there (what the rows need in order MLX still allocates).
    gate, probe = make_gate(max_running=64)
    v = view()
    while (d := gate.can_admit(v, 200, 56)).admit:
        gate.reserve(d)
        v = view(*(v.running_totals + [256]))
    predicted = gate.predict_step(v, 512, None)
    probe.active_bytes = WEIGHTS + int(1.6 * predicted)
    gate.observe_step(predicted, now=1.0)
    probe.active_bytes = WEIGHTS + 200 * MIB
    assert gate.tracker.scale > 1.5
    gate.rebase(view(*v.running_totals[:-1]))
    assert gate.memory.idle_active_bytes + gate.memory.reserved_bytes > probe.limit_bytes
    assert probe.active_limit == gate.memory.idle_active_bytes + gate.fitted.budget_bytes <= probe.limit_bytes


def test_a_step_may_queue_no_more_than_its_fitted_prediction() -> None:
    """While a step runs, MLX's limit is what it holds at idle, the prefix cache and the
    step's fitted prediction: kernels queued ahead of the device wait there, so a peak
    above the prediction is what the forward needs in order. After the step the limit is
    the pool's again. The limit does not follow the scale: a peak that reaches a scaled
    limit would grow the scale again, step after step."""
    gate, probe = make_gate()
    pool = probe.active_limit
    v = view(600, 300, prefilling=1)
    predicted = gate.predict_step(v, 256, None)
    gate.bound_step(predicted)
    assert probe.active_limit == gate.memory.idle_active_bytes + predicted < pool
    gate.end_step()
    assert probe.active_limit == pool
    # A run of steps that each fill that limit (the queue at its bound) grows nothing.
    for step in range(20):
        gate.bound_step(predicted)
        probe.active_bytes = probe.active_limit
        gate.observe_step(predicted, now=1.0 + step)
        gate.end_step()
    assert gate.tracker.scale == 1.0
    gate.grow_scale(1.5, now=30.0)
    gate.bound_step(predicted)
    assert probe.active_limit == gate.memory.idle_active_bytes + predicted  # fitted, not scaled
    # Never above the pool's limit, and nothing bound without admission.
    gate.bound_step(10 * LIMIT)
    assert probe.active_limit == pool
    unbounded, probe2 = make_gate(admission=False)
    before = probe2.active_limit
    unbounded.bound_step(predicted)
    assert probe2.active_limit == before


def test_mlx_limit_shrinks_to_what_the_device_has_free_while_another_process_holds_memory() -> None:
    gate, probe = make_gate()
    full = probe.active_limit
    gate.reserve(gate.can_admit(view(), 1000, 100))
    probe.cache_bytes = 20 * MIB
    probe.system_available_bytes = 150 * MIB  # another app took the rest of the machine
    gate.pressure(view(1100), 512, now=1.0)
    assert probe.active_limit == WEIGHTS + 20 * MIB + 150 * MIB < full
    gate.rebase(view(1100))                   # a promise changing keeps to the device's figure
    assert probe.active_limit == WEIGHTS + 20 * MIB + 150 * MIB
    probe.system_available_bytes = 1 << 40    # it left: MLX may hold the whole budget again
    gate.pressure(view(1100), 512, now=2.0)
    assert probe.active_limit == full


def test_without_admission_mlx_memory_limit_is_left_alone() -> None:
    gate, probe = make_gate(admission=False)
    gate.rebase(view())
    assert probe.active_limit is None


class StaleProbe(FakeProbe):
    """A device figure read through a slow call: reused until ``invalidate``."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.seen_available = self.system_available_bytes

    def read(self) -> Any:
        reading = super().read()
        return type(reading)(reading.active_bytes, reading.cache_bytes, reading.peak_bytes,
                             reading.footprint_bytes, self.seen_available)

    def invalidate(self) -> None:
        super().invalidate()
        self.seen_available = self.system_available_bytes


def test_pressure_is_judged_on_a_fresh_reading_never_a_stale_one() -> None:
    probe = StaleProbe(limit_bytes=LIMIT, active_bytes=WEIGHTS)
    memory = MemoryState(probe=probe, model=make_model(), weights_bytes=WEIGHTS, baseline_bytes=0)
    gate = MemoryGate(memory, fitted=memory.model, admission=True, max_running=8, now=0.0)
    gate.reserve(gate.can_admit(view(), 3000, 1000))
    probe.seen_available = 1 * MIB           # the last slow read, made mid-transient
    action = gate.pressure(view(4000, 4000, 4000), chunk_tokens=512, now=0.0)
    assert probe.invalidated == 1            # read again before acting
    assert action.admit and action.evict == 0 and not gate.under_pressure
    probe.system_available_bytes = probe.seen_available = 1 * MIB  # now another app really took it
    action = gate.pressure(view(4000, 4000, 4000), chunk_tokens=512, now=0.0)
    assert not action.admit and action.evict >= 1


OUTSIDE = 300 * MIB  # the CUDA context and loaded kernels at idle: the worker's baseline


def outside_gate(probe_class: type[FakeProbe] = FakeProbe) -> tuple[MemoryGate, MemoryState, Any, int]:
    """A gate whose process holds OUTSIDE beyond MLX's count at idle (its baseline), as a
    GPU worker's does, with one request reserved: (gate, memory, probe, budget)."""
    probe = probe_class(limit_bytes=LIMIT, active_bytes=WEIGHTS, footprint_bytes=WEIGHTS + OUTSIDE)
    memory = MemoryState(probe=probe, model=make_model(budget_bytes=LIMIT - WEIGHTS - OUTSIDE - 16 * MIB),
                         weights_bytes=WEIGHTS, baseline_bytes=OUTSIDE, active_baseline_bytes=0)
    gate = MemoryGate(memory, fitted=memory.model, admission=True, max_running=8, now=0.0)
    budget = gate.model.budget_bytes
    d = gate.can_admit(view(), 3000, 1000)
    assert d.admit
    gate.reserve(d)
    return gate, memory, probe, budget


def test_the_runtimes_own_memory_is_set_aside_once_not_taken_for_pressure(
        caplog: pytest.LogCaptureFixture) -> None:
    # As on the H200 under a tight limit: during steps the process's device footprint ran
    # 0.2-0.8 GB above MLX's active + cache + the idle baseline. It is this process's own
    # memory: the budget gives it up once; nothing stops admitting, nothing is evicted.
    gate, memory, probe, budget = outside_gate()
    assert gate.pressure(view(4000), 512, now=0.0).admit
    # A step runs: MLX allocates 100 MiB, and the runtime holds 400 MiB it does not count:
    # counted as used, that left less than the running request was promised.
    probe.active_bytes += 100 * MIB
    probe.footprint_bytes = probe.active_bytes + OUTSIDE + 400 * MIB
    memory.refresh()
    assert memory.headroom_bytes() < memory.reserved_bytes - 100 * MIB
    caplog.set_level(logging.INFO, logger="worker.gate")
    action = gate.pressure(view(4000), 512, now=1.0)
    assert action.admit and action.evict == 0 and not gate.under_pressure
    assert memory.runtime_bytes >= 400 * MIB
    assert gate.model.budget_bytes == budget - memory.runtime_bytes
    assert gate.fitted.budget_bytes == gate.model.budget_bytes   # the fit itself, not a scale
    assert memory.report(running=1, max_running=8).runtime_transient_bytes == memory.runtime_bytes
    assert probe.pool_limit == max(0, gate.model.budget_bytes - memory.reserved_bytes)  # MLX pool follows
    assert any("setting aside" in r.getMessage() for r in caplog.records)
    # The same excess again: nothing more to learn, no pressure, no new log line.
    caplog.clear()
    set_aside = memory.runtime_bytes
    assert gate.pressure(view(4000), 512, now=2.0).admit
    assert memory.runtime_bytes == set_aside and not caplog.records
    # Another process taking the device's memory is still pressure: it shows in free memory.
    probe.system_available_bytes = 1 * MIB
    action = gate.pressure(view(4000, 4000, 4000), 512, now=3.0)
    assert not action.admit and memory.runtime_bytes == set_aside


class PoolProbe(FakeProbe):
    """A runtime that keeps freed buffers in its own pool (they show in the process's device
    footprint, not in MLX's count) until MLX's cache is cleared."""

    pool_bytes: int = 0

    def clear_cache(self) -> None:
        super().clear_cache()
        self.footprint_bytes -= self.pool_bytes
        self.pool_bytes = 0


def test_what_clearing_gives_back_is_never_set_aside(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="worker.gate")
    gate, memory, probe, budget = outside_gate(PoolProbe)
    # A step freed 400 MiB that the runtime's pool keeps: the process holds it, MLX does not
    # count it, and a clear gives it back. It is not the runtime's own: nothing is set aside.
    probe.active_bytes += 100 * MIB
    probe.pool_bytes = 400 * MIB
    probe.footprint_bytes = probe.active_bytes + OUTSIDE + probe.pool_bytes
    memory.refresh()
    assert memory.headroom_bytes() < memory.reserved_bytes - 100 * MIB
    action = gate.pressure(view(4000), 512, now=1.0)
    assert probe.cleared == 1
    assert action.admit and action.evict == 0 and not gate.under_pressure
    assert memory.runtime_bytes == 0 and gate.model.budget_bytes == budget
    # The log says which kind of memory it was (what bench.runtime asks on a GPU).
    assert any("held 400 MiB beyond MLX's count; after a clear 0 MiB" in r.getMessage() for r in caplog.records)
    # What a clear does not give back is the runtime's own: set aside, after the clear.
    probe.footprint_bytes += 400 * MIB
    memory.refresh()
    assert gate.pressure(view(4000), 512, now=2.0).admit
    assert probe.cleared == 2 and memory.runtime_bytes >= 400 * MIB
    assert gate.model.budget_bytes == budget - memory.runtime_bytes


class StaleFootprintProbe(PoolProbe):
    """A footprint read before the last step's buffers were given back: read again, most of
    it is gone (what is left, 50 MiB, is too little for pressure)."""

    def invalidate(self) -> None:
        super().invalidate()
        self.footprint_bytes -= self.pool_bytes - 50 * MIB
        self.pool_bytes = 50 * MIB


def test_a_fresh_reading_that_admits_clears_nothing() -> None:
    gate, memory, probe, budget = outside_gate(StaleFootprintProbe)
    probe.active_bytes += 100 * MIB
    probe.pool_bytes = 400 * MIB
    probe.footprint_bytes = probe.active_bytes + OUTSIDE + probe.pool_bytes
    memory.refresh()
    assert gate.pressure(view(4000), 512, now=1.0).admit
    assert probe.invalidated == 1 and probe.cleared == 0  # the fresh read settled it: no clear
    assert memory.runtime_bytes == 0 and gate.model.budget_bytes == budget


def test_another_process_taking_the_device_is_never_set_aside_and_the_budget_keeps_a_floor() -> None:
    gate, memory, probe, budget = outside_gate()
    # The process grew a little, but the device's free memory is what ran out: pressure,
    # and nothing of the process's own is charged for it.
    probe.footprint_bytes += 50 * MIB
    probe.system_available_bytes = 1 * MIB
    assert not gate.pressure(view(4000), 512, now=0.0).admit
    assert memory.runtime_bytes == 0 and gate.model.budget_bytes == budget
    assert probe.cleared == 0  # nothing to learn of the process's own memory: no clear for it
    # The limit binds, and the excess is larger than the whole budget: the budget keeps
    # what a minimal request needs instead of falling to nothing.
    probe.system_available_bytes = 1 << 40
    probe.footprint_bytes = probe.active_bytes + OUTSIDE + 2 * LIMIT
    gate.pressure(view(4000), 512, now=1.0)
    floor = costmodel.request_cost_bytes(gate.model, costmodel.MIN_REQUEST_TOKENS - 1, 1)
    assert gate.model.budget_bytes == floor and costmodel.max_request_tokens(gate.model) >= costmodel.MIN_REQUEST_TOKENS - 1
    assert memory.runtime_bytes == budget - floor


def test_no_footprint_reading_means_nothing_is_set_aside() -> None:
    # Linux's CPU backend reads no footprint: MLX's count is all there is, as before.
    gate, probe = make_gate()
    gate.reserve(gate.can_admit(view(), 3000, 1000))
    budget = gate.model.budget_bytes
    probe.system_available_bytes = 1 * MIB
    assert not gate.pressure(view(4000, 4000), 512, now=0.0).admit
    assert gate.memory.runtime_bytes == 0 and gate.model.budget_bytes == budget


# -- calibration: grow at once, decay toward what is measured -----------------------------


def test_an_overshoot_grows_the_scale_at_once() -> None:
    t = ScaleTracker(now=0.0)
    assert t.observe(measured=130, predicted_fitted=100, now=1.0)
    assert t.scale == pytest.approx(1.3 * GROWTH_MARGIN)
    assert t.worst_ratio == pytest.approx(1.3)


def test_steps_under_prediction_let_the_scale_decay_but_never_below_fitted() -> None:
    t = ScaleTracker(now=0.0)
    t.observe(170, 100, now=0.0)  # an early outlier (kernel compilation)
    assert t.scale == pytest.approx(1.7 * GROWTH_MARGIN)
    # Within the window the outlier still counts: no decay below it.
    for s in range(1, int(SCALE_WINDOW_S)):
        t.observe(50, 100, now=float(s))
    assert t.scale == pytest.approx(1.7 * GROWTH_MARGIN)
    # After it, the scale decays toward what is measured, floored at the fitted model.
    for s in range(int(SCALE_WINDOW_S), int(SCALE_WINDOW_S) + 600):
        t.observe(50, 100, now=float(s))
    assert t.scale == pytest.approx(1.0, abs=0.05)
    assert t.scale >= 1.0
    whys = [c.why for c in t.history]
    assert "decay toward measured" in whys and len(whys) <= 32


def test_decay_stops_at_the_worst_recent_measurement() -> None:
    t = ScaleTracker(now=0.0)
    t.observe(200, 100, now=0.0)
    for s in range(1, 400):
        t.observe(120, 100, now=float(s))  # the model keeps under-predicting by 20%
    assert t.scale == pytest.approx(1.2 * GROWTH_MARGIN, rel=0.03)


@settings(max_examples=100, deadline=None)
@given(ratios=st.lists(st.floats(0.01, 5.0), min_size=1, max_size=200))
def test_the_scale_always_covers_the_last_step_and_the_fitted_model(ratios: list[float]) -> None:
    t = ScaleTracker(now=0.0)
    for i, r in enumerate(ratios):
        t.observe(int(r * 1_000_000), 1_000_000, now=float(i))
        assert t.scale >= 1.0
        assert t.scale >= r - 1e-6  # never below what a step in the window needed


def test_observe_step_applies_the_scale_to_the_model_admission_uses() -> None:
    gate, probe = make_gate()
    before = costmodel.max_request_tokens(gate.model)
    probe.active_bytes = WEIGHTS + 300 * MIB  # the step peaked far above
    assert gate.observe_step(predicted_fitted=100 * MIB, now=1.0)
    assert gate.model.scale == pytest.approx(3.0 * GROWTH_MARGIN)
    assert gate.fitted.scale == 1.0
    assert costmodel.max_request_tokens(gate.model) < before
    assert gate.memory.worst_measured_over_predicted == pytest.approx(3.0)
    assert gate.scale_report(now=2.0)["scale"] == pytest.approx(3.0 * GROWTH_MARGIN, rel=1e-3)


def overshoot(gate: MemoryGate, probe: FakeProbe, ratio: float, now: float) -> float:
    """One step whose peak is ``ratio`` times the prediction the server compares it with
    (``predict_step``'s, made after any earlier growth); returns that prediction."""
    predicted = gate.predict_step(view(3000, prefilling=1), 512, None)
    probe.active_bytes = WEIGHTS + int(ratio * predicted)
    gate.observe_step(predicted, now)
    probe.active_bytes = WEIGHTS
    return predicted


def test_a_run_of_overshoots_the_scale_covers_does_not_grow_it_again() -> None:
    # Issue 25: "step peak x1.03-1.52 over prediction", read as compounding. The prediction
    # compared is the fitted one (scale 1), never the scaled one: the same overshoot again
    # finds the scale covering it, so the scale is that ratio (and margin), not ratio^n.
    gate, probe = make_gate()
    predictions = {overshoot(gate, probe, 1.3, now=float(i)) for i in range(10)}
    assert len(predictions) == 1, "the prediction compared does not move with the scale"
    assert gate.tracker.scale == pytest.approx(1.3 * GROWTH_MARGIN)
    assert [c.why for c in gate.tracker.history].count("step peak x1.30 over the fitted prediction") == 1
    # Smaller overshoots, still above the fitted model, are covered too: no growth at all.
    for i, ratio in enumerate([1.1, 1.25, 1.2, 1.3], start=10):
        overshoot(gate, probe, ratio, now=float(i))
    assert gate.tracker.scale == pytest.approx(1.3 * GROWTH_MARGIN) and len(gate.tracker.history) == 2
    # A larger one grows it to that ratio, from the fitted model: 1.5, not 1.3 x 1.5.
    overshoot(gate, probe, 1.5, now=20.0)
    assert gate.tracker.scale == pytest.approx(1.5 * GROWTH_MARGIN)
    assert gate.model.scale == gate.tracker.scale and gate.fitted.scale == 1.0


# -- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("exc", [
    RuntimeError("[METAL] Command buffer execution failed: Insufficient Memory "
                 "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)"),
    RuntimeError("[metal::malloc] Attempting to allocate 9000000000 bytes which is greater "
                 "than the maximum allowed buffer size"),
    RuntimeError("CUDA error: out of memory (cudaErrorMemoryAllocation)"),
    MemoryError(),
])
def test_memory_errors_are_recognised(exc: BaseException) -> None:
    assert is_memory_error(exc)


@pytest.mark.parametrize("exc", [
    RuntimeError("[reshape] Cannot reshape array of size 12 into shape (5,)"),
    ValueError("Sequence 3 has an empty prompt."),
    KeyError(17),
    IndexError("list index out of range"),
])
def test_other_errors_are_bugs_not_memory(exc: BaseException) -> None:
    assert not is_memory_error(exc)


def test_a_caught_memory_error_releases_grows_and_exits_when_it_repeats() -> None:
    gate, probe = make_gate()
    gate.reserve(gate.can_admit(view(), 1000, 100))
    assert not gate.memory_error(now=0.0)
    assert gate.memory.reserved_bytes == 0 and probe.cleared >= 1
    assert gate.model.scale == pytest.approx(1.25)
    exits = [gate.memory_error(now=float(i)) for i in range(1, CAUGHT_ERRORS_TO_EXIT)]
    assert exits[-1] and not any(exits[:-1])


def test_without_admission_a_memory_error_does_not_grow_the_model() -> None:
    gate, _ = make_gate(admission=False)
    assert not any(gate.memory_error(now=float(i)) for i in range(5))
    assert gate.model.scale == 1.0


# -- the prefix cache's classes: evictable, promised, transient ---------------------------


class FakeCache:
    """Cached prompts held in the probe's active bytes: evicting one gives its bytes back."""

    def __init__(self, probe: FakeProbe, *sizes: int, promised: int = 0) -> None:
        self.probe = probe
        self.sizes = list(sizes)        # least recently used first
        self.promised = promised        # the first ``promised`` entries are held by requests
        self.evicted: list[tuple[int, str]] = []
        self.pending = 0                # bytes out of RAM, held by the disk writer
        self.hurried = 0                # times the gate asked the writer to write now
        self.released: list[Any] = []   # hits the gate let go of
        probe.active_bytes += sum(sizes)

    def ledger(self) -> CacheLedger:
        return CacheLedger(resident_bytes=sum(self.sizes), promised_bytes=sum(self.sizes[:self.promised]),
                           pending_bytes=self.pending)

    def evict(self, nbytes: int, reason: str) -> int:
        freed = 0
        while freed < nbytes and len(self.sizes) > self.promised:
            size = self.sizes.pop(self.promised)
            self.probe.active_bytes -= size
            self.probe.system_available_bytes += size  # given back to the system
            self.evicted.append((size, reason))
            freed += size
        return freed

    def release(self, hit: Any) -> None:
        """The hit's entry (the newest promised one) is no longer held: evictable, and the
        least recently used of the evictable ones (it was promised before they were used)."""
        assert self.promised > 0
        self.promised -= 1
        self.released.append(hit)

    def hurry(self) -> None:
        self.hurried += 1


def cached_gate(*sizes: int, promised: int = 0, **kw: Any) -> tuple[MemoryGate, FakeProbe, FakeCache]:
    gate, probe = make_gate(**kw)
    cache = FakeCache(probe, *sizes, promised=promised)
    gate.cache = cache
    return gate, probe, cache


def test_evictable_bytes_are_used_not_free_and_not_running_rows_allocations() -> None:
    gate, probe = make_gate()
    free_before = gate.free_bytes()
    gate, probe, cache = cached_gate(300 * MIB)
    assert gate.free_bytes() == free_before - 300 * MIB  # never credited to admission
    assert gate.allocated_bytes() == 0                   # nor mistaken for a row's allocation


def test_admission_evicts_least_recent_entries_before_a_request_would_wait() -> None:
    gate, probe, cache = cached_gate(200 * MIB, 200 * MIB, 200 * MIB, 200 * MIB)
    decision = gate.can_admit(view(), 3000, 500)  # ~220 MiB of KV: more than is free
    assert decision.admit
    assert cache.evicted and all(reason == "admission" for _, reason in cache.evicted)
    assert len(cache.sizes) == 3, "only as many entries as the request needs, oldest first"


def test_promised_entries_are_never_evicted_and_the_request_waits() -> None:
    gate, probe, cache = cached_gate(400 * MIB, 400 * MIB, promised=2)
    decision = gate.can_admit(view(), 3000, 500)
    assert decision.reason is RejectReason.NOT_NOW and not cache.evicted


def test_the_buffer_cache_goes_before_cached_prompts() -> None:
    gate, probe, cache = cached_gate(300 * MIB, 300 * MIB)
    probe.cache_bytes = 200 * MIB
    assert gate.can_admit(view(), 2000, 200).admit
    assert probe.cleared == 1 and not cache.evicted


def test_a_never_fitting_request_evicts_nothing() -> None:
    gate, probe, cache = cached_gate(100 * MIB, model=make_model(budget_bytes=64 * MIB))
    assert gate.can_admit(view(), 4000, 4000).reason is RejectReason.NEVER_FITS
    assert not cache.evicted


def test_cached_prompts_go_before_the_chunk_shrinks() -> None:
    gate, probe, cache = cached_gate(*[100 * MIB] * 6)
    running = view(3000, prefilling=1)
    gate.reserve(gate.can_admit(EngineView([]), 2900, 100))
    chunk = gate.chunk(running, 512)
    assert chunk == 512 and cache.evicted and {r for _, r in cache.evicted} == {"chunk"}
    # With every entry promised there is nothing to give back: then the chunk shrinks.
    gate, probe, cache = cached_gate(*[100 * MIB] * 6, promised=6)
    assert gate.chunk(running, 512) < 512 and not cache.evicted


def test_a_hit_joining_the_batch_is_charged_to_that_step() -> None:
    gate, _ = make_gate()
    plain = view(1000, prefilling=1)
    joining = EngineView([1000], prefilling=1, prefill_rows=1, joining_bytes=50 * MIB)
    assert gate.predict_step(joining, 256, None) == gate.predict_step(plain, 256, None) + 50 * MIB


def test_under_pressure_cached_prompts_go_before_the_chunk_or_any_request() -> None:
    gate, probe, cache = cached_gate(150 * MIB, 150 * MIB)
    running = view(3000, 3000, prefilling=1)
    gate.memory.reserved_bytes = costmodel.batch_cost_bytes(gate.model, 2, 3000, 512, 1, 3000)
    probe.system_available_bytes = gate.memory.reserved_bytes - 200 * MIB  # another process took it
    action = gate.pressure(running, 512, now=0.0)
    assert action.evict == 0 and action.chunk_tokens == 512
    assert cache.evicted and {r for _, r in cache.evicted} == {"pressure"}
    assert gate.pressure(running, 512, now=0.0).admit, "the entries given back covered the shortage"
    # Nothing left to give back: now the chunk shrinks, then requests are stopped.
    probe.system_available_bytes = 50 * MIB
    action = gate.pressure(running, 512, now=0.0)
    assert not action.admit and (action.chunk_tokens < 512 or action.evict > 0)


def test_a_store_is_held_only_from_free_memory_within_the_budget() -> None:
    gate, probe, cache = cached_gate(100 * MIB)
    assert gate.can_hold(200 * MIB)
    assert not gate.can_hold(900 * MIB)           # more than is free: skipped, never forced
    gate.reserve(gate.can_admit(view(), 6000, 2000))
    assert not gate.can_hold(gate.model.budget_bytes - gate.memory.reserved_bytes)
    assert not cache.evicted                      # a store never evicts to make its room


def test_the_cache_is_not_measured_as_the_batch_peak() -> None:
    gate, probe, cache = cached_gate(400 * MIB)
    predicted = gate.predict_step(view(1000), 0, None)
    probe.active_bytes += predicted // 2          # the step itself used half its prediction
    assert not gate.observe_step(predicted, 1.0)
    assert gate.tracker.scale == 1.0


def test_entries_are_not_given_back_when_that_would_not_be_enough() -> None:
    gate, probe, cache = cached_gate(20 * MIB)
    probe.active_bytes = LIMIT - 100 * MIB   # another process's memory: 20 MiB of cache cannot cover it
    assert gate.can_admit(view(), 3000, 500).reason is RejectReason.NOT_NOW
    assert not cache.evicted


def test_bytes_queued_for_the_disk_writer_are_used_not_free_not_a_rows_and_not_evictable() -> None:
    gate, probe, cache = cached_gate(100 * MIB)
    free_before, room_before = gate.free_bytes(), gate.model.budget_bytes - 100 * MIB
    cache.pending = 300 * MIB                      # evicted for capacity, its write still queued
    probe.active_bytes += cache.pending
    assert gate.free_bytes() == free_before - 300 * MIB
    assert gate.allocated_bytes() == 0             # never mistaken for running rows' memory
    assert gate.can_hold(room_before - 400 * MIB) and not gate.can_hold(room_before - 300 * MIB + 1)
    decision = gate.can_admit(view(), 6000, 2000)  # needs more than giving back 100 MiB frees
    assert decision.reason is RejectReason.NOT_NOW and not cache.evicted
    # The writer waits for an idle engine; memory it holds is wanted now: it is hurried.
    assert cache.hurried == 1
    cache.pending = 0
    gate.can_admit(view(), 60000, 2000)            # short, but the writer holds nothing
    assert cache.hurried == 1


# -- the router moves this worker's limit ------------------------------------------------


def test_a_new_limit_moves_the_budget_and_the_probe_but_never_below_what_is_promised() -> None:
    gate, probe = make_gate()
    assert gate.move_limit(LIMIT) is None and gate.move_limit(0) is None  # nothing to do
    assert gate.move_limit(LIMIT + 200 * MIB) == 1000 * MIB
    assert gate.model.budget_bytes == 1000 * MIB and probe.limit_bytes == LIMIT + 200 * MIB
    decision = gate.can_admit(view(), 2000, 1000)
    gate.reserve(decision)
    promised = gate.memory.reserved_bytes
    # shrunk far below what running requests hold: the budget stops at their promise
    assert gate.move_limit(WEIGHTS) == promised
    assert probe.limit_bytes == LIMIT + 200 * MIB - (1000 * MIB - promised)
    assert moved_budget(800, 1000, 900, 0) == 700 and moved_budget(800, 1000, 900, 750) == 750


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 30.0), st.floats(0.0, 3.0)), max_size=60))
def test_the_scale_windows_max_is_the_largest_ratio_of_the_last_minute(
        steps: list[tuple[float, float]]) -> None:
    # Kept as a monotonic queue (O(1) a step): it must agree with a scan of every step.
    tracker, now, seen = ScaleTracker(0.0), 0.0, []
    for gap, ratio in steps:
        now += gap
        tracker._remember(now, ratio)
        seen.append((now, ratio))
        expected = max((r for t, r in seen if now - t <= SCALE_WINDOW_S), default=0.0)
        assert tracker.window_max(now) == expected


# -- nothing waits on memory the worker could give back (issue 30) -------------------------

# The hit handed to the request being admitted: the cache's newest promise (a whole number
# of KV steps, so it charges nothing beyond the request's length).
REUSE = SimpleNamespace(assembled_bytes=0, tokens=2 * costmodel.KV_STEP_TOKENS)


def cost_between(gate: MemoryGate, low: int, high: int) -> tuple[int, int]:
    """A (prompt, max_tokens) whose cost on an idle worker is in (low, high]."""
    for prompt in range(256, gate.model.context_length, 256):
        cost = costmodel.request_cost_bytes(gate.model, prompt, 16)
        if low < cost <= high:
            return prompt, 16
    raise AssertionError(f"no request costs between {low} and {high} bytes")


def test_a_request_that_fits_only_without_its_own_reuse_runs_cold_at_once() -> None:
    # The stall: nothing running, the entry the request would reuse held for it,
    # and the request too big to run beside it. Before, "no room now" for ever.
    gate, probe, cache = cached_gate(400 * MIB, promised=1)
    prompt, max_tokens = cost_between(gate, gate.free_bytes(), gate.model.budget_bytes)
    assert gate.can_admit(view(), prompt, max_tokens).reason is RejectReason.NOT_NOW, \
        "its reuse is held: with no way to let go of it the request would wait"
    decision = gate.can_admit(view(), prompt, max_tokens, reuse=REUSE)
    assert decision.admit and decision.cold
    assert cache.released == [REUSE] and cache.evicted == [(400 * MIB, "admission")]


def test_a_request_that_fits_beside_its_reuse_keeps_it() -> None:
    gate, probe, cache = cached_gate(100 * MIB, promised=1)
    decision = gate.can_admit(view(), 1000, 100, reuse=REUSE)
    assert decision.admit and not decision.cold
    assert not cache.released and not cache.evicted


def test_other_cached_prompts_go_before_the_requests_own_reuse() -> None:
    gate, probe, cache = cached_gate(200 * MIB, 300 * MIB, promised=1)  # its reuse, then another
    prompt, max_tokens = cost_between(gate, gate.free_bytes(), gate.free_bytes() + 300 * MIB)
    decision = gate.can_admit(view(), prompt, max_tokens, reuse=REUSE)
    assert decision.admit and not decision.cold
    assert cache.evicted == [(300 * MIB, "admission")] and not cache.released


def test_a_reuse_given_back_in_vain_is_still_reported_so_it_is_not_released_twice() -> None:
    # Another process holds the room: the request waits, and its hit was already let go of.
    gate, probe, cache = cached_gate(50 * MIB, promised=1)
    probe.system_available_bytes = 10 * MIB
    decision = gate.can_admit(view(), 3000, 500, reuse=REUSE)
    assert decision.reason is RejectReason.NOT_NOW and decision.cold
    assert cache.released == [REUSE] and not cache.evicted, "giving it back would not be enough"


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 400 * MIB), max_size=6), held=st.booleans(),
       prompt=st.integers(1, 8000), max_tokens=st.integers(1, 4000))
def test_with_nothing_running_a_request_that_fits_alone_is_never_held_back(
        sizes: list[int], held: bool, prompt: int, max_tokens: int) -> None:
    """Whatever the prompt cache holds (its own reuse among it or not), with nothing running,
    nothing promised to another request and nothing being written, a request an idle worker
    can hold is admitted now: nothing else could ever make room for it."""
    gate, probe, cache = cached_gate(*sizes, promised=1 if held and sizes else 0)
    decision = gate.can_admit(view(), prompt, max_tokens, reuse=REUSE if held and sizes else None)
    if prompt + max_tokens > gate.model.context_length or costmodel.never_fits(gate.model, prompt, max_tokens):
        assert decision.reason is RejectReason.NEVER_FITS
    else:
        assert decision.admit, (sizes, held, prompt, max_tokens, decision)


def test_a_disk_read_is_made_only_if_the_request_still_fits_beside_it() -> None:
    gate, probe = make_gate()
    prompt, max_tokens = cost_between(gate, gate.free_bytes() - 300 * MIB, gate.free_bytes() - 200 * MIB)
    assert gate.can_restore(150 * MIB, view(), prompt, max_tokens)
    assert not gate.can_restore(350 * MIB, view(), prompt, max_tokens), \
        "it would have to give the read back again to run: served cold, no read"
    # Cached prompts no request holds would be given back for the request: the read still fits.
    gate, probe, cache = cached_gate(300 * MIB)
    assert gate.free_bytes() - 150 * MIB < costmodel.request_cost_bytes(gate.model, prompt, max_tokens)
    assert gate.can_restore(150 * MIB, view(), prompt, max_tokens)
    assert not cache.evicted, "asking evicts nothing"
    room = gate.restore_room(view(), prompt, max_tokens)
    assert room(150 * MIB) and not room(350 * MIB)


def test_a_hits_join_is_promised_with_the_batch_until_its_row_has_joined() -> None:
    """A hit of several blocks joins through their concatenation, held beside the row's own
    copy for that step: admission charges it, the promise keeps it while the row has not
    joined (``rebase``), and a request whose join does not fit runs cold instead."""
    gate, _ = make_gate()
    plain = gate.can_admit(view(), 1024, 64, reuse=SimpleNamespace(assembled_bytes=0, tokens=512))
    joined = gate.can_admit(view(), 1024, 64, reuse=SimpleNamespace(assembled_bytes=40 * MIB, tokens=512))
    assert joined.admit and joined.worst_bytes == plain.worst_bytes + 40 * MIB
    gate.reserve(joined)
    pending = EngineView(running_totals=[1088], joining_bytes=80 * MIB, joining_assembled_bytes=40 * MIB)
    gate.rebase(pending)
    assert gate.memory.reserved_bytes == costmodel.batch_cost_bytes(gate.model, 1, 1088, 0, 0, 0) + 40 * MIB
    gate.rebase(view(1088))  # it joined: the copy is no longer promised
    assert gate.memory.reserved_bytes == costmodel.batch_cost_bytes(gate.model, 1, 1088, 0, 0, 0)
    # A join that does not fit beside the request makes it run cold.
    gate, _ = make_gate()
    prompt, max_tokens = cost_between(gate, 300 * MIB, 340 * MIB)
    big = SimpleNamespace(assembled_bytes=gate.free_bytes() - 290 * MIB, tokens=256)
    released: list[object] = []
    gate.cache = SimpleNamespace(ledger=lambda: CacheLedger(), release=released.append, evict=lambda n, why: 0,
                                 hurry=lambda: None)
    decision = gate.can_admit(view(), prompt, max_tokens, reuse=big)
    assert decision.admit and decision.cold and released == [big]


def test_a_reuse_off_the_kv_step_is_charged_where_its_buffer_grows() -> None:
    """mlx-lm sizes a reused prefix's buffer to exactly its length and grows it in whole
    steps from there: 235 cached tokens of a 252-token request reach 491, not 256."""
    gate, _ = make_gate()
    aligned = gate.can_admit(view(), 236, 16, reuse=SimpleNamespace(assembled_bytes=0, tokens=256))
    off = gate.can_admit(view(), 236, 16, reuse=SimpleNamespace(assembled_bytes=0, tokens=235))
    cold = gate.can_admit(view(), 236, 16)
    assert aligned.admit and off.admit and cold.admit
    assert off.worst_bytes == gate.can_admit(view(), 236, 491 - 236).worst_bytes > cold.worst_bytes
    assert aligned.worst_bytes == cold.worst_bytes


def test_a_request_that_fits_cold_is_admitted_whatever_its_reuse() -> None:
    """Near the longest request an idle worker holds, a reused prefix off the KV step (its
    row reaches up to a step past its length, kv_reach_tokens) can take the charge past the
    budget: the request must then let go of it and run cold at once, never wait for room
    that cannot come (a review of 819ab85 found such stalls)."""
    # KV-dominated, as on a model whose chunk shrinking frees little: the overhang decides.
    gate, _ = make_gate(make_model(prefill_a_bytes=100.0, prefill_c_bytes=0.0, prefill_b_bytes=0.0,
                                   budget_bytes=300 * MIB))
    longest = costmodel.max_request_tokens(gate.model)
    checked = 0
    for total in range(longest - 600, longest + 1, 8):
        for cached in (257, 300, 511, 767):
            prompt = total - 16
            if cached >= prompt or not gate.can_admit(view(), prompt, 16).admit:
                continue
            decision = gate.can_admit(view(), prompt, 16, reuse=SimpleNamespace(assembled_bytes=0, tokens=cached))
            assert decision.admit, (total, cached)
            checked += 1
    assert checked > 100


# -- scoring a prompt (prompt logprobs) -----------------------------------------------


QWEN_VOCAB = 152_064


def test_a_scoring_request_is_admitted_by_the_same_rules_with_its_scoring_charged() -> None:
    model = make_model(vocab_size=QWEN_VOCAB)
    gate, _ = make_gate(model)
    plain, scoring = gate.can_admit(view(), 2000, 1), gate.can_admit(view(), 2000, 1, scoring=True)
    assert plain.admit and scoring.admit and scoring.worst_bytes > plain.worst_bytes
    # One that could never fit, even idle, is never_fits with the bytes it needs.
    edge = costmodel.request_cost_bytes(model, 2000, 1, scoring=True)
    tight, _ = make_gate(make_model(vocab_size=QWEN_VOCAB, budget_bytes=edge - 1))
    refused = tight.can_admit(view(), 2000, 1, scoring=True)
    assert refused.reason is RejectReason.NEVER_FITS
    assert refused.needed_bytes == costmodel.request_cost_bytes(tight.model, 2000, 1, scoring=True)
    assert tight.can_admit(view(), 2000, 1).admit  # the same request without its scores fits


def test_a_running_scoring_chunk_is_charged_to_later_admissions_and_chunks() -> None:
    gate, _ = make_gate(make_model(vocab_size=QWEN_VOCAB))
    quiet = EngineView([2000], prefilling=1, prefill_rows=1)
    scoring = EngineView([2000], prefilling=1, prefill_rows=1, scoring_tokens=2000)
    assert gate.can_admit(scoring, 500, 10).worst_bytes > gate.can_admit(quiet, 500, 10).worst_bytes
    extra = costmodel.scoring_transient_bytes(gate.fitted, 256, 2000)
    assert gate.predict_step(scoring, 256, None, 256) == gate.predict_step(quiet, 256, None) + extra


def test_the_scoring_chunk_is_what_fits_beside_the_batchs_step() -> None:
    model = make_model(vocab_size=QWEN_VOCAB)
    scoring = EngineView([2000], prefilling=1, prefill_rows=0, scoring_tokens=2000)
    gate, _ = make_gate(model)
    assert gate.score_chunk(scoring, 0, 512) == 512
    batch = costmodel.batch_cost_bytes(model, 1, 2000, 0, 0, 2000)
    small, _ = make_gate(make_model(vocab_size=QWEN_VOCAB,
                                    budget_bytes=batch + costmodel.scoring_step_bytes(model, 100, 2000)))
    assert small.score_chunk(scoring, 0, 512) == 100


def test_a_steps_debug_line_says_what_the_runtime_held_beyond_mlx(caplog: pytest.LogCaptureFixture) -> None:
    # On the H200 the set-aside came from one reading (4.2 GB during eight cold prefills):
    # each step's line at DEBUG carries the excess, so a log shows which steps bring it.
    gate, memory, probe, _ = outside_gate()
    probe.active_bytes += 10 * MIB
    probe.footprint_bytes = probe.active_bytes + OUTSIDE + 64 * MIB
    memory.refresh()
    caplog.set_level(logging.DEBUG, logger="worker.gate")
    assert not gate.observe_step(100 * MIB, now=1.0)  # well under its prediction
    assert any("runtime excess 64 MiB" in r.getMessage() for r in caplog.records)
