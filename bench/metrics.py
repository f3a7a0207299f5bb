"""Per-request measurements and the aggregate figures computed from them.

One RequestResult per request, whichever system served it. A workload run (one system,
one prompt kind, one concurrency, one repetition) is a RunResult; the repetitions of a
(system, workload) pair are pooled into one Summary. The mixed workload (one long prompt,
then short ones) is a MixedRun per repetition, pooled into a MixedSummary. Formulas are
in bench/README.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestResult:
    """What one request did, measured from the moment it was sent (or inserted)."""

    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None         # send -> first chunk carrying output text
    # Gaps between consecutive output-carrying chunks. A server that coalesces tokens
    # (or holds back an incomplete UTF-8 character) sends fewer chunks than tokens, so a
    # gap can span several tokens; num_chunks says how often that happened.
    itls_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0          # from usage (servers) or counted (in-process)
    num_chunks: int = 0
    latency_s: float | None = None      # send -> last byte
    last_chunk_s: float | None = None   # send -> last output-carrying chunk

    def output_chunk(self, at_s: float) -> None:
        """An output-carrying chunk arrived ``at_s`` seconds after the request was sent."""
        if self.ttft_s is None:
            self.ttft_s = at_s
        elif self.last_chunk_s is not None:
            self.itls_s.append(at_s - self.last_chunk_s)
        self.num_chunks += 1
        self.last_chunk_s = at_s


@dataclass(slots=True)
class RunResult:
    """One workload: num_requests requests at a fixed concurrency against one system."""

    system: str
    concurrency: int
    repetition: int
    wall_s: float
    requests: list[RequestResult]
    prompt_kind: str = "short"          # bench/prompts.py PROMPT_TOKENS key
    worker_restarts: int = 0            # supervised worker restarts during this run
    cpu_s: float = math.nan             # CPU seconds the system's processes used in it
    cpu_parts_s: dict[str, float] = field(default_factory=dict)  # the same by role (server, worker, standby)


def workload_key(prompt_kind: str, concurrency: int) -> str:
    """How a workload is named in the JSON and the table: "short:8", "long:1"."""
    return f"{prompt_kind}:{concurrency}"


def percentile(values: list[float], pct: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


@dataclass(slots=True)
class Summary:
    """Pooled figures for one system at one concurrency (all repetitions together)."""

    system: str
    prompt_kind: str
    concurrency: int
    num_requests: int
    errors: int
    completion_tokens: int
    wall_s: float
    tokens_per_s: float
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    tpot_ms: float                      # mean of per-request (last - first)/(tokens - 1)
    chunks_per_request: float
    tokens_per_s_by_rep: list[float]
    error_samples: list[str]
    worker_restarts: int
    cpu_ms_per_token: float             # Σ system CPU / Σ tokens: robust to a busy box
    cpu_ms_per_token_parts: dict[str, float] = field(default_factory=dict)  # by role, where known

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


FIGURES: tuple[str, ...] = ("tokens_per_s", "requests_per_s", "ttft_p50_ms", "ttft_p99_ms",
                            "itl_p50_ms", "itl_p99_ms", "cpu_ms_per_token")


def summarize(runs: list[RunResult]) -> Summary:
    """Pool repetitions: tokens/s = Σ tokens of good requests / Σ workload wall time."""
    requests = [r for run in runs for r in run.requests]
    good = [r for r in requests if r.ok]
    wall_s = sum(run.wall_s for run in runs)
    tokens = sum(r.completion_tokens for r in good)
    ttfts = [r.ttft_s for r in good if r.ttft_s is not None]
    itls = [gap for r in good for gap in r.itls_s]
    # Time per output token after the first needs a second chunk: a request whose tokens all
    # came in one chunk (a router that fell behind its client writes what waits as one) has
    # no such time, not a time of 0.
    tpots = [(r.last_chunk_s - r.ttft_s) / (r.completion_tokens - 1) for r in good
             if r.last_chunk_s is not None and r.ttft_s is not None and r.completion_tokens > 1
             and r.num_chunks > 1]
    by_rep = [sum(r.completion_tokens for r in run.requests if r.ok) / run.wall_s
              if run.wall_s > 0 else math.nan for run in runs]
    errors = [r.error or "unknown error" for r in requests if not r.ok]
    return Summary(
        system=runs[0].system, prompt_kind=runs[0].prompt_kind, concurrency=runs[0].concurrency,
        num_requests=len(requests),
        errors=len(errors), completion_tokens=tokens, wall_s=wall_s,
        tokens_per_s=tokens / wall_s if wall_s > 0 else math.nan,
        requests_per_s=len(good) / wall_s if wall_s > 0 else math.nan,
        ttft_p50_ms=percentile(ttfts, 50) * 1e3, ttft_p99_ms=percentile(ttfts, 99) * 1e3,
        itl_p50_ms=percentile(itls, 50) * 1e3, itl_p99_ms=percentile(itls, 99) * 1e3,
        tpot_ms=(sum(tpots) / len(tpots) * 1e3) if tpots else math.nan,
        chunks_per_request=(sum(r.num_chunks for r in good) / len(good)) if good else math.nan,
        tokens_per_s_by_rep=by_rep, error_samples=sorted(set(errors))[:5],
        worker_restarts=sum(run.worker_restarts for run in runs),
        cpu_ms_per_token=sum(run.cpu_s for run in runs) / tokens * 1e3 if tokens else math.nan,
        cpu_ms_per_token_parts={role: round(sum(run.cpu_parts_s.get(role, 0.0) for run in runs) / tokens * 1e3, 3)
                                for role in sorted({k for run in runs for k in run.cpu_parts_s})} if tokens else {},
    )


@dataclass(slots=True)
class MixedRun:
    """One round of the mixed workload: a long prompt, then short ones while it prefills."""

    system: str
    repetition: int
    long: RequestResult
    shorts: list[RequestResult]
    worker_restarts: int = 0


@dataclass(slots=True)
class MixedSummary:
    """The mixed workload's rounds pooled: what the short requests waited for a first token."""

    system: str
    rounds: int
    short_requests: int
    errors: int
    short_ttft_p50_ms: float
    short_ttft_p99_ms: float
    short_ttft_max_ms: float
    long_ttft_p50_ms: float
    error_samples: list[str]
    worker_restarts: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


MIXED_FIGURES: tuple[str, ...] = ("short_ttft_p50_ms", "short_ttft_p99_ms", "long_ttft_p50_ms")


def summarize_mixed(runs: list[MixedRun]) -> MixedSummary:
    shorts = [r for run in runs for r in run.shorts]
    longs = [run.long for run in runs]
    everything = longs + shorts
    short_ttfts = [r.ttft_s for r in shorts if r.ok and r.ttft_s is not None]
    long_ttfts = [r.ttft_s for r in longs if r.ok and r.ttft_s is not None]
    errors = [r.error or "unknown error" for r in everything if not r.ok]
    return MixedSummary(
        system=runs[0].system, rounds=len(runs), short_requests=len(shorts), errors=len(errors),
        short_ttft_p50_ms=percentile(short_ttfts, 50) * 1e3,
        short_ttft_p99_ms=percentile(short_ttfts, 99) * 1e3,
        short_ttft_max_ms=max(short_ttfts) * 1e3 if short_ttfts else math.nan,
        long_ttft_p50_ms=percentile(long_ttfts, 50) * 1e3,
        error_samples=sorted(set(errors))[:5],
        worker_restarts=sum(run.worker_restarts for run in runs))


def is_good(value: Any) -> bool:
    """The one test every reported figure must pass: a finite number above zero."""
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def why_not_good(summary: Summary | MixedSummary, figure: str) -> str | None:
    """None when the figure is fine, else the reason it is not (goes in the output)."""
    value = getattr(summary, figure)
    if is_good(value):
        return None
    if summary.errors:
        return f"{summary.errors} requests failed: {summary.error_samples[0]}"
    if (isinstance(summary, Summary) and figure.startswith("itl")
            and summary.completion_tokens <= summary.num_requests):
        return "one token per request leaves no inter-token gap to measure"
    return f"{figure} = {value!r}: no successful request measured it"
