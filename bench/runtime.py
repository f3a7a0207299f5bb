"""What the process holds beyond MLX's count, step by step: the runtime's own memory.

    python -m bench.runtime --model DIR [--rows 1,8] [--context 8192] [--chunks 1024,972,640]
                            [--decode-steps 4] [--passes 2] [--out F.json]

The worker charges requests against MLX's allocator (active + cache). On a GPU the process
holds more than that: the CUDA context and loaded kernels (the worker measures those once,
as its idle baseline) and whatever the runtime takes while steps run. When the latter shows
under a tight budget the gate sets it aside from the budget for good (``_set_aside_runtime``
in worker/gate.py); on the H200 eight cold ~7.5k-token prefills made it 4.2 GB, and the
budget fell below what eight agent sessions need. Whether "for good" is right depends on
what that memory is, and each answer asks for a different fix:

- a workspace a large step takes and the runtime frees after it: it is gone after the step
  (``outside`` falls back), so the cost model must charge it per step, not for good;
- memory the runtime keeps per kernel shape (plans, workspaces cached by shape): it grows
  with every new shape and a second pass over the same shapes adds nothing, so it is
  bounded by the shapes the worker runs (fewer distinct chunk and context sizes);
- a pool that keeps what was freed: ``mx.clear_cache()`` (or a trim) gives it back, so the
  gate should try that before it sets anything aside.

This runs the agents' shape on the model: ``rows`` rows prefilled chunk by chunk to
``--context`` tokens (the chunk sizes taken in turn: the worker's pacer varies them, and
memory kept per shape shows only where shapes vary), then decode steps, for every ``--rows`` value, the whole sequence
``--passes`` times (later passes repeat the first one's shapes). After each step, once the
device is done: this process's footprint (NVML on CUDA; the resident set elsewhere, where
the figure means less), MLX's active and cache bytes, ``outside`` = footprint - active -
cache - the baseline read after loading, before any forward; then ``mx.clear_cache()``
and ``outside`` again. On a CPU it runs the same path (a check of the bench, not a finding).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MIB = 1 << 20


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


class Footprint:
    """This process's device bytes: NVML's per-process figure on CUDA, else the RSS."""

    def __init__(self) -> None:
        import mlx.core as mx

        self.source = "rss"
        self._nvml: Any = None
        self._handle: Any = None
        if mx.cuda.is_available():
            from worker.devices import _import_nvml, _open_nvml

            self._nvml, self._handle = _open_nvml(_import_nvml(), dict(mx.device_info()))
            if self._handle is not None:
                self.source = "nvml"

    def read(self) -> int:
        if self._handle is None:
            import psutil

            return int(psutil.Process().memory_info().rss)
        pid = os.getpid()
        procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        return sum(int(p.usedGpuMemory or 0) for p in procs if p.pid == pid)


def _settled(fp: Footprint) -> tuple[int, int, int]:
    """(footprint, active, cache) once the device has finished what was queued."""
    import mlx.core as mx

    mx.synchronize()
    return fp.read(), mx.get_active_memory(), mx.get_cache_memory()


def _point(fp: Footprint, baseline: int, **where: Any) -> dict[str, Any]:
    import mlx.core as mx

    footprint, active, cache = _settled(fp)
    outside = footprint - active - cache - baseline
    mx.clear_cache()
    footprint_c, active_c, cache_c = _settled(fp)
    return {**where, "footprint_mib": round(footprint / MIB, 1), "active_mib": round(active / MIB, 1),
            "cache_mib": round(cache / MIB, 1), "outside_mib": round(outside / MIB, 1),
            "outside_cleared_mib": round((footprint_c - active_c - cache_c - baseline) / MIB, 1)}


def run(model: Any, *, rows_list: list[int], context: int, chunks: list[int], decode_steps: int,
        passes: int, on_point: Callable[[dict[str, Any]], None] = lambda point: None) -> dict[str, Any]:
    """The sequence, ``passes`` times; ``on_point`` sees each point as it is read (a run cut
    short keeps what it printed)."""
    import mlx.core as mx

    from worker.calibrate import new_row_cache

    fp = Footprint()
    mx.clear_cache()
    footprint, active, cache = _settled(fp)
    baseline = footprint - active - cache
    points: list[dict[str, Any]] = []
    for run_pass in range(passes):
        for rows in rows_list:
            kv = new_row_cache(model, rows)
            done = step = 0
            while done < context + decode_steps:
                n = min(chunks[step % len(chunks)], context - done) if done < context else 1
                step += 1
                started = time.perf_counter()
                out = model(mx.zeros((rows, n), dtype=mx.int32), cache=kv)
                mx.eval(out, [c.state for c in kv])
                del out
                seconds = time.perf_counter() - started
                done += n
                points.append(_point(fp, baseline, run_pass=run_pass, rows=rows, tokens=n, context=done,
                                     ms=round(seconds * 1e3, 1)))
                on_point(points[-1])
            del kv
            points.append(_point(fp, baseline, run_pass=run_pass, rows=rows, tokens=0, context=0, ms=0.0,
                                 note="rows gone"))
            on_point(points[-1])
    return {"source": fp.source, "baseline_mib": round(baseline / MIB, 1), "points": points,
            "summary": summarize(points, passes)}


def summarize(points: list[dict[str, Any]], passes: int) -> dict[str, Any]:
    """The figures that decide the fix: the most held outside MLX per pass, what a step
    leaves once MLX's cache is cleared, and what is left when no rows are live."""
    out: dict[str, Any] = {}
    for p in range(passes):
        mine = [q for q in points if q["run_pass"] == p]
        if not mine:
            continue
        out[f"pass{p}"] = {
            "outside_max_mib": max(q["outside_mib"] for q in mine),
            "outside_cleared_max_mib": max(q["outside_cleared_mib"] for q in mine),
            "outside_with_no_rows_mib": [q["outside_cleared_mib"] for q in mine if q.get("note") == "rows gone"],
        }
    if passes > 1 and "pass0" in out and f"pass{passes - 1}" in out:
        first, last = out["pass0"], out[f"pass{passes - 1}"]
        # Per-shape memory grows in the first pass only; a transient comes back every pass.
        out["growth_in_later_pass_mib"] = round(last["outside_cleared_max_mib"] - first["outside_cleared_max_mib"], 1)
    return out


HEADER = (f"{'pass':>4} {'rows':>4} {'tokens':>6} {'context':>7} {'ms':>8} {'active':>8} {'cache':>8} "
          f"{'footprint':>9} {'outside':>8} {'cleared':>8}")


def line(q: dict[str, Any]) -> str:
    return (f"{q['run_pass']:>4} {q['rows']:>4} {q['tokens']:>6} {q['context']:>7} {q['ms']:>8} "
            f"{q['active_mib']:>8} {q['cache_mib']:>8} {q['footprint_mib']:>9} {q['outside_mib']:>8} "
            f"{q['outside_cleared_mib']:>8}{'  ' + q['note'] if q.get('note') else ''}")


def table(doc: dict[str, Any]) -> str:
    lines = [f"footprint from {doc['source']}, baseline {doc['baseline_mib']} MiB (MiB; outside = footprint "
             f"- active - cache - baseline)", HEADER, *(line(q) for q in doc["points"]),
             json.dumps(doc["summary"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.runtime", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a local model folder")
    ap.add_argument("--rows", type=_ints, default=[1, 8], help="rows prefilled together, one sequence each")
    ap.add_argument("--context", type=int, default=8192, help="tokens each row is prefilled to")
    ap.add_argument("--chunks", type=_ints, default=[1024, 972, 640],
                    help="prefill chunk per step (per row), taken in turn")
    ap.add_argument("--decode-steps", type=int, default=4)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--memory-limit-mb", type=int, default=40000,
                    help="MLX's memory limit for this process (stay far below the card)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import mlx.core as mx
    from mlx_lm import load

    mx.set_memory_limit(args.memory_limit_mb * MIB)
    model, _ = load(args.model)
    print(HEADER, flush=True)
    doc = run(model, rows_list=args.rows, context=args.context, chunks=args.chunks,
              decode_steps=args.decode_steps, passes=args.passes,
              on_point=lambda q: print(line(q), flush=True))
    doc["model"] = str(args.model)
    doc["args"] = {k: v for k, v in vars(args).items() if k != "out"}
    print(table(doc))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
