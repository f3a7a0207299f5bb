"""The shape of a forward's transient memory over a grid, against the calibration's fit.

    python -m bench.calshape --model DIR [--stretch 4] [--contexts 0,1024,4096,8192]
                             [--chunks 1,4,16,17,32,64,128,256,512,1024,2048]
                             [--decode-rows 1,8,32] [--decode-contexts 1024,4096]
                             [--mode in-order|step-limit|queued] [--out F.json]

The worker's probe (worker/calibrate.py) fits ``b + rows·(a·chunk + d·context +
c·chunk·context)`` to a few chunks and decode steps at contexts under ~1k tokens, run in
order, and reports its error on held-out ones. This measures the same transient, the same
way (``measure_chunk``), over chunks from one token to the full step at contexts up to the
long ones real prompts reach, and decode steps of several rows, so the fit's shape can be
judged where admission relies on it. For each point: measured bytes, the probe's
prediction (raw fit, and with the worker's margin), and their ratio (> 1: the model
under-predicts). The worst ratio is the figure to read.

``--mode``: ``in-order`` (MLX's limit held at what is live: what a forward needs),
``step-limit`` (the limit at what is live plus the prediction with margin: what the worker
lets a step hold, ``MemoryGate.bound_step``; the ratio must stay near 1 and the time shows
what bounding the queue costs), ``queued`` (MLX's limit as set: kernels queued ahead count).

Each context's points share one row's cache: the chunks are prefilled one after another
from that context, so a point's context is the context before it plus its chunk.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from worker.calibrate import FIT_MARGIN, fit, measure_chunk, new_row_cache, predicted, probe

MODES = ("in-order", "step-limit", "queued")
Fit = tuple[float, float, float, float]  # b, a, c, d

FILL_CHUNK = 2048


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def fill(model: Any, cache: list[Any], tokens: int, rows: int = 1) -> None:
    """Prefill ``tokens`` into every row, unmeasured, in chunks the device takes at once."""
    import mlx.core as mx

    step = max(16, FILL_CHUNK // rows)
    done = 0
    while done < tokens:
        n = min(step, tokens - done)
        out = model(mx.zeros((rows, n), dtype=mx.int32), cache=cache)
        mx.eval(out, [c.state for c in cache])
        del out
        done += n


def _slots(cache: list[Any]) -> int:
    return 0 if cache[0].keys is None else int(cache[0].keys.shape[2])


def _measure(model: Any, cache: list[Any], chunk: int, rows: int, context: int, mode: str,
             fitted: Fit) -> dict[str, Any]:
    """One point; ``spike``: the cache grew in this step (one layer's old buffer, the step's
    zeros and their concatenation coexist: the cost model's growth spike, one layer's new
    size, charged apart from the transient)."""
    before = _slots(cache)
    allow = None
    if mode == "step-limit":
        b, a, c, d = fitted
        allow = round(FIT_MARGIN * predicted(b, a, c, d, chunk, context, rows) + _spike_bound(cache, chunk))
    started = time.perf_counter()
    measured = measure_chunk(model, cache, chunk, rows, in_order=mode == "in-order", allow_bytes=allow)
    seconds = time.perf_counter() - started
    after = _slots(cache)
    per_layer_slot = 0 if after == 0 else sum(c.keys.nbytes + c.values.nbytes for c in cache[:1]) / after
    return {"rows": rows, "chunk": chunk, "context": context, "bytes": measured, "ms": round(seconds * 1e3, 2),
            "spike": round(per_layer_slot * after) if after > before > 0 else 0}


def _spike_bound(cache: list[Any], chunk: int) -> int:
    """One layer's cache after the growth this chunk could cause (the worker charges a
    step's growth spike beside its transient)."""
    if cache[0].keys is None:
        return 0
    slots = _slots(cache)
    layer = cache[0].keys.nbytes + cache[0].values.nbytes
    return round(layer * (slots + -(-chunk // 256) * 256) / slots)


def prefill_grid(model: Any, contexts: list[int], chunks: list[int], mode: str, fitted: Fit) -> list[dict[str, Any]]:
    points = []
    for start in contexts:
        cache = new_row_cache(model)
        fill(model, cache, start)
        context = start
        for chunk in chunks:
            context += chunk
            points.append(_measure(model, cache, chunk, 1, context, mode, fitted))
        del cache
    return points


def decode_grid(model: Any, rows_list: list[int], contexts: list[int], mode: str, fitted: Fit,
                steps: int = 3) -> list[dict[str, Any]]:
    """A decode step of ``rows`` rows at ``context``: a chunk of one per row (worst of a few)."""
    points = []
    for context in contexts:
        for rows in rows_list:
            cache = new_row_cache(model, rows)
            fill(model, cache, context, rows)
            worst = max((_measure(model, cache, 1, rows, context + i + 1, mode, fitted) for i in range(steps)),
                        key=lambda p: p["bytes"] - p["spike"])
            points.append(worst)
            del cache
    return points


def judge(points: list[dict[str, Any]], fitted: Fit) -> float:
    """Add each point's prediction (the fit, + the growth spike where the cache grew, as
    the worker charges it) and ratio; the worst ratio."""
    b, a, c, d = fitted
    worst = 0.0
    for p in points:
        pred = predicted(b, a, c, d, p["chunk"], p["context"], p["rows"]) + p["spike"]
        p["predicted"] = round(pred)
        p["predicted_with_margin"] = round(pred * FIT_MARGIN)
        p["ratio"] = round(p["bytes"] / pred, 3) if pred > 0 else None
        p["ratio_with_margin"] = round(p["bytes"] / (pred * FIT_MARGIN), 3) if pred > 0 else None
        if p["ratio_with_margin"] is not None:
            worst = max(worst, p["ratio_with_margin"])
    return worst


def run(model: Any, *, stretch: int, contexts: list[int], chunks: list[int], decode_rows: list[int],
        decode_contexts: list[int], mode: str = "in-order") -> dict[str, Any]:
    started = time.monotonic()
    cal = probe(model, stretch)
    probed_s = time.monotonic() - started
    fitted = (cal.prefill_b_bytes, cal.prefill_a_bytes, cal.prefill_c_bytes, cal.prefill_d_bytes)
    prefill = prefill_grid(model, contexts, chunks, mode, fitted)
    decode = decode_grid(model, decode_rows, decode_contexts, mode, fitted) if decode_rows else []
    points = prefill + decode
    doc: dict[str, Any] = {
        "probe": {"b": cal.prefill_b_bytes, "a": cal.prefill_a_bytes, "c": cal.prefill_c_bytes,
                  "d": cal.prefill_d_bytes, "kv_bytes_per_token": cal.kv_bytes_per_token,
                  "holdout_ratio": cal.holdout_ratio, "seconds": round(probed_s, 2), "stretch": stretch},
        "mode": mode,
        "worst_ratio_with_margin": judge(points, fitted),
    }
    # The same four terms fitted to the whole grid: can the shape hold them at all, or is
    # a term missing?
    samples = [(p["rows"], p["chunk"], p["context"], p["bytes"] - p["spike"]) for p in points]
    try:
        refit = [dict(p) for p in points]
        grid = fit(samples)
        doc["grid_fit"] = {"b": grid[0], "a": grid[1], "c": grid[2], "d": grid[3],
                           "worst_ratio_with_margin": judge(refit, grid),
                           "ratios": [p["ratio"] for p in refit]}
    except ValueError as exc:
        doc["grid_fit"] = {"error": str(exc)}
    doc["points"] = points
    doc["seconds"] = round(time.monotonic() - started, 2)
    return doc


def table(doc: dict[str, Any]) -> str:
    lines = [f"mode: {doc['mode']}",
             "rows chunk context   measured MB  (growth MB)  probe-fit MB  ratio  (with margin)  grid-fit ratio      ms"]
    grid = doc.get("grid_fit", {}).get("ratios") or [None] * len(doc["points"])
    for p, g in zip(doc["points"], grid):
        lines.append(f"{p['rows']:4d} {p['chunk']:5d} {p['context']:7d} {p['bytes'] / 1e6:12.1f} "
                     f"{p['spike'] / 1e6:12.1f} "
                     f"{p['predicted'] / 1e6:13.1f} {p['ratio'] or 0:6.2f} {p['ratio_with_margin'] or 0:8.2f}"
                     f" {g if g is not None else '-':>14} {p['ms']:8.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.calshape", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a local model folder")
    ap.add_argument("--stretch", type=int, default=4, help="the probe's stretch (the worker uses 4 on a GPU)")
    ap.add_argument("--contexts", type=_ints, default=[0, 1024, 4096, 8192])
    ap.add_argument("--chunks", type=_ints, default=[1, 4, 16, 17, 32, 64, 128, 256, 512, 1024, 2048])
    ap.add_argument("--decode-rows", type=_ints, default=[1, 8, 32])
    ap.add_argument("--decode-contexts", type=_ints, default=[1024, 4096])
    ap.add_argument("--memory-limit-mb", type=int, default=30000,
                    help="MLX's memory limit for this process (stay far below the card); a point "
                         "whose weights, cache and queued buffers reach it is cut off there")
    ap.add_argument("--mode", choices=MODES, default="in-order",
                    help="in-order: MLX's limit held at what is live (no kernels queued ahead); "
                         "step-limit: at what is live plus the prediction, as the worker bounds a step; "
                         "queued: MLX's limit as set (kernels queued ahead count)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import mlx.core as mx
    from mlx_lm import load

    mx.set_memory_limit(args.memory_limit_mb << 20)
    model, _ = load(args.model)
    doc = run(model, stretch=args.stretch, contexts=args.contexts, chunks=args.chunks,
              decode_rows=args.decode_rows, decode_contexts=args.decode_contexts, mode=args.mode)
    doc["model"] = str(args.model)
    print(table(doc))
    print(json.dumps({k: v for k, v in doc.items() if k != "points"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
