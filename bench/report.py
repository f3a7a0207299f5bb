"""Derived figures, targets, the printed table and the JSON document.

Derived (all at concurrency 1 unless said; formulas also in bench/README.md):
- overhead_us_per_token[s] = (1/tps[s] − 1/tps[inprocess]) × 1e6: the wall time a server
  adds per generated token over the bare BatchGenerator loop.
- cpu_overhead_us_per_token[s][c] = (cpu_ms_per_token[s] − cpu_ms_per_token[inprocess]) × 1e3,
  at every concurrency: the CPU a server burns per token beyond the model's own.
- added_ttft_ms[s] = ttft_p50[s] − ttft_p50[inprocess]: what HTTP, tokenizing, queueing
  and IPC add before the first token.
- tps_ratio_vs_headroom[s][c] = tps[s] / tps[headroom]; tps_ratio_vs_inprocess likewise.
Targets are printed beside the figures; nothing is asserted here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from bench.metrics import FIGURES, Summary, is_good, why_not_good

HEADROOM, MLX_LM, INPROC = "headroom", "mlx_lm_server", "inprocess"


def derive(summaries: dict[str, dict[int, Summary]]) -> tuple[dict[str, Any], list[str]]:
    """The derived figures, and notes saying why any of them is missing or not > 0."""
    notes: list[str] = []
    out: dict[str, Any] = {"overhead_us_per_token": {}, "added_ttft_ms": {},
                           "cpu_overhead_us_per_token": {},
                           "tps_ratio_vs_headroom": {}, "tps_ratio_vs_inprocess": {}}
    floor = summaries.get(INPROC, {}).get(1)
    servers = [s for s in summaries if s != INPROC]
    if floor is None:
        notes.append("overhead and added TTFT need the inprocess system at concurrency 1")
    for s in servers:
        mine = summaries[s].get(1)
        if floor is None or mine is None:
            continue
        if is_good(mine.tokens_per_s) and is_good(floor.tokens_per_s):
            out["overhead_us_per_token"][s] = (1 / mine.tokens_per_s - 1 / floor.tokens_per_s) * 1e6
        out["added_ttft_ms"][s] = mine.ttft_p50_ms - floor.ttft_p50_ms
    for s in servers:  # CPU time is far less disturbed by a busy machine than wall time
        floors = summaries.get(INPROC, {})
        out["cpu_overhead_us_per_token"][s] = {
            str(c): (v.cpu_ms_per_token - floors[c].cpu_ms_per_token) * 1e3
            for c, v in summaries[s].items() if c in floors}
    for key, base in (("tps_ratio_vs_headroom", HEADROOM), ("tps_ratio_vs_inprocess", INPROC)):
        if base not in summaries:
            notes.append(f"{key} needs the {base} system")
            continue
        for s, by_c in summaries.items():
            ratios = {str(c): by_c[c].tokens_per_s / summaries[base][c].tokens_per_s
                      for c in by_c if c in summaries[base] and is_good(summaries[base][c].tokens_per_s)}
            out[key][s] = ratios
    flat = [(f"{key}[{s}]", v) for key in ("overhead_us_per_token", "added_ttft_ms")
            for s, v in out[key].items()]
    flat += [(f"cpu_overhead_us_per_token[{s}][{c}]", v)
             for s, by_c in out["cpu_overhead_us_per_token"].items() for c, v in by_c.items()]
    for name, v in flat:
        if not math.isfinite(v):
            notes.append(f"{name} could not be computed: see the per-system notes")
        elif not is_good(v):
            notes.append(f"{name} = {v:.4g} is not > 0: measured at or below the in-process "
                         f"floor, i.e. the difference is within run-to-run noise (see "
                         f"tokens_per_s_by_rep; CPU times tick at 10 ms)")
    return out, notes


def targets(summaries: dict[str, dict[int, Summary]], derived: dict[str, Any],
            model: str) -> list[dict[str, Any]]:
    """The project's targets, evaluated where the run has the data (printed, not asserted)."""
    rows: list[dict[str, Any]] = []

    def add(name: str, value: float | None, op: str, bound: float, applies: str) -> None:
        met = None if value is None or not math.isfinite(value) else (
            value >= bound if op == ">=" else value < bound)
        rows.append({"target": name, "value": value, "bound": f"{op} {bound}", "met": met,
                     "applies_to": applies})

    for c in (1, 8):
        r = derived["tps_ratio_vs_headroom"].get(MLX_LM, {}).get(str(c))
        add(f"headroom tps / mlx_lm_server tps at c={c}", None if not r else 1 / r, ">=", 1.0, "demo")
    add("headroom added TTFT vs inprocess at c=1 (ms)", derived["added_ttft_ms"].get(HEADROOM),
        "<", 3.0, "demo")
    add("headroom tps / inprocess tps at c=8", derived["tps_ratio_vs_inprocess"].get(HEADROOM, {}).get("8"),
        ">=", 0.9, "bench-shaped")
    for row in rows:
        row["this_model"] = row["applies_to"] == model
    return rows


def build(meta: dict[str, Any], summaries: dict[str, dict[int, Summary]],
          warmup: dict[str, Any]) -> dict[str, Any]:
    derived, notes = derive(summaries)
    for by_c in summaries.values():
        for summary in by_c.values():
            for fig in FIGURES + ("errors",):
                why = (f"{summary.errors} requests failed: {summary.error_samples[0]}"
                       if fig == "errors" and summary.errors else
                       None if fig == "errors" else why_not_good(summary, fig))
                if why:
                    notes.append(f"{summary.system} c={summary.concurrency} {fig}: {why}")
            if summary.worker_restarts:
                notes.append(
                    f"{summary.system} c={summary.concurrency}: its worker was restarted "
                    f"{summary.worker_restarts} time(s) during these workloads; requests that had "
                    f"produced nothing were retried on the new worker, so they count as successes "
                    f"with the restart inside their TTFT and the workload's tokens/s")
    return {"meta": meta, "warmup": warmup,
            "results": {s: {str(c): v.to_dict() for c, v in by_c.items()} for s, by_c in summaries.items()},
            "derived": derived, "targets": targets(summaries, derived, meta["model"]["name"]),
            "notes": notes}


def _fmt(v: float | None, digits: int = 2) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def _spread(values: list[float]) -> str:
    """(max − min) / mean of the per-repetition tokens/s: how far apart the repeats were."""
    good = [v for v in values if v is not None and math.isfinite(v)]
    if len(good) < 2:
        return "-"
    return f"{(max(good) - min(good)) / (sum(good) / len(good)) * 100:.0f}%"


def render(doc: dict[str, Any]) -> str:
    """The table printed to stdout."""
    d, m = doc["derived"], doc["meta"]
    head = (f"{'system':<14}{'c':>3}{'tok/s':>9}{'req/s':>8}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}"
            f"{'p99':>8}{'TPOT':>7}{'chunk/req':>10}{'CPU/tok':>8}{'err':>5}{'÷headroom':>10}"
            f"{'÷inproc':>9}{'rep spread':>11}")
    lines = [f"model {doc['meta']['model']['name']} ({doc['meta']['model']['folder']}), "
             f"max_tokens {doc['meta']['max_tokens']}, prompt ~{doc['meta']['prompt_tokens']} tokens, "
             f"{doc['meta']['requests']} requests x {doc['meta']['repeats']} repeats per workload",
             f"{m['machine']['platform']}, {m['machine']['cpu_count']} CPUs, mlx {m['machine']['mlx']} "
             f"({m['machine']['device']}), mlx-lm {m['machine']['mlx_lm']}, commit {m['git']['commit'][:8]}"
             f"{' (dirty)' if m['git']['dirty_files'] else ''}; load average before/after "
             f"{m['loadavg_before'][0]:.2f}/{m['loadavg_after'][0]:.2f}",
             "times in ms; TTFT/ITL from the client's send; ITL is the gap between output chunks; "
             "CPU/tok = CPU ms of the system's processes per generated token; rep spread = "
             "(max - min) / mean of the repetitions' tokens/s",
             head, "-" * len(head)]
    for s, by_c in doc["results"].items():
        for c, r in by_c.items():
            lines.append(
                f"{s:<14}{c:>3}{_fmt(r['tokens_per_s'], 1):>9}{_fmt(r['requests_per_s']):>8}"
                f"{_fmt(r['ttft_p50_ms']):>10}{_fmt(r['ttft_p99_ms']):>8}{_fmt(r['itl_p50_ms']):>9}"
                f"{_fmt(r['itl_p99_ms']):>8}{_fmt(r['tpot_ms']):>7}{_fmt(r['chunks_per_request'], 1):>10}"
                f"{_fmt(r['cpu_ms_per_token']):>8}{r['errors']:>5}{_fmt(d['tps_ratio_vs_headroom'].get(s, {}).get(c), 3):>10}"
                f"{_fmt(d['tps_ratio_vs_inprocess'].get(s, {}).get(c), 3):>9}"
                f"{_spread(r['tokens_per_s_by_rep']):>11}")
    lines.append("")
    lines.append("vs inprocess: overhead = (1/tps_sys - 1/tps_inproc)*1e6 us/token at c=1; added TTFT = "
                 "TTFT p50 sys - TTFT p50 inproc at c=1; extra CPU = CPU/tok sys - CPU/tok inproc")
    for s in sorted(d["overhead_us_per_token"].keys() | d["added_ttft_ms"].keys()):
        cpu = "  ".join(f"c={c} {_fmt(v, 0)}" for c, v in d["cpu_overhead_us_per_token"].get(s, {}).items())
        lines.append(f"  {s:<14} overhead {_fmt(d['overhead_us_per_token'].get(s), 1):>8} us/token   "
                     f"added TTFT {_fmt(d['added_ttft_ms'].get(s)):>7} ms   extra CPU us/token: {cpu}")
    lines.append("")
    lines.append("targets (not asserted):")
    for t in doc["targets"]:
        verdict = "n/a" if t["met"] is None else ("MET" if t["met"] else "MISSED")
        scope = "" if t["this_model"] else f"  [target is for --model {t['applies_to']}]"
        lines.append(f"  {t['target']:<48} {_fmt(t['value'], 3):>8} {t['bound']:<7} {verdict}{scope}")
    for n in doc["notes"]:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def write_json(doc: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # allow_nan=False: a nan would be invalid JSON; non-figures are None with a note.
    path.write_text(json.dumps(_clean(doc), indent=2, allow_nan=False) + "\n")


def _clean(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj
