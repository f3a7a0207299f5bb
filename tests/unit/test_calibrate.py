"""Tests for worker/calibrate.py, the pure parts: the fit, applying a calibration to the
static model, the cache, and the fallbacks of ``calibrate``. The probe itself (which runs
the model through MLX) is never called here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import worker.calibrate as calibrate_mod
from common.costmodel import CostModel
from worker.calibrate import (
    FIT_MARGIN, HOLDOUT_POINTS, PROBE_CHUNKS, PROBE_POINTS, Calibration, cache_key, calibrate, fit,
    fit_checked, holdout_ratio, load_cached, probe_points, store,
)

FAST = settings(max_examples=200, deadline=None)


def make_model(**overrides: Any) -> CostModel:
    values: dict[str, Any] = dict(
        kv_bytes_per_token=4096, num_layers=4, prefill_a_bytes=2000.0, prefill_c_bytes=2.0,
        growth_factor=1.0, budget_bytes=256 << 20, context_length=8192,
        prefill_step_tokens=512, prefill_batch_size=8)
    values.update(overrides)
    return CostModel(**values)


class ExplodingModel:
    """A model that must never be touched: any attribute access fails the probe at once."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the probe ran: model.{name} was read")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the probe ran: the model was called")


def synthetic(a: float, c: float, points: Any = PROBE_POINTS, b: float = 0.0, d: float = 0.0,
              rows: int = 1) -> list[tuple[int, int, int, float]]:
    return [(rows, ch, ctx, b + rows * (a * ch + d * ctx + c * ch * ctx)) for ch, ctx in points]


def bounds_every_sample(b: float, a: float, c: float, d: float,
                        points: list[tuple[int, int, int, float]]) -> bool:
    for r, ch, ctx, y in points:
        predicted = b + r * (a * ch + d * ctx + c * ch * ctx)
        tolerance = 1e-9 * max(abs(y), abs(b), abs(r * a * ch), abs(r * d * ctx), abs(r * c * ch * ctx), 1.0)
        if predicted < y - tolerance:
            return False
    return True


# -- fit -------------------------------------------------------------------------------


@pytest.mark.parametrize(("b", "a", "c", "d"), [
    (0.0, 2000.0, 2.0, 0.0), (0.0, 0.0, 64.0, 0.0), (0.0, 123456.0, 0.0, 0.0),
    (0.0, 31.5, 0.125, 0.0), (0.0, 1.0e6, 512.0, 0.0), (117e6, 2000.0, 2.0, 0.0),
    (5e6, 0.0, 0.0, 0.0), (117e6, 650_000.0, 96.0, 7_100.0), (0.0, 0.0, 0.0, 8192.0)])
def test_fit_recovers_noiseless_coefficients(b: float, a: float, c: float, d: float) -> None:
    fb, fa, fc, fd = fit(synthetic(a, c, b=b, d=d))
    assert fb == pytest.approx(b, rel=1e-6, abs=1e-3)
    assert fa == pytest.approx(a, rel=1e-6, abs=1e-3)
    assert fc == pytest.approx(c, rel=1e-6, abs=1e-6)
    assert fd == pytest.approx(d, rel=1e-6, abs=1e-3)


def test_a_fixed_per_forward_transient_is_not_charged_per_token() -> None:
    """What the H200 showed: ~117 MB per forward and a small per-token cost. A fit without
    the fixed term read it as ~3.7 MB per token and cut prompts into tiny chunks."""
    samples = synthetic(300_000.0, 64.0, b=117e6)
    fb, fa, fc, fd = fit(samples)
    assert fb == pytest.approx(117e6, rel=1e-3)
    assert fa < 400_000


def test_a_decode_rows_context_cost_is_its_own_term() -> None:
    """What the H200 showed run in order: a decode row at 4k costs ~29 MB on an 8B model
    (~7 KB per context token), while a chunk's tokens cost ~0.65 MB each and attention
    scores ~96 B per token². The probe's decode steps tell the per-row context term from
    the chunk × context one, so 32 decode rows at 4k are charged what they hold."""
    b, a, c, d = 117e6, 650_000.0, 96.0, 7_100.0
    fb, fa, fc, fd = fit(synthetic(a, c, b=b, d=d))
    predicted_32_rows = fb + 32 * (fa + fd * 4097 + fc * 4097)
    assert predicted_32_rows == pytest.approx(b + 32 * (a + d * 4097 + c * 4097), rel=1e-6)


@FAST
@given(b=st.floats(0, 1e9), a=st.floats(0, 1e7), c=st.floats(0, 1e4), d=st.floats(0, 1e5))
def test_fit_recovers_any_noiseless_surface(b: float, a: float, c: float, d: float) -> None:
    samples = synthetic(a, c, b=b, d=d)
    fb, fa, fc, fd = fit(samples)
    assert bounds_every_sample(fb, fa, fc, fd, samples)
    scale = max(b, a * 256, c * 256 * 256, d * 256, 1.0)
    for r, ch, ctx, y in samples:  # the surface, not each coefficient, is what is identified
        assert fb + r * (fa * ch + fd * ctx + fc * ch * ctx) == pytest.approx(y, rel=1e-6, abs=1e-6 * scale)


points_strategy = st.lists(
    st.tuples(st.integers(1, 32), st.integers(1, 2048), st.integers(1, 8192), st.floats(0, 1e10)),
    min_size=2, max_size=12,
)


@FAST
@given(points=points_strategy)
def test_fit_bounds_every_noisy_sample(points: list[tuple[int, int, int, float]]) -> None:
    try:
        b, a, c, d = fit(points)
    except ValueError:
        return  # fewer than four distinct points, or terms that cannot be told apart
    assert min(b, a, c, d) >= 0
    assert all(math.isfinite(v) for v in (b, a, c, d))
    assert bounds_every_sample(b, a, c, d, points)


@FAST
@given(b=st.floats(0, 1e8), a=st.floats(1, 1e6), c=st.floats(0.01, 1e3), d=st.floats(0, 1e4),
       noise=st.lists(st.floats(-0.3, 0.3), min_size=len(PROBE_POINTS),
                      max_size=len(PROBE_POINTS)))
def test_fit_bounds_noisy_probe_points(b: float, a: float, c: float, d: float, noise: list[float]) -> None:
    points = [(r, ch, ctx, y * (1 + n)) for (r, ch, ctx, y), n in zip(synthetic(a, c, b=b, d=d), noise)]
    assert bounds_every_sample(*fit(points), points)


def test_the_held_out_ratio_says_when_the_fit_under_predicts() -> None:
    b, a, c, d = 1e6, 1000.0, 1.0, 50.0
    exact = synthetic(a, c, HOLDOUT_POINTS, b=b, d=d) + synthetic(a, c, HOLDOUT_POINTS[-1:], b=b, d=d, rows=4)
    assert holdout_ratio(exact, b, a, c, d) == pytest.approx(1.0)
    worse = [(r, ch, ctx, 1.5 * y) for r, ch, ctx, y in exact]
    assert holdout_ratio(worse, b, a, c, d) == pytest.approx(1.5)
    assert holdout_ratio([], b, a, c, d) == 0.0


def test_sizing_bounds_the_held_out_samples_too() -> None:
    """The held-out error is reported on the first fit; the model sized by covers them."""
    b, a, c, d = 1e6, 1000.0, 1.0, 20.0
    samples = synthetic(a, c, PROBE_POINTS, b=b, d=d) + [(r, ch, ctx, 2.0 * y) for r, ch, ctx, y in
                                                         synthetic(a, c, HOLDOUT_POINTS, b=b, d=d)]
    fb, fa, fc, fd, held_out = fit_checked(samples, len(PROBE_POINTS))
    assert held_out == pytest.approx(2.0, rel=1e-3)
    assert bounds_every_sample(fb, fa, fc, fd, samples)


def test_probe_points_separate_the_four_terms() -> None:
    import numpy as np

    design = np.array([[1.0, ch, ctx, ch * ctx] for ch, ctx in PROBE_POINTS])
    assert np.linalg.matrix_rank(design) == 4
    assert min(ch for ch, _ in PROBE_POINTS) == 1  # decode steps...
    assert len({ctx for ch, ctx in PROBE_POINTS if ch == 1}) >= 2  # ...at several contexts
    assert len({ctx // ch for ch, ctx in PROBE_POINTS if ch > 1}) >= 2  # chunks at several too
    assert probe_points(PROBE_CHUNKS, stretch=4)[2][0] == 1  # a decode step is never stretched


@pytest.mark.parametrize("points", [
    [],
    [(1, 64, 128, 1.0e6)],
    [(1, 64, 128, 1.0e6), (1, 64, 128, 1.1e6)],
    [(1, 32, 128, 1.0e6), (1, 64, 128, 2.0e6), (1, 128, 128, 4.0e6)],  # one context: a, c entangled
    [(1, 1, 10, 1.0e6), (1, 1, 20, 2.0e6), (2, 1, 10, 2.0e6), (2, 1, 20, 4.0e6)],  # decode only
])
def test_fit_degenerate_points_raise(points: list[tuple[int, int, int, float]]) -> None:
    with pytest.raises(ValueError):
        fit(points)


# -- apply -----------------------------------------------------------------------------


def test_apply_takes_the_larger_with_margin() -> None:
    static = make_model(prefill_a_bytes=1000.0, prefill_c_bytes=10.0, kv_bytes_per_token=4096)
    cal = Calibration(prefill_a_bytes=2000.0, prefill_c_bytes=1.0, kv_bytes_per_token=8192,
                      seconds=0.3, source="probe", prefill_d_bytes=300.0)
    m = cal.apply(static)
    assert m.prefill_a_bytes == pytest.approx(2000.0 * FIT_MARGIN)
    assert m.prefill_d_bytes == pytest.approx(300.0 * FIT_MARGIN)
    assert m.prefill_c_bytes == 10.0  # a low measured c is not trusted
    assert m.kv_bytes_per_token == 8192
    assert m.prefill_step_tokens == static.prefill_step_tokens
    assert m.budget_bytes == static.budget_bytes
    assert m.context_length == static.context_length


@FAST
@given(a=st.floats(0, 1e7), c=st.floats(0, 1e4), kv=st.integers(0, 1 << 22),
       sa=st.floats(0, 1e7), sc=st.floats(0, 1e4), skv=st.integers(1, 1 << 22),
       step=st.integers(16, 8192), d=st.floats(0, 1e5), sd=st.floats(0, 1e5))
def test_apply_never_lowers_a_coefficient_nor_changes_the_chunk(
        a: float, c: float, kv: int, sa: float, sc: float, skv: int, step: int, d: float, sd: float) -> None:
    static = make_model(prefill_a_bytes=sa, prefill_c_bytes=sc, kv_bytes_per_token=skv,
                        prefill_step_tokens=step, prefill_d_bytes=sd)
    m = Calibration(a, c, kv, 0.1, "probe", prefill_d_bytes=d).apply(static)
    assert m.prefill_d_bytes >= max(sd, d * FIT_MARGIN)
    assert m.prefill_a_bytes >= static.prefill_a_bytes
    assert m.prefill_c_bytes >= static.prefill_c_bytes
    assert m.kv_bytes_per_token >= static.kv_bytes_per_token
    assert m.prefill_a_bytes >= a * FIT_MARGIN
    assert m.prefill_c_bytes >= c * FIT_MARGIN
    assert m.prefill_step_tokens == step  # the chunk is never raised above static
    unchanged = {f.name for f in dataclasses.fields(CostModel)} - {
        "prefill_a_bytes", "prefill_c_bytes", "prefill_d_bytes", "kv_bytes_per_token"}
    for name in unchanged:
        assert getattr(m, name) == getattr(static, name), name


# -- the cache -------------------------------------------------------------------------


def test_cache_key_depends_on_every_part() -> None:
    base = ("fp-abc", "0.31.1", "metal")
    keys = {
        cache_key(*base),
        cache_key("fp-abd", *base[1:]),
        cache_key(base[0], "0.32.0", *base[2:]),
        cache_key(*base[:2], "cpu"),
    }
    assert len(keys) == 4
    assert cache_key(*base) == cache_key(*base)  # stable across calls
    assert all(k.isalnum() and "/" not in k for k in keys)  # safe in a file name


def test_store_and_load_round_trip(tmp_path: Path) -> None:
    cal = Calibration(prefill_a_bytes=1234.5, prefill_c_bytes=6.75, kv_bytes_per_token=8192,
                      seconds=0.42, source="probe")
    key = cache_key("fp", "0.31.1", "cpu")
    store(tmp_path / "sub", key, cal)  # creates the directory
    loaded = load_cached(tmp_path / "sub", key)
    assert loaded == dataclasses.replace(cal, source="cache")


def test_load_missing_is_none(tmp_path: Path) -> None:
    assert load_cached(tmp_path, "nope") is None
    assert load_cached(tmp_path / "absent-dir", "nope") is None


def _write_cache(cache_dir: Path, key: str, text: str) -> None:
    (cache_dir / f"calibration-{key}.json").write_text(text)


GOOD = {"prefill_a_bytes": 1.0, "prefill_c_bytes": 2.0, "kv_bytes_per_token": 3,
        "seconds": 0.1, "source": "probe"}


@pytest.mark.parametrize("text", [
    "",
    "{not json",
    '{"prefill_a_bytes": 1.0, "prefill_c',  # truncated
    "[1, 2, 3]",
    '"a string"',
    "42",
    json.dumps({k: v for k, v in GOOD.items() if k != "kv_bytes_per_token"}),  # missing key
    json.dumps({**GOOD, "unexpected": 1}),
    "\x00\xff garbage",
])
def test_corrupt_cache_loads_as_none(tmp_path: Path, text: str) -> None:
    _write_cache(tmp_path, "k", text)
    assert load_cached(tmp_path, "k") is None


@pytest.mark.parametrize("values", [
    {"prefill_a_bytes": None},
    {"prefill_c_bytes": "lots"},
    {"kv_bytes_per_token": [4096]},
    {"prefill_a_bytes": float("nan")},
    {"prefill_c_bytes": float("inf")},
], ids=["a-null", "c-string", "kv-list", "a-nan", "c-inf"])
def test_cache_with_wrong_values_is_not_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                values: dict[str, Any]) -> None:
    """A well-formed JSON file with unusable values is corrupt too: it must not crash the
    worker's start nor poison the cost model; calibrate falls back (here, to static)."""
    _write_cache(tmp_path, "k", json.dumps({**GOOD, **values}))

    def failing_probe(model: Any, stretch: int = 1) -> Calibration:
        raise RuntimeError("no probe in unit tests")

    monkeypatch.setattr(calibrate_mod, "probe", failing_probe)
    static = make_model()
    model, cal = calibrate(ExplodingModel(), static, cache_dir=tmp_path, key="k")
    assert model == static
    assert cal.source == "static"


def test_store_to_an_unwritable_place_only_warns(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store(blocker / "cache", "k", Calibration(1.0, 2.0, 3, 0.1, "probe"))  # must not raise
    assert load_cached(blocker / "cache", "k") is None


# -- calibrate -------------------------------------------------------------------------


def test_calibrate_uses_the_cache_without_probing(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    probed: list[Any] = []

    def spy_probe(model: Any, stretch: int = 1) -> Calibration:
        probed.append(model)
        raise AssertionError("the probe ran despite a cached calibration")

    monkeypatch.setattr(calibrate_mod, "probe", spy_probe)
    static = make_model(prefill_a_bytes=1000.0, prefill_c_bytes=1.0, kv_bytes_per_token=2048)
    key = cache_key("fp", "0.31.1", "cpu")
    cached = Calibration(prefill_a_bytes=5000.0, prefill_c_bytes=3.0, kv_bytes_per_token=4096,
                         seconds=0.5, source="probe")
    store(tmp_path, key, cached)
    had_mlx = "mlx" in sys.modules

    model, cal = calibrate(ExplodingModel(), static, cache_dir=tmp_path, key=key)

    assert probed == []
    assert cal == dataclasses.replace(cached, source="cache")
    assert model == cached.apply(static)
    assert model.prefill_a_bytes == pytest.approx(5000.0 * FIT_MARGIN)
    assert model.prefill_c_bytes == pytest.approx(3.0 * FIT_MARGIN)
    assert model.kv_bytes_per_token == 4096
    assert ("mlx" in sys.modules) == had_mlx


def test_calibrate_keeps_the_static_model_when_the_probe_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_probe(model: Any, stretch: int = 1) -> Calibration:
        raise RuntimeError("[metal] out of memory")

    monkeypatch.setattr(calibrate_mod, "probe", failing_probe)
    static = make_model()
    model, cal = calibrate(ExplodingModel(), static, cache_dir=tmp_path, key="k")
    assert model is static
    assert cal.source == "static"
    assert (cal.prefill_a_bytes, cal.prefill_c_bytes, cal.kv_bytes_per_token) == (
        static.prefill_a_bytes, static.prefill_c_bytes, static.kv_bytes_per_token)
    assert list(tmp_path.iterdir()) == []  # a failed probe is not cached


def test_calibrate_without_a_cache_dir_probes_and_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    measured = Calibration(prefill_a_bytes=9000.0, prefill_c_bytes=0.5, kv_bytes_per_token=1024,
                           seconds=0.2, source="probe")
    monkeypatch.setattr(calibrate_mod, "probe", lambda model, stretch=1: measured)
    static = make_model(prefill_a_bytes=1000.0, prefill_c_bytes=4.0, kv_bytes_per_token=4096)
    model, cal = calibrate(object(), static, cache_dir=None, key="k")
    assert cal is measured
    assert model.prefill_a_bytes == pytest.approx(9000.0 * FIT_MARGIN)
    assert model.prefill_c_bytes == 4.0
    assert model.kv_bytes_per_token == 4096
    assert model.prefill_step_tokens == static.prefill_step_tokens


def test_calibrate_stores_a_fresh_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    measured = Calibration(prefill_a_bytes=3000.0, prefill_c_bytes=5.0, kv_bytes_per_token=4096,
                           seconds=0.2, source="probe")
    calls: list[Any] = []

    def counting_probe(model: Any, stretch: int = 1) -> Calibration:
        calls.append(model)
        return measured

    monkeypatch.setattr(calibrate_mod, "probe", counting_probe)
    static = make_model()
    first, _ = calibrate(object(), static, cache_dir=tmp_path, key="k")
    second, cal = calibrate(ExplodingModel(), static, cache_dir=tmp_path, key="k")
    assert len(calls) == 1  # the restart reads the cache
    assert cal.source == "cache"
    assert first == second
