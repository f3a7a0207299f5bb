"""The calibration probe: replay real chunked prefills, fit the cost model to what MLX uses.

At startup (well under a second on the demo model) the probe prefills a single row in
chunks from a few tokens to the full step, with decode steps between them, through the
model and mlx-lm's own ``BatchKVCache``, reads MLX's peak memory around each, and fits

    transient(rows, chunk, context) ≈ b + rows·(a·chunk + d·context + c·chunk·context)
    kv_bytes_per_token              = cache bytes after 256 tokens / 256

b is fixed per forward (on CUDA a 4-bit model dequantizes a large weight for a prefill
matmul: ~117 MB on an 8B model, whatever the chunk). Without it a fit charges that per
token and a long prompt is cut into tiny chunks. d is each row's cost per context token
(attention reads a layer's keys and values through a copy): a decode row at 4k costs ~29
MB on that model, which a chunk-times-context term alone never charged.

Each forward is measured *in order*: MLX's memory limit is held at what is live, so the
host waits for the device instead of queueing kernels whose buffers add up (on the H200 a
forward's buffers queued ahead reached 2-10x what it needs; the fit to them was the shape
of the queueing, held-out error 1.6-1.7). In service the gate bounds the queueing the same
way, at each step's prediction (``MemoryGate.bound_step``), so the fit and what a step may
hold agree.

Samples that are not fitted (two chunks, a decode step, and a decode step of several rows)
are held out and their measured/predicted ratio is reported, so the fit is checked, not
only made. The conservative fit sizes admission (the larger of measured-with-margin and
static), and the prefill chunk is never raised above the static estimate. A probe that
fails keeps the static model. Results are cached by model fingerprint, MLX version and
device (not the limit: ``cache_key``), so a restart does not pay for it again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from common.costmodel import CostModel

log = logging.getLogger(__name__)

# Chunks prefilled one after another into one row's cache, so each is measured at the
# context the earlier ones built (no prefix is computed just to be thrown away): tiny to
# large chunks at short and long contexts, and decode steps (a chunk of 1), so the fixed,
# per-token, per-context and per-token×context terms are told apart. ``stretch`` multiplies
# the chunks above one on a fast device (up to the full step); on a CPU backend they stay
# small, for the probe must stay near a second.
PROBE_CHUNKS = (4, 32, 1, 8, 96, 1, 16)
# Prefilled after those and not fitted: the fit's prediction error on these is reported.
HOLDOUT_CHUNKS = (64, 1, 24)
# And a decode step of this many rows, each at the context the single row reached: rows
# are charged linearly, and this checks it.
HOLDOUT_ROWS = 4


def stretched(chunk: int, stretch: int) -> int:
    """A decode step stays one token; a chunk grows with the device."""
    return chunk if chunk == 1 else chunk * stretch


def probe_points(chunks: tuple[int, ...], start: int = 0, stretch: int = 1) -> tuple[tuple[int, int], ...]:
    """(chunk, context after the chunk) for chunks prefilled in order from ``start``."""
    points, context = [], start
    for chunk in chunks:
        chunk = stretched(chunk, stretch)
        context += chunk
        points.append((chunk, context))
    return tuple(points)


PROBE_POINTS = probe_points(PROBE_CHUNKS)
HOLDOUT_POINTS = probe_points(HOLDOUT_CHUNKS, PROBE_POINTS[-1][1])
# Measured coefficients are used with this margin (MLX's allocator rounds buffers up).
FIT_MARGIN = 1.15
# 2: the fixed per-forward term; 3: sized over the held-out samples too; 4: measured in
# order, with the per-row context term.
CACHE_VERSION = 4
# A sample: (rows, chunk, context, bytes).
Sample = tuple[int, int, int, float]


@dataclasses.dataclass(frozen=True, slots=True)
class Calibration:
    prefill_a_bytes: float
    prefill_c_bytes: float
    kv_bytes_per_token: int
    seconds: float
    source: str                  # "probe", "cache" or "static"
    prefill_b_bytes: float = 0.0
    # Worst measured/predicted over the held-out samples (0: none measured).
    holdout_ratio: float = 0.0
    prefill_d_bytes: float = 0.0

    def apply(self, static: CostModel) -> CostModel:
        """Size by the larger of the measured (with margin) and static coefficients.

        The probe's contexts are short, so a low measured c is not trusted beyond them; and
        the chunk stays the static one (the model's step, never raised by a probe).
        """
        return dataclasses.replace(
            static,
            prefill_b_bytes=max(static.prefill_b_bytes, self.prefill_b_bytes * FIT_MARGIN),
            prefill_a_bytes=max(static.prefill_a_bytes, self.prefill_a_bytes * FIT_MARGIN),
            prefill_c_bytes=max(static.prefill_c_bytes, self.prefill_c_bytes * FIT_MARGIN),
            prefill_d_bytes=max(static.prefill_d_bytes, self.prefill_d_bytes * FIT_MARGIN),
            kv_bytes_per_token=max(static.kv_bytes_per_token, self.kv_bytes_per_token),
        )


def cache_key(fingerprint: str, mlx_version: str, device: str) -> str:
    """Not the limit: measured in order, a forward needs what it needs under any limit
    (the queued-ahead samples of versions before 4 grew with it)."""
    raw = f"{CACHE_VERSION}:{fingerprint}:{mlx_version}:{device}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def load_cached(cache_dir: Path, key: str) -> Calibration | None:
    path = cache_dir / f"calibration-{key}.json"
    try:
        data = json.loads(path.read_text())
        cal = Calibration(**{**data, "source": "cache"})
    except (OSError, ValueError, TypeError):
        return None
    numbers = (cal.prefill_a_bytes, cal.prefill_c_bytes, cal.prefill_b_bytes, cal.prefill_d_bytes,
               cal.kv_bytes_per_token, cal.seconds, cal.holdout_ratio)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
               for v in numbers):
        log.warning("ignoring a corrupt calibration cache %s", path)
        return None
    return cal


def store(cache_dir: Path, key: str, cal: Calibration) -> None:
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cache_dir / f".calibration-{key}.tmp"
        tmp.write_text(json.dumps(dataclasses.asdict(cal)))
        tmp.replace(cache_dir / f"calibration-{key}.json")
    except OSError as exc:  # a read-only cache only costs a probe next time
        log.warning("could not cache the calibration: %s", exc)


def fit(samples: list[Sample]) -> tuple[float, float, float, float]:
    """Non-negative least squares for transient = b + rows·(a·chunk + d·context +
    c·chunk·context) over (rows, chunk, context, bytes) samples; returns (b, a, c, d).

    Every subset of the four terms is solved and the best non-negative one kept (four
    unknowns: the exact active-set answer, no iteration). Then b is raised until no sample
    is above the fitted surface: the fit must bound every sample it was made from.
    """
    import numpy as np

    if len({(r, ch, ctx) for r, ch, ctx, _ in samples}) < 4:
        raise ValueError("degenerate probe points: need four distinct (rows, chunk, context)")
    design = np.array([[1.0, r * ch, r * ctx, r * ch * ctx] for r, ch, ctx, _ in samples])
    y = np.array([v for *_, v in samples])
    if np.linalg.matrix_rank(design) < 4:
        raise ValueError("degenerate probe points: the terms cannot be told apart")
    best: tuple[float, np.ndarray] | None = None
    for k in (4, 3, 2, 1):
        for cols in itertools.combinations(range(4), k):
            sub = design[:, cols]
            coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if (coef < 0).any():
                continue
            residual = float(np.sum((sub @ coef - y) ** 2))
            if best is None or residual < best[0]:
                full = np.zeros(4)
                full[list(cols)] = coef
                best = (residual, full)
    b, a, d, c = (0.0, 0.0, 0.0, 0.0) if best is None else (float(v) for v in best[1])
    b = max(b, max(v - predicted(0.0, a, c, d, ch, ctx, r) for r, ch, ctx, v in samples), 0.0)
    return b, a, c, d


def predicted(b: float, a: float, c: float, d: float, chunk: int, context: int, rows: int = 1) -> float:
    return b + rows * (a * chunk + d * context + c * chunk * context)


def probe(model: Any, stretch: int = 1) -> Calibration:
    """Replay chunked prefills and decode steps, in order; measure transients and KV bytes
    per token."""
    import mlx.core as mx

    started = time.monotonic()
    samples: list[Sample] = []
    kv_per_token = 0
    cache = new_row_cache(model)
    context = 0
    for chunk in PROBE_CHUNKS + HOLDOUT_CHUNKS:
        chunk = stretched(chunk, stretch)
        context += chunk
        samples.append((1, chunk, context, measure_chunk(model, cache, chunk, in_order=True)))
        # The cache holds whole growth steps; bytes per allocated slot are bytes per token.
        slots = cache[0].keys.shape[2]
        kv_per_token = max(kv_per_token, sum(c.keys.nbytes + c.values.nbytes for c in cache) // slots)
    samples.append((HOLDOUT_ROWS, 1, context + 1, measure_chunk(model, widen(cache, HOLDOUT_ROWS), 1,
                                                                 HOLDOUT_ROWS, in_order=True)))
    del cache
    mx.clear_cache()
    if kv_per_token <= 0:
        raise ValueError("probe did not measure the KV cache")
    b, a, c, d, held_out = fit_checked(samples, len(PROBE_POINTS))
    return Calibration(a, c, kv_per_token, time.monotonic() - started, "probe",
                       prefill_b_bytes=b, holdout_ratio=held_out, prefill_d_bytes=d)


def widen(cache: list[Any], rows: int) -> list[Any]:
    """A batch cache of ``rows`` copies of a one-row cache's rows (what several rows at
    that context hold, without prefilling each)."""
    import mlx.core as mx

    from mlx_lm.models.cache import BatchKVCache

    wide = [BatchKVCache([0] * rows) for _ in cache]
    for one, many in zip(cache, wide):
        keys, values, offset, left_padding, idx = one.state
        many.state = (mx.repeat(keys, rows, axis=0), mx.repeat(values, rows, axis=0),
                      mx.repeat(offset, rows, axis=0), mx.repeat(left_padding, rows, axis=0), idx)
    return wide


def new_row_cache(model: Any, rows: int = 1) -> list[Any]:
    """An empty batch cache of ``rows`` rows, as the engine's BatchGenerator makes it."""
    from mlx_lm.models.cache import BatchKVCache

    return [BatchKVCache([0] * rows) for _ in model.layers]


def measure_chunk(model: Any, cache: list[Any], chunk: int, rows: int = 1, *, in_order: bool = False,
                  allow_bytes: int | None = None) -> float:
    """Prefill ``chunk`` tokens into each of the ``rows`` rows of ``cache`` (a chunk of one
    is a decode step); the step's transient in bytes: MLX's peak above what was live
    before it, less what stays (the cache's growth; the logits, which the engine would
    sample and drop).

    ``in_order``: MLX's memory limit is held at what is live, so its evaluation waits for
    the device before every allocation past it: the peak is what the forward needs run in
    order, without the buffers of kernels queued ahead of the device (on a GPU backend the
    host runs ahead and each queued kernel's buffers stay until the device has run it).
    ``allow_bytes``: the limit is that much above what is live instead (the worker's step
    limit, ``MemoryGate.bound_step``); None and not in order: MLX's limit as it is.
    """
    import mlx.core as mx

    mx.eval([c.state for c in cache if c.keys is not None])
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    if in_order:
        allow_bytes = 0
    previous = mx.set_memory_limit(base + allow_bytes) if allow_bytes is not None else None
    try:
        mx.reset_peak_memory()
        out = model(mx.zeros((rows, chunk), dtype=mx.int32), cache=cache)
        mx.eval(out, [c.state for c in cache])
    finally:
        if previous is not None:
            mx.set_memory_limit(previous)
    peak = mx.get_peak_memory() - base
    grown = mx.get_active_memory() - base - out.nbytes
    del out
    return float(max(peak - max(grown, 0), 0))


def fit_checked(samples: list[Sample], fitted: int) -> tuple[float, float, float, float, float]:
    """Fit the first ``fitted`` samples and report the error on the rest; then size by a
    fit over all of them, so the model bounds every sample measured. Returns (b, a, c, d,
    held-out ratio)."""
    b, a, c, d = fit(samples[:fitted])
    held_out = holdout_ratio(samples[fitted:], b, a, c, d)
    b, a, c, d = fit(samples)
    return b, a, c, d, held_out


def holdout_ratio(held: list[Sample], b: float, a: float, c: float, d: float) -> float:
    """Worst measured/predicted on samples the fit never saw (> 1: it under-predicts)."""
    ratios = [v / p for r, ch, ctx, v in held if (p := predicted(b, a, c, d, ch, ctx, r)) > 0]
    return round(max(ratios, default=0.0), 4)


def calibrate(model: Any, static: CostModel, *, cache_dir: Path | None, key: str,
              stretch: int = 1) -> tuple[CostModel, Calibration]:
    """The cost model to admit by: cached or probed coefficients, else the static ones."""
    cal = load_cached(cache_dir, key) if cache_dir else None
    if cal is None:
        try:
            cal = probe(model, stretch)
        except Exception as exc:  # any probe failure keeps the static estimate
            log.warning("calibration probe failed (%s); using the static estimate", exc)
            return static, Calibration(static.prefill_a_bytes, static.prefill_c_bytes,
                                       static.kv_bytes_per_token, 0.0, "static",
                                       prefill_b_bytes=static.prefill_b_bytes,
                                       prefill_d_bytes=static.prefill_d_bytes)
        if cache_dir:
            store(cache_dir, key, cal)
    log.info("calibration (%s, %.2fs): b %.0f B/forward, a %.0f B/token (static %.0f), "
             "c %.1f B/token² (static %.1f), d %.0f B/row/context token (static %.0f), "
             "KV %d B/token (static %d), held-out measured/predicted %.2f",
             cal.source, cal.seconds, cal.prefill_b_bytes, cal.prefill_a_bytes, static.prefill_a_bytes,
             cal.prefill_c_bytes, static.prefill_c_bytes, cal.prefill_d_bytes, static.prefill_d_bytes,
             cal.kv_bytes_per_token, static.kv_bytes_per_token, cal.holdout_ratio)
    return cal.apply(static), cal
