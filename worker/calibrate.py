"""The calibration probe: replay real chunked prefills, fit the cost model to what MLX uses.

At startup (well under a second on the demo model) the probe prefills a single row in
chunks at a few sizes and contexts through the model and mlx-lm's own ``BatchKVCache``,
reads MLX's peak memory around each chunk, and fits

    transient(chunk, context) ≈ a·chunk + c·chunk·context        (per prefill row)
    kv_bytes_per_token        = cache bytes after 256 tokens / 256

The conservative fit sizes admission (the larger of measured-with-margin and static), and
the prefill chunk is never raised above the static estimate. A probe that fails keeps the static model. Results are cached by
model fingerprint, MLX version, device and limit, so a restart does not pay for it again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from common.costmodel import CostModel

log = logging.getLogger(__name__)

# (chunk tokens, context tokens after the chunk): short and long contexts, small and big
# chunks, so both terms of the transient are pinned down.
# Kept small: attention on a CPU backend is slow, and the probe must stay near a second.
PROBE_POINTS = ((32, 32), (64, 64), (64, 192), (128, 128))
# Measured coefficients are used with this margin (MLX's allocator rounds buffers up).
FIT_MARGIN = 1.15
CACHE_VERSION = 1


@dataclasses.dataclass(frozen=True, slots=True)
class Calibration:
    prefill_a_bytes: float
    prefill_c_bytes: float
    kv_bytes_per_token: int
    seconds: float
    source: str                  # "probe", "cache" or "static"

    def apply(self, static: CostModel) -> CostModel:
        """Size by the larger of the measured (with margin) and static coefficients.

        The probe's contexts are short, so a low measured c is not trusted beyond them; and
        the chunk stays the static one (the model's step, never raised by a probe).
        """
        return dataclasses.replace(
            static,
            prefill_a_bytes=max(static.prefill_a_bytes, self.prefill_a_bytes * FIT_MARGIN),
            prefill_c_bytes=max(static.prefill_c_bytes, self.prefill_c_bytes * FIT_MARGIN),
            kv_bytes_per_token=max(static.kv_bytes_per_token, self.kv_bytes_per_token),
        )


def cache_key(fingerprint: str, mlx_version: str, device: str, limit_bytes: int) -> str:
    raw = f"{CACHE_VERSION}:{fingerprint}:{mlx_version}:{device}:{limit_bytes}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def load_cached(cache_dir: Path, key: str) -> Calibration | None:
    path = cache_dir / f"calibration-{key}.json"
    try:
        data = json.loads(path.read_text())
        cal = Calibration(**{**data, "source": "cache"})
    except (OSError, ValueError, TypeError):
        return None
    numbers = (cal.prefill_a_bytes, cal.prefill_c_bytes, cal.kv_bytes_per_token, cal.seconds)
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


def fit(points: list[tuple[int, int, float]]) -> tuple[float, float]:
    """Least squares for transient = a·chunk + c·chunk·context over (chunk, context, bytes).

    Returns the conservative pair: each coefficient no lower than any single point implies
    when the other term is taken at its fitted value.
    """
    s11 = sum(ch * ch for ch, _, _ in points)
    s12 = sum(ch * ch * ctx for ch, ctx, _ in points)
    s22 = sum((ch * ctx) ** 2 for ch, ctx, _ in points)
    b1 = sum(ch * y for ch, _, y in points)
    b2 = sum(ch * ctx * y for ch, ctx, y in points)
    det = s11 * s22 - s12 * s12
    if det <= 0:
        raise ValueError("degenerate probe points")
    a = (b1 * s22 - b2 * s12) / det
    c = (s11 * b2 - s12 * b1) / det
    a, c = max(a, 0.0), max(c, 0.0)
    # Raise a until no point is above the fitted line: the fit must bound every sample.
    worst = max((y - c * ch * ctx) / ch for ch, ctx, y in points)
    return max(a, worst), c


def probe(model: Any) -> Calibration:
    """Replay chunked prefills of one row; measure transients and KV bytes per token."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    started = time.monotonic()
    samples: list[tuple[int, int, float]] = []
    kv_per_token = 0
    for chunk, context in PROBE_POINTS:
        cache = [BatchKVCache([0]) for _ in model.layers]
        before_tokens = context - chunk
        if before_tokens > 0:
            mx.eval(model(mx.zeros((1, before_tokens), dtype=mx.int32), cache=cache))
            mx.eval([c.state for c in cache])
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        out = model(mx.zeros((1, chunk), dtype=mx.int32), cache=cache)
        mx.eval(out, [c.state for c in cache])
        peak = mx.get_peak_memory() - base
        grown = mx.get_active_memory() - base - out.nbytes
        samples.append((chunk, context, float(max(peak - max(grown, 0), 0))))
        # The cache holds whole growth steps; bytes per allocated slot are bytes per token.
        slots = cache[0].keys.shape[2]
        kv_per_token = max(kv_per_token, sum(c.keys.nbytes + c.values.nbytes for c in cache) // slots)
        del out, cache
        mx.clear_cache()
    a, c = fit(samples)
    if kv_per_token <= 0:
        raise ValueError("probe did not measure the KV cache")
    return Calibration(a, c, kv_per_token, time.monotonic() - started, "probe")


def calibrate(model: Any, static: CostModel, *, cache_dir: Path | None, key: str) -> tuple[CostModel, Calibration]:
    """The cost model to admit by: cached or probed coefficients, else the static ones."""
    cal = load_cached(cache_dir, key) if cache_dir else None
    if cal is None:
        try:
            cal = probe(model)
        except Exception as exc:  # any probe failure keeps the static estimate
            log.warning("calibration probe failed (%s); using the static estimate", exc)
            return static, Calibration(static.prefill_a_bytes, static.prefill_c_bytes,
                                       static.kv_bytes_per_token, 0.0, "static")
        if cache_dir:
            store(cache_dir, key, cal)
    log.info("calibration (%s, %.2fs): a %.0f B/token (static %.0f), c %.1f B/token² "
             "(static %.1f), KV %d B/token (static %d)", cal.source, cal.seconds,
             cal.prefill_a_bytes, static.prefill_a_bytes, cal.prefill_c_bytes,
             static.prefill_c_bytes, cal.kv_bytes_per_token, static.kv_bytes_per_token)
    return cal.apply(static), cal
