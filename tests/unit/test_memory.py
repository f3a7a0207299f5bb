"""Tests for worker/memory.py: the static cost model, the memory state and report, memory
pressure, and the bounded wait for a dead predecessor's memory.

Pure: fake readings (``FakeProbe``) and plain numbers, never MLX. The seed's cases (SGLang's
MLX memory sizing, see shared/reference/seed-memory-model.md) are expressed through
``common.costmodel`` and these functions.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common import costmodel
from common.costmodel import (
    KV_STEP_TOKENS, MIN_CHUNK_TOKENS, MIN_REQUEST_TOKENS, CostModel, batch_cost_bytes,
    fits_now, max_request_tokens, roundup, safe_prefill_chunk,
)
from tests.fakes import FakeProbe
from worker.memory import (
    MARGIN_FRACTION, MIN_MARGIN_BYTES, MemoryState, ModelShape, PressureAction,
    pressure_action, static_cost_model, wait_for_memory,
)

ROOT = Path(__file__).resolve().parents[2]
FAST = settings(max_examples=200, deadline=None)
MIB = 1 << 20
GIB = 1 << 30

# Every field DESIGN.md lists for GET /v1/memory (per worker), plus the cost model.
DESIGN_MEMORY_FIELDS = {
    "device", "limit_bytes", "budget_bytes", "active_bytes", "cache_bytes", "peak_bytes",
    "headroom_bytes", "reserved_bytes", "kv_bytes_per_token", "safe_prefill_chunk",
    "max_running_requests", "context_length", "max_request_tokens", "running",
    "system_available_bytes", "worst_measured_over_predicted", "reported_at", "cost_model",
}


def make_shape(**overrides: Any) -> ModelShape:
    """A small model, the size of the demo model's order of magnitude."""
    values: dict[str, Any] = dict(
        num_layers=4, num_kv_heads=2, head_dim=64, num_heads=4, hidden_size=256,
        intermediate_size=512, vocab_size=1000, dtype_bytes=2, context_length=4096,
        weights_bytes=64 * MIB)
    values.update(overrides)
    return ModelShape(**values)


def make_model(**overrides: Any) -> CostModel:
    values: dict[str, Any] = dict(
        kv_bytes_per_token=4096, num_layers=4, prefill_a_bytes=2000.0, prefill_c_bytes=2.0,
        growth_factor=1.0, budget_bytes=256 * MIB, context_length=8192,
        prefill_step_tokens=512, prefill_batch_size=8)
    values.update(overrides)
    return CostModel(**values)


def make_state(probe: FakeProbe | None = None, model: CostModel | None = None) -> MemoryState:
    return MemoryState(probe=probe or FakeProbe(), model=model or make_model(),
                       weights_bytes=64 * MIB, baseline_bytes=8 * MIB)


# -- import boundary -----------------------------------------------------------------


def test_memory_calibrate_pacer_import_without_mlx() -> None:
    """The pure parts load in a fresh interpreter without pulling in MLX."""
    code = (
        "import json, sys\n"
        "import worker.memory, worker.calibrate, worker.pacer\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    loaded = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert "mlx" not in loaded, "importing worker.memory/calibrate/pacer loaded mlx"
    assert "mlx_lm" not in loaded


# -- static cost model ---------------------------------------------------------------


def test_static_budget_is_limit_minus_weights_baseline_and_margin() -> None:
    shape = make_shape(weights_bytes=3 * GIB)
    limit, baseline = 16 * GIB, 200 * MIB
    m = static_cost_model(shape, limit_bytes=limit, baseline_bytes=baseline,
                          prefill_step_tokens=512, prefill_batch_size=8)
    margin = int((limit - 3 * GIB) * MARGIN_FRACTION)  # 5 % of 13 GiB is well above 16 MiB
    assert margin > MIN_MARGIN_BYTES
    assert m.budget_bytes == limit - 3 * GIB - baseline - margin


def test_static_margin_is_at_least_16_mib_on_a_small_limit() -> None:
    shape = make_shape(weights_bytes=10 * MIB)
    limit = 100 * MIB  # 5 % would be 5 MiB: the 16 MiB floor applies
    m = static_cost_model(shape, limit_bytes=limit, baseline_bytes=MIB,
                          prefill_step_tokens=256, prefill_batch_size=4)
    assert m.budget_bytes == limit - 10 * MIB - MIB - 16 * MIB


def test_static_kv_bytes_per_token_formula_and_passthrough() -> None:
    shape = make_shape(num_layers=28, num_kv_heads=8, head_dim=128, dtype_bytes=2,
                       context_length=32768)
    m = static_cost_model(shape, limit_bytes=32 * GIB, baseline_bytes=0,
                          prefill_step_tokens=384, prefill_batch_size=6)
    assert m.kv_bytes_per_token == 2 * 28 * 8 * 128 * 2
    assert m.num_layers == 28
    assert m.context_length == 32768
    assert m.prefill_step_tokens == 384
    assert m.prefill_batch_size == 6
    assert m.prefill_a_bytes > 0 and m.prefill_c_bytes > 0
    assert m.scale == 1.0


@FAST
@given(limit=st.integers(0, 1 << 40), weights=st.integers(0, 1 << 40),
       baseline=st.integers(0, 1 << 36))
def test_static_budget_is_never_negative(limit: int, weights: int, baseline: int) -> None:
    m = static_cost_model(make_shape(weights_bytes=weights), limit_bytes=limit,
                          baseline_bytes=baseline, prefill_step_tokens=512, prefill_batch_size=8)
    margin = max(int(max(limit - weights, 0) * MARGIN_FRACTION), MIN_MARGIN_BYTES)
    assert m.budget_bytes >= 0
    assert m.budget_bytes == max(0, limit - weights - baseline - margin)


def test_weights_above_the_limit_leave_a_zero_budget() -> None:
    m = static_cost_model(make_shape(weights_bytes=20 * GIB), limit_bytes=16 * GIB,
                          baseline_bytes=0, prefill_step_tokens=512, prefill_batch_size=8)
    assert m.budget_bytes == 0


# -- memory state: headroom and the report --------------------------------------------


def test_headroom_is_limit_minus_active_and_cache() -> None:
    probe = FakeProbe(limit_bytes=4 * GIB, active_bytes=GIB, cache_bytes=512 * MIB)
    state = make_state(probe)
    assert state.headroom_bytes() == 4 * GIB - GIB - 512 * MIB


def test_headroom_counts_the_buffer_cache() -> None:
    """Seed shortfall 5: the cache can dwarf active memory; it is used memory until cleared."""
    without = make_state(FakeProbe(limit_bytes=4 * GIB, active_bytes=GIB)).headroom_bytes()
    with_cache = make_state(FakeProbe(limit_bytes=4 * GIB, active_bytes=GIB,
                                      cache_bytes=2 * GIB)).headroom_bytes()
    assert without - with_cache == 2 * GIB


def test_free_memory_clamp_wins_over_a_big_limit() -> None:
    probe = FakeProbe(limit_bytes=64 * GIB, active_bytes=GIB, cache_bytes=0,
                      system_available_bytes=300 * MIB)
    assert make_state(probe).headroom_bytes() == 300 * MIB


def test_headroom_is_never_negative() -> None:
    probe = FakeProbe(limit_bytes=GIB, active_bytes=GIB, cache_bytes=GIB)
    assert make_state(probe).headroom_bytes() == 0
    probe2 = FakeProbe(limit_bytes=GIB, system_available_bytes=0)
    assert make_state(probe2).headroom_bytes() == 0


@FAST
@given(limit=st.integers(0, 1 << 40), active=st.integers(0, 1 << 40),
       cache=st.integers(0, 1 << 40), available=st.integers(0, 1 << 40))
def test_headroom_formula(limit: int, active: int, cache: int, available: int) -> None:
    probe = FakeProbe(limit_bytes=limit, active_bytes=active, cache_bytes=cache,
                      system_available_bytes=available)
    assert make_state(probe).headroom_bytes() == max(0, min(limit - (active + cache), available))


def test_headroom_follows_a_refresh() -> None:
    probe = FakeProbe(limit_bytes=4 * GIB, active_bytes=GIB)
    state = make_state(probe)
    assert state.headroom_bytes() == 3 * GIB
    probe.active_bytes = 2 * GIB
    state.refresh()
    assert state.headroom_bytes() == 2 * GIB


def test_report_has_every_design_field() -> None:
    model = make_model()
    probe = FakeProbe(device="fake", limit_bytes=4 * GIB, active_bytes=GIB, cache_bytes=MIB,
                      system_available_bytes=8 * GIB)
    state = MemoryState(probe=probe, model=model, weights_bytes=64 * MIB, baseline_bytes=0,
                        reserved_bytes=12345, worst_measured_over_predicted=0.876543)
    report = state.report(running=3, max_running=7).to_dict()
    missing = DESIGN_MEMORY_FIELDS - set(report)
    assert not missing, f"/v1/memory report lacks {sorted(missing)}"
    assert report["device"] == "fake"
    assert report["limit_bytes"] == 4 * GIB
    assert report["budget_bytes"] == model.budget_bytes
    assert report["active_bytes"] == GIB
    assert report["cache_bytes"] == MIB
    assert report["peak_bytes"] == GIB + MIB
    assert report["headroom_bytes"] == 4 * GIB - GIB - MIB
    assert report["reserved_bytes"] == 12345
    assert report["kv_bytes_per_token"] == model.kv_bytes_per_token
    assert report["safe_prefill_chunk"] == model.prefill_step_tokens
    assert report["max_running_requests"] == 7  # an explicit running cap passes through
    assert report["running"] == 3
    assert report["context_length"] == model.context_length
    assert report["max_request_tokens"] == max_request_tokens(model)
    assert report["max_request_tokens"] <= model.context_length
    assert report["system_available_bytes"] == 8 * GIB
    assert report["worst_measured_over_predicted"] == pytest.approx(0.8765, abs=1e-9)
    assert isinstance(report["reported_at"], float) and report["reported_at"] > 0
    assert report["cost_model"] == model.to_dict()
    assert CostModel.from_dict(report["cost_model"]) == model
    json.dumps(report)  # it travels as a status message: plain data only


def test_report_reads_afresh() -> None:
    probe = FakeProbe(limit_bytes=4 * GIB, active_bytes=GIB)
    state = make_state(probe)
    state.report(running=0, max_running=1).to_dict()
    probe.active_bytes = 3 * GIB
    report = state.report(running=0, max_running=1).to_dict()
    assert report["active_bytes"] == 3 * GIB
    assert report["headroom_bytes"] == GIB


def test_report_headroom_uses_the_system_clamp() -> None:
    probe = FakeProbe(limit_bytes=64 * GIB, system_available_bytes=100 * MIB)
    assert make_state(probe).report(running=0, max_running=4).to_dict()["headroom_bytes"] == 100 * MIB


@FAST
@given(st.lists(st.tuples(st.integers(0, 1 << 34), st.integers(0, 1 << 34)), min_size=1,
                max_size=20))
def test_peak_is_the_max_since_start(readings: list[tuple[int, int]]) -> None:
    probe = FakeProbe(limit_bytes=1 << 40)
    state = make_state(probe)
    previous = 0
    for active, cache in readings:
        probe.active_bytes, probe.cache_bytes = active, cache
        peak = state.report(running=0, max_running=1).to_dict()["peak_bytes"]
        assert peak >= previous
        assert peak >= active + cache
        previous = peak
    assert previous == max(a + c for a, c in readings)


def test_peak_survives_a_cache_clear() -> None:
    probe = FakeProbe(limit_bytes=8 * GIB, active_bytes=GIB, cache_bytes=2 * GIB)
    state = make_state(probe)
    assert state.report(running=0, max_running=1).to_dict()["peak_bytes"] == 3 * GIB
    probe.clear_cache()
    report = state.report(running=0, max_running=1).to_dict()
    assert report["cache_bytes"] == 0
    assert report["peak_bytes"] == 3 * GIB


# -- the seed's cases, through common.costmodel ---------------------------------------


def test_idle_box_gives_the_static_chunk() -> None:
    m = make_model(prefill_step_tokens=512)
    assert safe_prefill_chunk(m, free_bytes=1 << 40, context_tokens=4096, rows=1) == 512


def test_chunk_shrinks_with_less_headroom() -> None:
    m = make_model(prefill_step_tokens=4096)
    chunks = [safe_prefill_chunk(m, free, 2048, 1) for free in (1 << 36, 64 * MIB, 16 * MIB,
                                                                 4 * MIB, MIB, 0)]
    assert chunks == sorted(chunks, reverse=True)
    assert chunks[0] == 4096
    assert chunks[-1] == MIN_CHUNK_TOKENS
    assert chunks[2] < chunks[0]


def test_chunk_shrinks_with_more_running_rows() -> None:
    m = make_model(prefill_step_tokens=4096)
    free = 64 * MIB
    chunks = [safe_prefill_chunk(m, free, 2048, rows) for rows in (1, 2, 4, 8)]
    assert chunks == sorted(chunks, reverse=True)
    assert chunks[-1] < chunks[0]


@FAST
@given(free=st.integers(0, 1 << 40), less=st.integers(0, 1 << 40),
       context=st.integers(1, 1 << 17), rows=st.integers(1, 16), more=st.integers(0, 16))
def test_chunk_is_monotone_in_headroom_and_rows(free: int, less: int, context: int, rows: int,
                                                more: int) -> None:
    m = make_model(prefill_step_tokens=2048)
    chunk = safe_prefill_chunk(m, free, context, rows)
    assert MIN_CHUNK_TOKENS <= chunk <= m.prefill_step_tokens
    assert safe_prefill_chunk(m, max(0, free - less), context, rows) <= chunk
    assert safe_prefill_chunk(m, free, context, rows + more) <= chunk


def test_static_model_from_a_shape_gives_a_big_chunk_on_an_idle_box() -> None:
    m = static_cost_model(make_shape(), limit_bytes=16 * GIB, baseline_bytes=0,
                          prefill_step_tokens=512, prefill_batch_size=8)
    assert safe_prefill_chunk(m, m.budget_bytes, 4096, 1) == 512


def test_tiny_budget_is_below_a_minimal_request() -> None:
    """worker/boot.py refuses to start (NotEnoughMemory) on exactly this predicate."""
    limit = GIB
    weights = limit - MIN_MARGIN_BYTES - 512 * 1024  # little above the weights: the floor applies
    shape = make_shape(weights_bytes=weights, context_length=4096)
    m = static_cost_model(shape, limit_bytes=limit, baseline_bytes=0,
                          prefill_step_tokens=512, prefill_batch_size=8)
    assert m.budget_bytes == 512 * 1024  # positive, but less than one minimal request needs
    assert max_request_tokens(m) < min(MIN_REQUEST_TOKENS, shape.context_length)


def test_zero_budget_serves_nothing() -> None:
    m = static_cost_model(make_shape(weights_bytes=2 * GIB), limit_bytes=GIB, baseline_bytes=0,
                          prefill_step_tokens=512, prefill_batch_size=8)
    assert m.budget_bytes == 0
    assert max_request_tokens(m) < MIN_REQUEST_TOKENS


def test_roomy_budget_serves_the_whole_context() -> None:
    shape = make_shape(context_length=4096)
    m = static_cost_model(shape, limit_bytes=16 * GIB, baseline_bytes=0,
                          prefill_step_tokens=512, prefill_batch_size=8)
    assert max_request_tokens(m) == shape.context_length


def test_middling_budget_serves_what_fits_instead_of_refusing() -> None:
    """A long-context model on a small box starts and advertises what it can hold."""
    shape = make_shape(num_layers=32, num_kv_heads=8, head_dim=128, context_length=131072,
                       weights_bytes=4 * GIB)
    m = static_cost_model(shape, limit_bytes=6 * GIB, baseline_bytes=100 * MIB,
                          prefill_step_tokens=512, prefill_batch_size=8)
    served = max_request_tokens(m)
    assert MIN_REQUEST_TOKENS <= served < shape.context_length


def test_short_request_beside_a_long_one_is_charged_the_long_length() -> None:
    m = make_model(budget_bytes=1 << 40)
    long_total, short = 3000, 10
    fits, worst = fits_now(m, running_totals=[long_total], prompt_tokens=short, max_tokens=6,
                           prefill_rows=0, free_bytes=1 << 40)
    assert fits
    assert worst >= 2 * roundup(long_total) * m.kv_bytes_per_token
    _, alone = fits_now(m, running_totals=[], prompt_tokens=short, max_tokens=6,
                        prefill_rows=0, free_bytes=1 << 40)
    assert alone < roundup(long_total) * m.kv_bytes_per_token


def test_padding_can_hold_a_short_request_back() -> None:
    """The increment of joining a long row is the short row padded to the long one."""
    m = make_model(budget_bytes=1 << 40)
    long_total = 4000
    padded_row = roundup(long_total) * m.kv_bytes_per_token
    # Room for the short request alone, not for it padded to the long row.
    free = KV_STEP_TOKENS * m.kv_bytes_per_token * 2
    assert free < padded_row
    fits, _ = fits_now(m, running_totals=[long_total], prompt_tokens=10, max_tokens=6,
                       prefill_rows=0, free_bytes=free)
    assert not fits


# -- memory pressure -------------------------------------------------------------------


def test_no_pressure_when_headroom_covers_what_was_promised() -> None:
    m = make_model()
    action = pressure_action(m, headroom_bytes=100 * MIB, reserved_bytes=150 * MIB,
                             allocated_bytes=60 * MIB, running_totals=[1000, 2000],
                             chunk_tokens=384)
    assert action == PressureAction(admit=True, chunk_tokens=384, evict=0)


def test_pressure_stops_admitting_and_shrinks_the_chunk_before_evicting() -> None:
    m = make_model(budget_bytes=1 << 40)
    totals = [1000, 1000]
    need = batch_cost_bytes(m, len(totals), max(totals), MIN_CHUNK_TOKENS, 0, max(totals))
    allocated = need // 2
    # Headroom short of the reservation, but what the running rows need still fits.
    reserved = need + 64 * MIB
    headroom = need - allocated + MIB
    assert headroom < reserved - allocated
    action = pressure_action(m, headroom_bytes=headroom, reserved_bytes=reserved,
                             allocated_bytes=allocated, running_totals=totals, chunk_tokens=512)
    assert action.admit is False
    assert action.chunk_tokens < 512
    assert action.evict == 0


def test_pressure_evicts_newest_first_only_when_the_rows_cannot_fit() -> None:
    m = make_model(budget_bytes=1 << 40)
    totals = [2000, 1000, 500, 300]  # oldest first
    # Room for the oldest two rows' worst case, not for three.
    two = batch_cost_bytes(m, 2, 2000, MIN_CHUNK_TOKENS, 0, 2000)
    three = batch_cost_bytes(m, 3, 2000, MIN_CHUNK_TOKENS, 0, 2000)
    allocated = 0
    headroom = (two + three) // 2
    action = pressure_action(m, headroom_bytes=headroom, reserved_bytes=1 << 40,
                             allocated_bytes=allocated, running_totals=totals, chunk_tokens=512)
    assert action.admit is False
    assert action.evict == 2  # the two newest go; the oldest two stay
    assert action.chunk_tokens <= 512


def test_pressure_never_evicts_the_last_row() -> None:
    m = make_model()
    action = pressure_action(m, headroom_bytes=0, reserved_bytes=1 << 40, allocated_bytes=0,
                             running_totals=[8000, 8000, 8000], chunk_tokens=512)
    assert action.admit is False
    assert action.evict == 2
    single = pressure_action(m, headroom_bytes=0, reserved_bytes=1 << 40, allocated_bytes=0,
                             running_totals=[8000], chunk_tokens=512)
    assert single.evict == 0


def test_pressure_with_no_running_rows_evicts_nothing() -> None:
    m = make_model()
    action = pressure_action(m, headroom_bytes=0, reserved_bytes=MIB, allocated_bytes=0,
                             running_totals=[], chunk_tokens=256)
    assert action.admit is False
    assert action.evict == 0
    assert action.chunk_tokens <= 256


pressure_models = st.builds(
    make_model,
    kv_bytes_per_token=st.integers(1, 1 << 18),
    prefill_a_bytes=st.floats(0, 1e5),
    prefill_c_bytes=st.floats(0, 100),
    growth_factor=st.floats(0, 2),
    copy_factor=st.floats(0, 2),
    prefill_step_tokens=st.integers(MIN_CHUNK_TOKENS, 4096),
)


@FAST
@given(m=pressure_models, headroom=st.integers(0, 1 << 36), reserved=st.integers(0, 1 << 36),
       allocated=st.integers(0, 1 << 36),
       totals=st.lists(st.integers(1, 1 << 15), max_size=12),
       chunk=st.integers(1, 4096))
def test_pressure_invariants(m: CostModel, headroom: int, reserved: int, allocated: int,
                             totals: list[int], chunk: int) -> None:
    action = pressure_action(m, headroom_bytes=headroom, reserved_bytes=reserved,
                             allocated_bytes=allocated, running_totals=totals, chunk_tokens=chunk)
    promised = max(0, reserved - allocated)
    if headroom >= promised:
        assert action == PressureAction(admit=True, chunk_tokens=chunk, evict=0)
        return
    assert action.admit is False
    assert 1 <= action.chunk_tokens <= chunk
    assert 0 <= action.evict <= max(0, len(totals) - 1)

    def rows_fit(kept: list[int]) -> bool:
        need = batch_cost_bytes(m, len(kept), max(kept), MIN_CHUNK_TOKENS, 0, max(kept))
        return need - allocated <= headroom

    kept = totals[:len(totals) - action.evict]  # the oldest rows stay
    if action.evict:
        # Eviction only when all the running rows could not keep their promise ...
        assert not rows_fit(totals)
        # ... and no more than needed: one row fewer evicted would not have fitted.
        assert not rows_fit(totals[:len(kept) + 1])
        assert rows_fit(kept) or len(kept) == 1
    elif len(totals) > 1:
        assert rows_fit(totals)


@FAST
@given(m=pressure_models, headroom=st.integers(0, 1 << 34), drop=st.integers(0, 1 << 34),
       totals=st.lists(st.integers(1, 1 << 14), min_size=1, max_size=10))
def test_less_headroom_never_evicts_fewer(m: CostModel, headroom: int, drop: int,
                                          totals: list[int]) -> None:
    def act(room: int) -> PressureAction:
        return pressure_action(m, headroom_bytes=room, reserved_bytes=1 << 40, allocated_bytes=0,
                               running_totals=totals, chunk_tokens=512)

    more, less = act(headroom), act(max(0, headroom - drop))
    assert less.evict >= more.evict


# -- waiting for a dead predecessor's memory -------------------------------------------


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self.sleeps: list[float] = []
        self.reads = 0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


def test_wait_returns_at_once_when_enough() -> None:
    fc = FakeClock()
    assert wait_for_memory(lambda: 10 * GIB, 4 * GIB, 30.0, sleep=fc.sleep, clock=fc.clock)
    assert fc.sleeps == []


def test_wait_until_memory_is_released() -> None:
    fc = FakeClock()
    start = fc.now

    def available() -> int:
        # The OS frees the dead process's memory 2 s after the wait began.
        return 8 * GIB if fc.now - start >= 2.0 else GIB

    assert wait_for_memory(available, 4 * GIB, 30.0, sleep=fc.sleep, clock=fc.clock)
    assert fc.sleeps, "it must have waited"
    assert 2.0 <= fc.now - start < 30.0


def test_wait_gives_up_at_the_deadline() -> None:
    fc = FakeClock()
    start = fc.now
    reads: list[int] = []

    def available() -> int:
        reads.append(1)
        return GIB

    assert wait_for_memory(available, 4 * GIB, 5.0, sleep=fc.sleep, clock=fc.clock) is False
    assert fc.now - start == pytest.approx(5.0)
    assert sum(fc.sleeps) == pytest.approx(5.0)
    assert len(reads) <= 5.0 / 0.25 + 2  # polls at a bounded rate, never spins


def test_wait_with_zero_timeout_reads_once() -> None:
    fc = FakeClock()
    reads: list[int] = []

    def available() -> int:
        reads.append(1)
        return 0

    assert wait_for_memory(available, 1, 0.0, sleep=fc.sleep, clock=fc.clock) is False
    assert len(reads) == 1
    assert sum(fc.sleeps) == 0


@FAST
@given(timeout=st.floats(0, 60), release_at=st.floats(0, 120) | st.none())
def test_wait_is_bounded(timeout: float, release_at: float | None) -> None:
    fc = FakeClock()
    start = fc.now
    reads: list[int] = []

    def available() -> int:
        reads.append(1)
        assert len(reads) < 10_000, "wait_for_memory spins"
        released = release_at is not None and fc.now - start >= release_at
        return 4 * GIB if released else 0

    ok = wait_for_memory(available, GIB, timeout, sleep=fc.sleep, clock=fc.clock)
    assert fc.now - start <= timeout + 1e-9
    assert len(reads) <= timeout / 0.25 + 3
    if release_at is not None and release_at <= timeout - 0.25:
        assert ok
    if release_at is None:
        assert not ok


def test_costmodel_module_is_the_one_worker_memory_uses() -> None:
    """worker.memory builds on common.costmodel (the router applies the same model)."""
    m = static_cost_model(make_shape(), limit_bytes=GIB, baseline_bytes=0,
                          prefill_step_tokens=256, prefill_batch_size=4)
    assert isinstance(m, costmodel.CostModel)
    assert dataclasses.asdict(m) == m.to_dict()


def test_margin_is_a_share_of_what_is_above_the_weights() -> None:
    """An 8B 4-bit model (4.63 GB) with 1 GiB above its weights keeps most of that GiB."""
    weights = 4_630_000_000
    m = static_cost_model(make_shape(weights_bytes=weights), limit_bytes=weights + GIB,
                          baseline_bytes=0, prefill_step_tokens=512, prefill_batch_size=8)
    assert m.budget_bytes == GIB - int(GIB * MARGIN_FRACTION)


def test_a_gpu_rows_context_floor_is_one_layers_keys_and_values_twice() -> None:
    """On a GPU attention reads a layer's keys and values through a copy (the H200, in
    order: ~8.5 KB per context token per decode row of an 8B model): the static model's
    floor is twice a layer's KV per token. MLX's CPU backend, where the probe measures
    none in order, gets no floor."""
    shape = make_shape()
    gpu = static_cost_model(shape, limit_bytes=16 * GIB, baseline_bytes=0, prefill_step_tokens=512,
                            prefill_batch_size=8)
    cpu = static_cost_model(shape, limit_bytes=16 * GIB, baseline_bytes=0, prefill_step_tokens=512,
                            prefill_batch_size=8, attention_copies=False)
    assert gpu.prefill_d_bytes == 2 * gpu.kv_bytes_per_token / shape.num_layers > 0
    assert cpu.prefill_d_bytes == 0.0
    assert cpu.prefill_a_bytes == gpu.prefill_a_bytes and cpu.budget_bytes == gpu.budget_bytes
