"""The agents workload's figures, ratios and table (pure: numbers in, numbers and text out).

Per system and session count N, pooled over repetitions and per repetition:
- cold_ttft_p50_ms / _p99_ms: send -> first output of each session's first measured turn;
- cached_ttft_p50_ms / _p99_ms: the same over the later turns (each can reuse the one before);
- out_tps_p50: per turn, (output tokens - 1) / (last output - first output): the decode
  speed a session sees; the median over turns;
- turn_s_p50: send -> last byte of a turn (TTFT and decode together), the median.
Ratios are Headroom's figure over a peer's: pooled, and per repetition (min-max: the
spread). For TTFT and turn time below 1 is better, for tokens/s above 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bench.metrics import percentile

HEADROOM, PEERS = "headroom", ("mlx_lm_server", "inprocess")
FIGURES: tuple[str, ...] = ("cold_ttft_p50_ms", "cold_ttft_p99_ms", "cached_ttft_p50_ms",
                            "cached_ttft_p99_ms", "out_tps_p50", "turn_s_p50")
HIGHER_IS_BETTER = frozenset({"out_tps_p50"})
TARGET_SESSIONS = (1, 8)   # issue 25: cached-turn TTFT <= mlx_lm.server's at N = 1 and N = 8


@dataclass(slots=True)
class TurnRecord:
    """One turn of one session on one system."""

    system: str
    num_sessions: int
    repetition: int
    session: int
    turn: int
    expected_prompt_tokens: int         # the rendered prompt every system gets
    new_tokens: int                     # what this turn adds to the one before
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None         # send (arrival) -> first output
    latency_s: float | None = None      # send -> last byte (in-process: last token)
    decode_s: float | None = None       # first output -> last output
    completion_tokens: int = 0
    prompt_tokens: int | None = None    # as the system reported it
    cached_tokens: int | None = None    # None: the system does not report it

    @property
    def out_tps(self) -> float | None:
        if self.decode_s is None or self.decode_s <= 0 or self.completion_tokens < 2:
            return None
        return (self.completion_tokens - 1) / self.decode_s


def figures(records: Sequence[TurnRecord]) -> dict[str, float]:
    ttfts = [(r.turn, r.ttft_s * 1e3) for r in records if r.ok and r.ttft_s is not None]
    cold, cached = [ms for t, ms in ttfts if t == 0], [ms for t, ms in ttfts if t > 0]
    tps = [v for r in records if r.ok and (v := r.out_tps) is not None]
    turn_s = [r.latency_s for r in records if r.ok and r.latency_s is not None]
    return {"cold_ttft_p50_ms": percentile(cold, 50), "cold_ttft_p99_ms": percentile(cold, 99),
            "cached_ttft_p50_ms": percentile(cached, 50), "cached_ttft_p99_ms": percentile(cached, 99),
            "out_tps_p50": percentile(tps, 50), "turn_s_p50": percentile(turn_s, 50)}


def summarize(records: Sequence[TurnRecord], *, worker_restarts: int = 0, wall_s: float = 0.0) -> dict[str, Any]:
    """Pooled figures, figures by repetition, and the checks on what was sent."""
    bad = [r for r in records if not r.ok]
    later = [r for r in records if r.ok and r.turn > 0]
    reported = [r for r in later if r.cached_tokens is not None]
    prompt = sum(r.expected_prompt_tokens for r in reported)
    mismatched = [r for r in records if r.prompt_tokens is not None and r.prompt_tokens != r.expected_prompt_tokens]
    return {"pooled": figures(records),
            "by_rep": {str(rep): figures([r for r in records if r.repetition == rep])
                       for rep in sorted({r.repetition for r in records})},
            "turns": len(records), "errors": len(bad),
            "error_samples": sorted({r.error or "unknown" for r in bad})[:3],
            "cached_token_ratio": sum(r.cached_tokens or 0 for r in reported) / prompt if prompt else math.nan,
            "prompt_mismatches": len(mismatched),
            "prompt_mismatch_samples": [(r.prompt_tokens, r.expected_prompt_tokens) for r in mismatched[:3]],
            "worker_restarts": worker_restarts, "wall_s": round(wall_s, 2),
            "records": [asdict(r) for r in records]}


def ratio(a: float, b: float) -> float:
    return a / b if math.isfinite(a) and math.isfinite(b) and b > 0 else math.nan


def ratios(mine: dict[str, Any], peer: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Headroom ÷ peer per figure: pooled, and per repetition both have (the spread)."""
    reps = sorted(mine["by_rep"].keys() & peer["by_rep"].keys(), key=int)
    out = {}
    for fig in FIGURES:
        by_rep = [ratio(mine["by_rep"][r][fig], peer["by_rep"][r][fig]) for r in reps]
        finite = [v for v in by_rep if math.isfinite(v)]
        out[fig] = {"pooled": ratio(mine["pooled"][fig], peer["pooled"][fig]), "by_rep": by_rep,
                    "min": min(finite, default=math.nan), "max": max(finite, default=math.nan)}
    return out


def spread(values: Sequence[float]) -> float:
    """(max - min) / mean: how far apart the repetitions were."""
    good = [v for v in values if math.isfinite(v)]
    if len(good) < 2 or sum(good) <= 0:
        return math.nan
    return (max(good) - min(good)) / (sum(good) / len(good))


def derive(results: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]], list[str]]:
    """(ratios by N and peer, the targets, notes) from results[system][f"n{N}"]."""
    out: dict[str, Any] = {}
    targets, notes = [], []
    for key, mine in results.get(HEADROOM, {}).items():
        out[key] = {p: ratios(mine, results[p][key]) for p in PEERS if key in results.get(p, {})}
    for key, r in out.items():
        n = int(key[1:])
        if n in TARGET_SESSIONS and "mlx_lm_server" in r:
            value = r["mlx_lm_server"]["cached_ttft_p50_ms"]["pooled"]
            targets.append({"target": f"Headroom cached-turn TTFT p50 ÷ mlx_lm.server's at N = {n}",
                            "value": value, "bound": "<= 1.0",
                            "verdict": "n/a" if not math.isfinite(value) else "MET" if value <= 1.0 else "MISSED"})
    for system, by_n in results.items():
        for key, s in by_n.items():
            where = f"{system} N={key[1:]}"
            if s["errors"]:
                notes.append(f"{where}: {s['errors']} of {s['turns']} turns failed, e.g. {s['error_samples'][0]}")
            if s["prompt_mismatches"]:
                notes.append(f"{where}: {s['prompt_mismatches']} turns reported a prompt length other than "
                             f"the rendered one (reported, rendered: {s['prompt_mismatch_samples']}): "
                             "its chat template rendering differs, so it did not get the same tokens")
            if s["worker_restarts"]:
                notes.append(f"{where}: the worker restarted {s['worker_restarts']} time(s) during its turns")
    return out, targets, notes


def _f(v: Any, digits: int) -> str:
    return "–" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:,.{digits}f}"


def _pct(v: float) -> str:
    return "–" if not math.isfinite(v) else f"{v * 100:.0f}%"


def _r(r: dict[str, Any]) -> str:
    if not math.isfinite(r["pooled"]):
        return "–"
    band = f" ({_f(r['min'], 2)}–{_f(r['max'], 2)})" if len(r["by_rep"]) > 1 else ""
    return f"{_f(r['pooled'], 2)}{band}"


def _head(doc: dict[str, Any]) -> list[str]:
    m = doc["meta"]
    mach, git = m.get("machine", {}), m.get("git", {})
    lines = [f"model {m['model']['name']}; {m['repeats']} repetitions; {m['tools']} tools; max_tokens "
             f"{m['max_tokens']}; tool time {m['tool_time_s'][0]}–{m['tool_time_s'][1]} s"]
    if mach:
        lines.append(f"{mach.get('platform')}, {mach.get('cpu_count')} CPUs, mlx {mach.get('mlx')} "
                     f"({mach.get('device')}), mlx-lm {mach.get('mlx_lm')}, commit {str(git.get('commit'))[:8]}"
                     f"{' (dirty)' if git.get('dirty_files') else ''}")
    for key, a in doc["accounting"].items():
        lines.append(f"N = {key[1:]}: prompt {_f(a['first_prompt_tokens_mean'], 0)} → "
                     f"{_f(a['last_prompt_tokens_mean'], 0)} tokens over {a['turns']} turns, +"
                     f"{_f(a['new_tokens_per_turn_mean'], 0)} a turn ({a['new_tokens_per_turn_min']}–"
                     f"{a['new_tokens_per_turn_max']}), {a['earlier_exchanges']} earlier exchanges in the cold turn")
    return lines


def render(doc: dict[str, Any]) -> str:
    """The markdown tables: per system and N, then the ratios, targets and notes."""
    lines = [*_head(doc), "",
             "| system | N | turns (err) | cold TTFT p50 ms | p99 | cached TTFT p50 ms | p99 | cached tokens "
             "| out tok/s p50 | turn s p50 | rep spread (cached p50) |", "|---" * 11 + "|"]
    for system, by_n in doc["results"].items():
        for key, s in by_n.items():
            p = s["pooled"]
            reps = [f["cached_ttft_p50_ms"] for f in s["by_rep"].values()]
            lines.append(f"| {system} | {key[1:]} | {s['turns']} ({s['errors']}) | {_f(p['cold_ttft_p50_ms'], 1)} | "
                         f"{_f(p['cold_ttft_p99_ms'], 1)} | {_f(p['cached_ttft_p50_ms'], 1)} | "
                         f"{_f(p['cached_ttft_p99_ms'], 1)} | {_f(s['cached_token_ratio'], 2)} | "
                         f"{_f(p['out_tps_p50'], 1)} | {_f(p['turn_s_p50'], 2)} | {_pct(spread(reps))} |")
    if doc["ratios"]:
        lines += ["", "Headroom ÷ peer, pooled (min–max over repetitions); TTFT and turn time: < 1 is better, "
                  "tok/s: > 1 is better", "",
                  "| N | figure | ÷ mlx_lm.server | ÷ in-process |", "|---|---|---|---|"]
        for key, by_peer in doc["ratios"].items():
            for fig in FIGURES:
                cells = [_r(by_peer[p][fig]) if p in by_peer else "–" for p in PEERS]
                lines.append(f"| {key[1:]} | {fig} | {cells[0]} | {cells[1]} |")
    lines += [""] + [f"target (not asserted): {t['target']} = {_f(t['value'], 3)} {t['bound']}: {t['verdict']}"
                     for t in doc["targets"]]
    lines += [f"note: {n}" for n in doc["notes"]]
    return "\n".join(lines).rstrip()
