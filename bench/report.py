"""Derived figures, targets, the printed table and the JSON document.

Derived (on the short:1 workload unless said; formulas also in bench/README.md):
- overhead_us_per_token[s] = (1/tps[s] − 1/tps[inprocess]) × 1e6: the wall time a server
  adds per generated token over the bare BatchGenerator loop.
- cpu_overhead_us_per_token[s][w] = (cpu_ms_per_token[s] − cpu_ms_per_token[inprocess]) × 1e3,
  on every workload: the CPU a server burns per token beyond the model's own.
- added_ttft_ms[s] = ttft_p50[s] − ttft_p50[inprocess]: what HTTP, tokenizing, queueing
  and IPC add before the first token.
- tps_ratio_vs_headroom[s][w] = tps[s] / tps[headroom] on workload w; tps_ratio_vs_inprocess
  likewise.
- mixed_short_ttft_p99_ratio_vs_headroom[s] = short TTFT p99[s] / short TTFT p99[headroom]
  in the mixed workload.
- added_ttft_paired_ms[s], overhead_paired_us_per_token[s]: the same two costs from paired
  requests (bench/paired.py), robust to the machine's drift; the TTFT target uses these.
Targets are printed beside the figures; nothing is asserted here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from bench.metrics import FIGURES, MIXED_FIGURES, MixedSummary, Summary, is_good, why_not_good
from bench.paired import PairedSummary

HEADROOM, MLX_LM, INPROC = "headroom", "mlx_lm_server", "inprocess"
FLOOR = "short:1"  # overhead and added TTFT are measured on this workload


def derive(summaries: dict[str, dict[str, Summary]], mixed: dict[str, MixedSummary],
           paired: dict[str, PairedSummary] | None = None) -> tuple[dict[str, Any], list[str]]:
    """The derived figures, and notes saying why any of them is missing or not > 0."""
    notes: list[str] = []
    paired = paired or {}
    out: dict[str, Any] = {"overhead_us_per_token": {}, "added_ttft_ms": {},
                           "added_ttft_paired_ms": {}, "overhead_paired_us_per_token": {},
                           "cpu_overhead_us_per_token": {},
                           "tps_ratio_vs_headroom": {}, "tps_ratio_vs_inprocess": {},
                           "mixed_short_ttft_p99_ratio_vs_headroom": {}}
    floor = summaries.get(INPROC, {}).get(FLOOR)
    servers = [s for s in summaries if s != INPROC]
    if floor is None:
        notes.append(f"overhead and added TTFT need the inprocess system on the {FLOOR} workload")
    for s in servers:
        mine = summaries[s].get(FLOOR)
        if floor is None or mine is None:
            continue
        if is_good(mine.tokens_per_s) and is_good(floor.tokens_per_s):
            out["overhead_us_per_token"][s] = (1 / mine.tokens_per_s - 1 / floor.tokens_per_s) * 1e6
        out["added_ttft_ms"][s] = mine.ttft_p50_ms - floor.ttft_p50_ms
    for s in servers:  # CPU time is far less disturbed by a busy machine than wall time
        floors = summaries.get(INPROC, {})
        out["cpu_overhead_us_per_token"][s] = {
            key: (v.cpu_ms_per_token - floors[key].cpu_ms_per_token) * 1e3
            for key, v in summaries[s].items() if key in floors}
    for key, base in (("tps_ratio_vs_headroom", HEADROOM), ("tps_ratio_vs_inprocess", INPROC)):
        if base not in summaries:
            notes.append(f"{key} needs the {base} system")
            continue
        for s, by_w in summaries.items():
            out[key][s] = {w: by_w[w].tokens_per_s / summaries[base][w].tokens_per_s
                           for w in by_w if w in summaries[base] and is_good(summaries[base][w].tokens_per_s)}
    if mixed and HEADROOM in mixed and is_good(mixed[HEADROOM].short_ttft_p99_ms):
        for s, m in mixed.items():
            out["mixed_short_ttft_p99_ratio_vs_headroom"][s] = m.short_ttft_p99_ms / mixed[HEADROOM].short_ttft_p99_ms
    elif mixed:
        notes.append("mixed_short_ttft_p99_ratio_vs_headroom needs the headroom system's mixed figures")
    for s, ps in paired.items():
        if s == INPROC:
            continue
        if ps.added_ttft_ms is None or ps.overhead_us_per_token is None:
            notes.append(f"paired figures for {s} need good requests on it and on inprocess")
            continue
        out["added_ttft_paired_ms"][s] = ps.added_ttft_ms
        out["overhead_paired_us_per_token"][s] = ps.overhead_us_per_token
    flat = [(f"{key}[{s}]", v) for key in ("overhead_us_per_token", "added_ttft_ms",
                                           "added_ttft_paired_ms", "overhead_paired_us_per_token")
            for s, v in out[key].items()]
    flat += [(f"cpu_overhead_us_per_token[{s}][{w}]", v)
             for s, by_w in out["cpu_overhead_us_per_token"].items() for w, v in by_w.items()]
    for name, v in flat:
        if not math.isfinite(v):
            notes.append(f"{name} could not be computed: see the per-system notes")
        elif not is_good(v):
            notes.append(f"{name} = {v:.4g} is not > 0: measured at or below the in-process "
                         f"floor, i.e. the difference is within run-to-run noise (see "
                         f"tokens_per_s_by_rep; CPU times tick at 10 ms)")
    return out, notes


def targets(derived: dict[str, Any], model: str) -> list[dict[str, Any]]:
    """The project's targets, evaluated where the run has the data (printed, not asserted)."""
    rows: list[dict[str, Any]] = []

    def add(name: str, value: float | None, op: str, bound: float, applies: str) -> None:
        met = None if value is None or not math.isfinite(value) else (
            value >= bound if op == ">=" else value <= bound if op == "<=" else value < bound)
        # A cost measured at or below zero is noise, not a result: no verdict.
        verdict = ("n/a" if met is None else "within noise" if value is not None and value <= 0
                   else "MET" if met else "MISSED")
        rows.append({"target": name, "value": value, "bound": f"{op} {bound}", "met": met,
                     "verdict": verdict, "applies_to": applies})

    for c in (8, 32):
        r = derived["tps_ratio_vs_headroom"].get(MLX_LM, {}).get(f"short:{c}")
        add(f"headroom tps / mlx_lm_server tps at c={c}", None if not r else 1 / r, ">=", 1.0, "demo")
    if HEADROOM in derived["added_ttft_paired_ms"]:
        add("headroom added TTFT vs inprocess, paired c=1 (ms)",
            derived["added_ttft_paired_ms"][HEADROOM], "<", 3.0, "demo")
    else:
        add("headroom added TTFT vs inprocess at c=1 (ms)", derived["added_ttft_ms"].get(HEADROOM),
            "<", 3.0, "demo")
    add("headroom tps / inprocess tps at c=8",
        derived["tps_ratio_vs_inprocess"].get(HEADROOM, {}).get("short:8"), ">=", 0.9, "bench-shaped")
    r = derived["mixed_short_ttft_p99_ratio_vs_headroom"].get(MLX_LM)
    add("mixed: headroom short TTFT p99 / mlx_lm_server's", None if not r else 1 / r, "<=", 0.5,
        "any")
    for row in rows:
        row["this_model"] = row["applies_to"] in (model, "any")
    return rows


def build(meta: dict[str, Any], summaries: dict[str, dict[str, Summary]],
          mixed: dict[str, MixedSummary], warmup: dict[str, Any],
          paired: dict[str, PairedSummary] | None = None) -> dict[str, Any]:
    paired = paired or {}
    derived, notes = derive(summaries, mixed, paired)
    for ps in paired.values():
        if ps.errors:
            notes.append(f"{ps.system} paired: {ps.errors} requests failed: {ps.error_samples[0]}")
    for by_w in summaries.values():
        for summary in by_w.values():
            where = f"{summary.system} {summary.prompt_kind}:{summary.concurrency}"
            notes += _figure_notes(summary, where, FIGURES)
    for summary in mixed.values():
        notes += _figure_notes(summary, f"{summary.system} mixed", MIXED_FIGURES)
    return {"meta": meta, "warmup": warmup,
            "results": {s: {w: v.to_dict() for w, v in by_w.items()} for s, by_w in summaries.items()},
            "mixed": {s: m.to_dict() for s, m in mixed.items()},
            "paired": {s: p.to_dict() for s, p in paired.items()},
            "derived": derived, "targets": targets(derived, meta["model"]["name"]),
            "notes": notes}


def _figure_notes(summary: Summary | MixedSummary, where: str, figures: tuple[str, ...]) -> list[str]:
    notes = []
    if summary.errors:
        notes.append(f"{where} errors: {summary.errors} requests failed: {summary.error_samples[0]}")
    for fig in figures:
        why = why_not_good(summary, fig)
        if why:
            notes.append(f"{where} {fig}: {why}")
    if summary.worker_restarts:
        notes.append(
            f"{where}: its worker was restarted {summary.worker_restarts} time(s) during these "
            f"workloads; requests that had produced nothing were retried on the new worker, so "
            f"they count as successes with the restart inside their TTFT and the workload's tokens/s")
    return notes


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
    kinds = ", ".join(f"{k} ~{v}" for k, v in m["prompt_tokens"].items())
    head = (f"{'system':<14}{'workload':>9}{'tok/s':>9}{'req/s':>8}{'TTFT p50':>11}{'p99':>10}"
            f"{'ITL p50':>9}{'p99':>8}{'TPOT':>7}{'chunk/req':>10}{'CPU/tok':>8}{'err':>5}"
            f"{'÷headroom':>10}{'÷inproc':>9}{'rep spread':>11}")
    lines = [f"model {m['model']['name']} ({m['model']['folder']}), max_tokens {m['max_tokens']}, "
             f"prompt tokens: {kinds}; requests per workload {m['requests']} (by concurrency) "
             f"x {m['repeats']} repeats",
             f"{m['machine']['platform']}, {m['machine']['cpu_count']} CPUs, mlx {m['machine']['mlx']} "
             f"({m['machine']['device']}), mlx-lm {m['machine']['mlx_lm']}, commit {m['git']['commit'][:8]}"
             f"{' (dirty)' if m['git']['dirty_files'] else ''}; load average before/after "
             f"{m['loadavg_before'][0]:.2f}/{m['loadavg_after'][0]:.2f}",
             "workload = prompt kind:concurrency; times in ms; TTFT/ITL from the client's send; "
             "ITL is the gap between output chunks; CPU/tok = CPU ms of the system's processes per "
             "generated token; rep spread = (max - min) / mean of the repetitions' tokens/s",
             head, "-" * len(head)]
    for s, by_w in doc["results"].items():
        for w, r in by_w.items():
            lines.append(
                f"{s:<14}{w:>9}{_fmt(r['tokens_per_s'], 1):>9}{_fmt(r['requests_per_s']):>8}"
                f"{_fmt(r['ttft_p50_ms']):>11}{_fmt(r['ttft_p99_ms']):>10}{_fmt(r['itl_p50_ms']):>9}"
                f"{_fmt(r['itl_p99_ms']):>8}{_fmt(r['tpot_ms']):>7}{_fmt(r['chunks_per_request'], 1):>10}"
                f"{_fmt(r['cpu_ms_per_token']):>8}{r['errors']:>5}"
                f"{_fmt(d['tps_ratio_vs_headroom'].get(s, {}).get(w), 3):>10}"
                f"{_fmt(d['tps_ratio_vs_inprocess'].get(s, {}).get(w), 3):>9}"
                f"{_spread(r['tokens_per_s_by_rep']):>11}")
    parts = [f"{s} {w}: " + ", ".join(f"{role} {ms:.2f}" for role, ms in r["cpu_ms_per_token_parts"].items())
             for s, by_w in doc["results"].items() for w, r in by_w.items() if r.get("cpu_ms_per_token_parts")]
    if parts:
        lines += ["", "CPU ms per generated token by process:", *parts]
    if doc["mixed"]:
        mx = m["mixed"]
        lines += ["", f"mixed: one ~{mx['long_prompt_tokens']}-token prompt, then {mx['shorts']} "
                  f"~{mx['short_prompt_tokens']}-token prompts {mx['head_start_s']} s later, "
                  f"{mx['max_tokens']} tokens each; TTFT in ms",
                  f"{'system':<14}{'rounds':>7}{'short TTFT p50':>16}{'p99':>10}{'max':>10}"
                  f"{'long TTFT p50':>15}{'err':>5}{'÷headroom (short p99)':>23}"]
        for s, r in doc["mixed"].items():
            lines.append(f"{s:<14}{r['rounds']:>7}{_fmt(r['short_ttft_p50_ms'], 1):>16}"
                         f"{_fmt(r['short_ttft_p99_ms'], 1):>10}{_fmt(r['short_ttft_max_ms'], 1):>10}"
                         f"{_fmt(r['long_ttft_p50_ms'], 1):>15}{r['errors']:>5}"
                         f"{_fmt(d['mixed_short_ttft_p99_ratio_vs_headroom'].get(s), 3):>23}")
    if doc["paired"]:
        lines += ["", f"paired: {m['paired_requests']} short prompts at c=1, each sent to every "
                  "system back to back; added = median over prompts of (system - inprocess)",
                  f"{'system':<14}{'TTFT p50':>10}{'latency p50':>13}{'added TTFT':>12}"
                  f"{'overhead us/tok':>17}{'err':>5}"]
        for s, r in doc["paired"].items():
            lines.append(f"{s:<14}{_fmt(r['ttft_p50_ms']):>10}{_fmt(r['latency_p50_ms'], 1):>13}"
                         f"{_fmt(r['added_ttft_ms']):>12}{_fmt(r['overhead_us_per_token'], 0):>17}"
                         f"{r['errors']:>5}")
    lines.append("")
    lines.append(f"vs inprocess: overhead = (1/tps_sys - 1/tps_inproc)*1e6 us/token on {FLOOR}; "
                 f"added TTFT = TTFT p50 sys - TTFT p50 inproc on {FLOOR}; "
                 "extra CPU = CPU/tok sys - CPU/tok inproc")
    for s in sorted(d["overhead_us_per_token"].keys() | d["added_ttft_ms"].keys()):
        cpu = "  ".join(f"{w} {_fmt(v, 0)}" for w, v in d["cpu_overhead_us_per_token"].get(s, {}).items())
        lines.append(f"  {s:<14} overhead {_fmt(d['overhead_us_per_token'].get(s), 1):>8} us/token   "
                     f"added TTFT {_fmt(d['added_ttft_ms'].get(s)):>7} ms   extra CPU us/token: {cpu}")
    lines.append("")
    lines.append("targets (not asserted):")
    for t in doc["targets"]:
        verdict = t["verdict"]
        scope = "" if t["this_model"] else f"  [target is for --model {t['applies_to']}]"
        lines.append(f"  {t['target']:<52} {_fmt(t['value'], 3):>8} {t['bound']:<7} {verdict}{scope}")
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
