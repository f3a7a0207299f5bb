"""bench/calshape.py on the demo model (real MLX, CPU backend): every point is measured
and judged against the probe's fit, and a forward run in order (MLX's memory limit held
at what is live) never needs more than the same forward with kernels queued ahead."""

from __future__ import annotations

import os

import pytest

from bench import calshape
from worker.calibrate import measure_chunk, new_row_cache
from worker.demo import default_cache_root, ensure_demo_model


@pytest.fixture(scope="module")
def model() -> object:
    from mlx_lm import load

    model, _ = load(str(ensure_demo_model(default_cache_root(os.environ))))
    return model


def test_the_grid_is_measured_and_judged_against_the_probes_fit(model: object) -> None:
    doc = calshape.run(model, stretch=1, contexts=[0, 256], chunks=[16, 64], decode_rows=[1, 4],
                       decode_contexts=[64])
    points = doc["points"]
    assert [(p["rows"], p["chunk"]) for p in points] == [(1, 16), (1, 64)] * 2 + [(1, 1), (4, 1)]
    assert [p["context"] for p in points[:4]] == [16, 80, 272, 336]
    for p in points:
        assert p["bytes"] > 0 and p["predicted"] > 0 and p["ratio"] == round(p["bytes"] / p["predicted"], 3)
    assert doc["worst_ratio_with_margin"] == max(p["ratio_with_margin"] for p in points)
    assert doc["probe"]["kv_bytes_per_token"] == 64 * 1024  # the demo's 64 KiB per token
    assert "grid_fit" in doc and "rows chunk context" in calshape.table(doc)
    assert doc["mode"] == "in-order" and doc["probe"]["d"] >= 0


def test_a_step_bounded_as_the_worker_bounds_it_is_measured_too(model: object) -> None:
    """``--mode step-limit``: MLX's limit at what is live plus the prediction with margin."""
    doc = calshape.run(model, stretch=1, contexts=[128], chunks=[64], decode_rows=[4],
                       decode_contexts=[64], mode="step-limit")
    assert doc["mode"] == "step-limit"
    assert [(p["rows"], p["chunk"]) for p in doc["points"]] == [(1, 64), (4, 1)]
    assert all(p["bytes"] > 0 and p["ratio"] is not None for p in doc["points"])


def test_a_forward_run_in_order_needs_no_more_than_one_run_ahead(model: object) -> None:
    import mlx.core as mx

    limit = mx.set_memory_limit(1 << 40)
    mx.set_memory_limit(limit)
    peaks = {}
    for in_order in (False, True):
        cache = new_row_cache(model)
        calshape.fill(model, cache, 256)
        peaks[in_order] = measure_chunk(model, cache, 128, in_order=in_order)
    # Measured on this CPU: 6.4-9.5 MB in order against 23.4-23.7 MB queued ahead (10
    # trials, 3 of them beside CPU burners).
    assert 0 < peaks[True] < 0.8 * peaks[False]
    # The probe puts MLX's memory limit back as it found it.
    assert mx.set_memory_limit(limit) == limit
