"""Paired requests at concurrency 1: the robust way to measure what a server adds.

On a shared or virtualised box the machine's speed drifts by tens of percent within a
minute, so two workloads run a minute apart differ by more than the few milliseconds a
server adds. Here each prompt is sent to every system back to back (order rotated per
prompt), one request at a time, so drift hits the systems of one prompt alike; the
figure is the median over prompts of the per-prompt difference to in-process:

    added_ttft_ms[s]         = median_i(ttft[s][i] − ttft[inprocess][i])
    overhead_us_per_token[s] = median_i((latency[s][i] − latency[inprocess][i]) / tokens)

HTTP systems keep one keep-alive connection for the whole run (as a real client would),
so no request pays a TCP connect; the in-process system is stepped in this thread while
no HTTP request is in flight.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from bench.client import one_request, request_body
from bench.metrics import RequestResult
from bench.prompts import Prompt
from bench.systems import HttpSystem, InProcessSystem, System

log = logging.getLogger(__name__)
INPROC = "inprocess"


@dataclass(slots=True)
class PairedSummary:
    system: str
    requests: int
    errors: int
    ttft_p50_ms: float
    latency_p50_ms: float
    added_ttft_ms: float | None           # vs in-process, median of per-prompt differences
    overhead_us_per_token: float | None   # likewise, per generated token
    error_samples: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def _one(system: System, sessions: dict[str, aiohttp.ClientSession], prompt: Prompt,
               max_tokens: int, timeout_s: float) -> RequestResult:
    if isinstance(system, HttpSystem):
        return await one_request(sessions[system.name], system.url + "/v1/completions",
                                 request_body(prompt, max_tokens, system.extra_body), max_tokens)
    assert isinstance(system, InProcessSystem) and system.engine is not None
    run = system.engine.run([prompt], concurrency=1, max_tokens=max_tokens, repetition=0,
                            timeout_s=timeout_s)
    return run.requests[0] if run.requests else RequestResult(error="no result")


async def _run(systems: list[System], prompts: list[Prompt], max_tokens: int,
               timeout_s: float) -> dict[str, list[RequestResult]]:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    sessions = {s.name: aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=1))
                for s in systems if isinstance(s, HttpSystem)}
    out: dict[str, list[RequestResult]] = {s.name: [] for s in systems}
    try:
        for i, prompt in enumerate(prompts):
            shift = i % len(systems)
            for system in systems[shift:] + systems[:shift]:
                out[system.name].append(await _one(system, sessions, prompt, max_tokens, timeout_s))
    finally:
        for session in sessions.values():
            await session.close()
    return out


def run_paired(systems: list[System], prompts: list[Prompt], max_tokens: int,
               timeout_s: float) -> dict[str, list[RequestResult]]:
    """Every prompt on every system, one request at a time; results in prompt order."""
    return asyncio.run(_run(systems, prompts, max_tokens, timeout_s))


def _timed(r: RequestResult) -> tuple[float, float] | None:
    """(ttft, latency) of a good request, else None."""
    if r.ok and r.ttft_s is not None and r.latency_s is not None:
        return r.ttft_s, r.latency_s
    return None


def summarize_paired(results: dict[str, list[RequestResult]], max_tokens: int) -> dict[str, PairedSummary]:
    floor = [_timed(r) for r in results.get(INPROC, [])]
    out: dict[str, PairedSummary] = {}
    for name, rs in results.items():
        timed = [_timed(r) for r in rs]
        good = [t for t in timed if t is not None]
        pairs = [(a, b) for a, b in zip(timed, floor) if a is not None and b is not None]
        added = overhead = None
        if name != INPROC and pairs:
            added = statistics.median(a[0] - b[0] for a, b in pairs) * 1e3
            overhead = statistics.median((a[1] - b[1]) / max_tokens for a, b in pairs) * 1e6
        errors = [r.error or "unknown error" for r in rs if not r.ok]
        out[name] = PairedSummary(
            system=name, requests=len(rs), errors=len(errors),
            ttft_p50_ms=statistics.median(t[0] for t in good) * 1e3 if good else math.nan,
            latency_p50_ms=statistics.median(t[1] for t in good) * 1e3 if good else math.nan,
            added_ttft_ms=added, overhead_us_per_token=overhead,
            error_samples=sorted(set(errors))[:5])
    return out
