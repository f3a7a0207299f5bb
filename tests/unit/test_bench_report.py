"""The benchmark's arithmetic: percentiles, pooled figures, derived ratios and targets.

Pure functions over hand-made measurements, so each formula in bench/README.md is
checked against numbers worked out by hand.
"""

from __future__ import annotations

import math

import pytest

from bench import report
from bench.metrics import (MixedRun, RequestResult, RunResult, percentile, summarize,
                           summarize_mixed, workload_key)


def _req(ttft_s: float, tokens: int = 4, gap_s: float = 0.01) -> RequestResult:
    return RequestResult(ok=True, ttft_s=ttft_s, itls_s=[gap_s] * (tokens - 1),
                         completion_tokens=tokens, num_chunks=tokens,
                         latency_s=ttft_s + gap_s * (tokens - 1),
                         last_chunk_s=ttft_s + gap_s * (tokens - 1))


def _run(system: str, tps: float, c: int = 1, ttft_s: float = 0.05, cpu_s: float = 0.1) -> RunResult:
    requests = [_req(ttft_s) for _ in range(4)]  # 16 tokens
    return RunResult(system=system, concurrency=c, repetition=0, wall_s=16 / tps,
                     requests=requests, cpu_s=cpu_s)


def test_tokens_that_all_came_in_one_chunk_have_no_time_per_output_token() -> None:
    """Not 0: the gap after the first token was never seen (the router wrote all at once)."""
    one = RequestResult(ok=True, ttft_s=0.05, itls_s=[], completion_tokens=12, num_chunks=1,
                        latency_s=0.05, last_chunk_s=0.05)
    run = RunResult(system="a", concurrency=1, repetition=0, wall_s=1.0, requests=[one], cpu_s=0.1)
    s = summarize([run])
    assert math.isnan(s.tpot_ms) and math.isnan(s.itl_p50_ms) and s.chunks_per_request == 1
    both = summarize([RunResult(system="a", concurrency=1, repetition=0, wall_s=1.0,
                                requests=[one, _req(0.05)], cpu_s=0.1)])
    assert both.tpot_ms == pytest.approx(10.0)  # only the request that streamed counts


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert math.isnan(percentile([], 50))


def test_summarize_pools_repetitions_by_wall_time() -> None:
    s = summarize([_run("a", 100.0), _run("a", 50.0)])
    assert s.completion_tokens == 32
    assert s.tokens_per_s == pytest.approx(32 / (16 / 100 + 16 / 50))
    assert s.tpot_ms == pytest.approx(10.0)
    assert s.cpu_ms_per_token == pytest.approx(0.2 / 32 * 1e3)
    assert workload_key(s.prompt_kind, s.concurrency) == "short:1"


def test_summarize_mixed_counts_failures_and_reads_short_ttfts() -> None:
    failed = RequestResult(error="HTTP 503: busy")
    run = MixedRun(system="a", repetition=0, long=_req(2.0),
                   shorts=[_req(0.1), _req(0.3), failed])
    m = summarize_mixed([run])
    assert (m.rounds, m.short_requests, m.errors) == (1, 3, 1)
    assert m.short_ttft_p50_ms == pytest.approx(200.0)
    assert m.short_ttft_max_ms == pytest.approx(300.0)
    assert m.long_ttft_p50_ms == pytest.approx(2000.0)
    assert m.error_samples == ["HTTP 503: busy"]


def _doc(mixed_p99_s: dict[str, float]) -> dict:
    summaries = {name: {"short:1": summarize([_run(name, tps, ttft_s=ttft, cpu_s=cpu)]),
                        "short:8": summarize([_run(name, tps * 2, c=8, ttft_s=ttft, cpu_s=cpu)])}
                 for name, tps, ttft, cpu in (("headroom", 100.0, 0.052, 0.2),
                                              ("mlx_lm_server", 80.0, 0.06, 0.15),
                                              ("inprocess", 125.0, 0.05, 0.1))}
    mixed = {name: summarize_mixed([MixedRun(system=name, repetition=0, long=_req(5.0),
                                             shorts=[_req(p99)])])
             for name, p99 in mixed_p99_s.items()}
    meta = {"model": {"name": "demo"}}
    return report.build(meta, summaries, mixed, {})


def test_derived_figures_and_targets() -> None:
    doc = _doc({"headroom": 1.0, "mlx_lm_server": 4.0, "inprocess": 3.0})
    d = doc["derived"]
    assert d["overhead_us_per_token"]["headroom"] == pytest.approx((1 / 100 - 1 / 125) * 1e6)
    assert d["added_ttft_ms"]["headroom"] == pytest.approx(2.0)
    assert d["tps_ratio_vs_headroom"]["mlx_lm_server"]["short:8"] == pytest.approx(0.8)
    assert d["tps_ratio_vs_inprocess"]["headroom"]["short:1"] == pytest.approx(0.8)
    assert d["mixed_short_ttft_p99_ratio_vs_headroom"]["mlx_lm_server"] == pytest.approx(4.0)
    assert d["cpu_overhead_us_per_token"]["headroom"]["short:8"] == pytest.approx(0.1 / 16 * 1e6)
    targets = {t["target"]: t for t in doc["targets"]}
    c8 = targets["headroom tps / mlx_lm_server tps at c=8"]
    assert c8["value"] == pytest.approx(1.25) and c8["met"] is True and c8["this_model"]
    assert targets["headroom tps / mlx_lm_server tps at c=32"]["met"] is None  # not measured
    assert targets["headroom added TTFT vs inprocess at c=1 (ms)"]["met"] is True
    mixed = targets["mixed: headroom short TTFT p99 / mlx_lm_server's"]
    assert mixed["value"] == pytest.approx(0.25) and mixed["met"] is True
    assert doc["notes"] == []


def test_paired_differences_are_per_prompt_medians() -> None:
    from bench.paired import summarize_paired

    # The machine slows down between prompts; per-prompt differences cancel that out.
    floor = [_req(t) for t in (0.050, 0.100, 0.200)]
    server = [_req(t + 0.002) for t in (0.050, 0.100, 0.200)]
    for r in floor + server:
        r.latency_s = (r.ttft_s or 0) + 0.3
    server[2].latency_s = (server[2].ttft_s or 0) + 0.3 + 64 * 0.001  # one slow tail
    out = summarize_paired({"headroom": server, "inprocess": floor}, max_tokens=64)
    assert out["headroom"].added_ttft_ms == pytest.approx(2.0)
    assert out["headroom"].overhead_us_per_token == pytest.approx(0.002 / 64 * 1e6)
    assert out["inprocess"].added_ttft_ms is None
    doc = report.build({"model": {"name": "demo"}}, {}, {}, {}, out)
    assert doc["derived"]["added_ttft_paired_ms"]["headroom"] == pytest.approx(2.0)
    target = {t["target"]: t for t in doc["targets"]}["headroom added TTFT vs inprocess, paired c=1 (ms)"]
    assert target["verdict"] == "MET"


def test_a_cost_at_or_below_zero_gets_no_verdict() -> None:
    targets = report.targets({"tps_ratio_vs_headroom": {}, "tps_ratio_vs_inprocess": {},
                              "added_ttft_ms": {"headroom": -1.3}, "added_ttft_paired_ms": {},
                              "mixed_short_ttft_p99_ratio_vs_headroom": {}}, "demo")
    row = {t["target"]: t for t in targets}["headroom added TTFT vs inprocess at c=1 (ms)"]
    assert row["verdict"] == "within noise"


def test_a_figure_that_is_not_positive_gets_a_note() -> None:
    doc = _doc({"headroom": 1.0, "mlx_lm_server": 0.4})
    targets = {t["target"]: t for t in doc["targets"]}
    assert targets["mixed: headroom short TTFT p99 / mlx_lm_server's"]["met"] is False
    # The in-process system is slower than a server here: the note must say so.
    _, notes = report.derive({"inprocess": {"short:1": summarize([_run("inprocess", 125.0, ttft_s=0.06)])},
                              "headroom": {"short:1": summarize([_run("headroom", 100.0, ttft_s=0.05)])}},
                             {})
    assert any("added_ttft_ms[headroom]" in n and "not > 0" in n for n in notes), notes
