"""`python -m bench serve` end to end on the demo model, with tiny counts.

Checks the JSON has every figure for every system and workload (short prompts at two
concurrencies, the mixed workload and the paired c=1 requests), each finite and > 0 (or
said not to be, for a cost within noise of the in-process floor), and no errors.
No timing assertions: on a shared 2-core box only the shape of the output is stable.
The bench runs in a subprocess; on timeout it gets SIGTERM first, so it stops the servers
it started, and only then SIGKILL.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SYSTEMS = ("headroom", "mlx_lm_server", "inprocess")
SERVERS = ("headroom", "mlx_lm_server")
CONCURRENCY = ("1", "2")
WORKLOADS = tuple(f"short:{c}" for c in CONCURRENCY)
NUM_REQUESTS, MAX_TOKENS = 2, 12
MIXED_LONG_TOKENS, MIXED_SHORTS, MIXED_MAX_TOKENS = 96, 2, 4
PAIRED = 3
MIXED_FIGURES = ("short_ttft_p50_ms", "short_ttft_p99_ms", "short_ttft_max_ms", "long_ttft_p50_ms")
FIGURES = ("tokens_per_s", "requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
           "tpot_ms", "cpu_ms_per_token")
RUN_TIMEOUT_S = 120.0   # the whole bench; it takes ~15 s when the box is quiet
STOP_GRACE_S = 20.0     # for the bench to stop its servers after SIGTERM


def _is_good(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def _run_bench(cache_home: Path, tmp_path: Path) -> dict[str, Any]:
    return run_bench(cache_home, tmp_path, "serve", [
        "--requests", str(NUM_REQUESTS), "--repeats", "1", "--max-tokens", str(MAX_TOKENS),
        "--concurrency", ",".join(CONCURRENCY), "--systems", ",".join(SYSTEMS),
        "--mixed-long-tokens", str(MIXED_LONG_TOKENS), "--mixed-shorts", str(MIXED_SHORTS),
        "--mixed-max-tokens", str(MIXED_MAX_TOKENS), "--paired", str(PAIRED)])


def run_bench(cache_home: Path, tmp_path: Path, mode: str, args: list[str]) -> dict[str, Any]:
    """``python -m bench MODE`` on the demo model, bounded: on timeout SIGTERM first (the
    bench stops the servers it started), then SIGKILL; its JSON document."""
    out = tmp_path / f"{mode}.json"
    argv = [sys.executable, "-m", "bench", mode, "--model", "demo", *args,
            "--startup-timeout", "60", "--workload-timeout", "60", "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_ROUTER_", "MLX_WORKER_"))}
    env.update(XDG_CACHE_HOME=str(cache_home), PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    with open(tmp_path / f"{mode}.log", "wb") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait(RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    output = (tmp_path / f"{mode}.log").read_text(errors="replace")
    assert proc.returncode == 0, f"bench exited with {proc.returncode}\n{output[-6000:]}"
    assert out.is_file(), f"bench wrote no JSON\n{output[-6000:]}"
    return json.loads(out.read_text())


@pytest.mark.integration
def test_bench_serve_reports_every_figure(cache_home: Path, tmp_path: Path) -> None:
    doc = _run_bench(cache_home, tmp_path)
    notes = doc["notes"]
    results = doc["results"]
    assert sorted(results) == sorted(SYSTEMS), results.keys()
    for system in SYSTEMS:
        assert sorted(results[system]) == sorted(WORKLOADS), (system, results[system].keys())
        for w in WORKLOADS:
            r = results[system][w]
            where = f"{system} {w}"
            assert r["errors"] == 0, (where, r["error_samples"], notes)
            # A worker restart is an error the client never sees (its requests are retried).
            assert r["worker_restarts"] == 0, (where, notes)
            assert r["num_requests"] == NUM_REQUESTS, where
            assert r["completion_tokens"] == NUM_REQUESTS * MAX_TOKENS, where
            for fig in FIGURES:
                # A gap between chunks needs two chunks: a router that fell behind its client
                # (a loaded box) writes what is waiting as one chunk, and then ITL and TPOT
                # are undefined (NaN, null in the JSON; never a made-up 0).
                undefined = fig.startswith(("itl_", "tpot_")) and r["chunks_per_request"] <= 1 \
                    and (r[fig] is None or not math.isfinite(r[fig]))
                assert _is_good(r[fig]) or undefined, (where, fig, r[fig], r["chunks_per_request"], notes)

    derived = doc["derived"]
    for key in ("tps_ratio_vs_headroom", "tps_ratio_vs_inprocess"):
        for system in SYSTEMS:
            for w in WORKLOADS:
                assert _is_good(derived[key][system][w]), (key, system, w, derived[key])
    by_name = {f"{key}[{system}]": derived[key][system]
               for key in ("overhead_us_per_token", "added_ttft_ms") for system in SERVERS}
    by_name.update({f"cpu_overhead_us_per_token[{system}][{w}]":
                    derived["cpu_overhead_us_per_token"][system][w]
                    for system in SERVERS for w in WORKLOADS})
    for name, value in by_name.items():
        assert isinstance(value, (int, float)) and math.isfinite(value), (name, value)
        # With 2 requests a server can land within noise of the in-process floor; the
        # contract is then that the output says so, rather than a silent bad figure.
        assert value > 0 or any(name in n for n in notes), (name, value, notes)

    mixed = doc["mixed"]
    assert sorted(mixed) == sorted(SYSTEMS), mixed.keys()
    for system in SYSTEMS:
        m = mixed[system]
        assert m["errors"] == 0, (system, m["error_samples"], notes)
        assert m["worker_restarts"] == 0, (system, notes)
        assert m["rounds"] == 1 and m["short_requests"] == MIXED_SHORTS, (system, m)
        for fig in MIXED_FIGURES:
            assert _is_good(m[fig]), (system, fig, m[fig], notes)
        assert _is_good(derived["mixed_short_ttft_p99_ratio_vs_headroom"][system]), (system, derived)

    paired = doc["paired"]
    assert sorted(paired) == sorted(SYSTEMS), paired.keys()
    for system in SYSTEMS:
        p = paired[system]
        assert p["errors"] == 0 and p["requests"] == PAIRED, (system, p, notes)
        assert _is_good(p["ttft_p50_ms"]) and _is_good(p["latency_p50_ms"]), (system, p)
    for system in SERVERS:
        for key in ("added_ttft_paired_ms", "overhead_paired_us_per_token"):
            value = derived[key][system]
            assert isinstance(value, (int, float)) and math.isfinite(value), (key, system, value)
            assert value > 0 or any(f"{key}[{system}]" in n for n in notes), (key, system, value, notes)

    assert {t["target"] for t in doc["targets"]}, "targets are printed beside the figures"
    assert doc["meta"]["model"]["name"] == "demo"


# `python -m bench agents` (bench/agents.py), tiny: two turns, one and two sessions, no
# tools (each tool is ~500 demo tokens of prefill), 4 output tokens, one repetition.
AGENT_SESSIONS = ("1", "2")
AGENT_FIGURES = ("cold_ttft_p50_ms", "cold_ttft_p99_ms", "cached_ttft_p50_ms", "cached_ttft_p99_ms",
                 "out_tps_p50", "turn_s_p50")


def _run_agents(cache_home: Path, tmp_path: Path) -> dict[str, Any]:
    return run_bench(cache_home, tmp_path, "agents", [
        "--sessions", ",".join(AGENT_SESSIONS), "--turns", "2", "--tools", "0", "--system-tokens", "100",
        "--grow-to", "0", "--turn-tokens", "32", "--max-tokens", "4", "--tool-time-s", "0.05",
        "--repeats", "1"])


@pytest.mark.integration
def test_bench_agents_reports_every_figure(cache_home: Path, tmp_path: Path) -> None:
    doc = _run_agents(cache_home, tmp_path)
    results, notes = doc["results"], doc["notes"]
    assert sorted(results) == sorted(SYSTEMS), results.keys()
    for system in SYSTEMS:
        for n in AGENT_SESSIONS:
            s = results[system][f"n{n}"]
            where = f"{system} N={n}"
            assert s["turns"] == 2 * int(n) and s["errors"] == 0, (where, s["error_samples"], notes)
            # Every system got the same token sequences: the servers' own rendering agrees.
            assert s["prompt_mismatches"] == 0 and s["worker_restarts"] == 0, (where, notes)
            assert all(_is_good(s["pooled"][fig]) for fig in AGENT_FIGURES), (where, s["pooled"])
            assert 0 < s["cached_token_ratio"] < 1, (where, s["cached_token_ratio"])
    for n in AGENT_SESSIONS:
        for peer in ("mlx_lm_server", "inprocess"):
            r = doc["ratios"][f"n{n}"][peer]
            assert all(_is_good(r[fig]["pooled"]) for fig in AGENT_FIGURES), (n, peer, r)
    assert doc["accounting"]["n2"]["sessions"] == 2 and doc["targets"], doc["targets"]
