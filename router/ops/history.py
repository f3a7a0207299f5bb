"""The last few minutes, for the status page and `mlx-router status`: pure ring buffers.

Prometheus keeps totals; an operator looking at a screen wants the recent past: memory
samples for the chart, the latest times to first token, the latest refusals and why.
Callers give the times (wall clock, for people), so this module reads no clock.
"""

from __future__ import annotations

import collections
import math
from dataclasses import asdict, dataclass
from typing import Any

from common.errors import BadRequest, HeadroomError

# The chart's span and resolution: five minutes of one-second samples.
WINDOW_S = 300.0
SAMPLE_INTERVAL_S = 1.0
MAX_REJECTIONS = 20
MAX_TTFTS = 256


@dataclass(frozen=True, slots=True)
class Sample:
    """One point of the chart. Memory fields are None while no worker reports."""

    at: float
    queued: int
    running: int
    tokens_per_s: float
    limit_bytes: int | None = None
    active_bytes: int | None = None
    cache_bytes: int | None = None
    reserved_bytes: int | None = None
    headroom_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class Rejection:
    at: float
    request_id: str | None
    endpoint: str
    status: int
    code: str
    param: str | None
    message: str | None     # None where it could echo the client's input (see public_message)


def public_message(exc: HeadroomError) -> str | None:
    """The error's text if the server wrote all of it; a plain BadRequest may quote the body."""
    return None if type(exc) is BadRequest else exc.message


class History:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self.samples: collections.deque[Sample] = collections.deque(
            maxlen=int(window_s / SAMPLE_INTERVAL_S) + 1)
        self.rejections: collections.deque[Rejection] = collections.deque(maxlen=MAX_REJECTIONS)
        self.ttfts: collections.deque[tuple[float, float]] = collections.deque(maxlen=MAX_TTFTS)
        self._tokens_seen: tuple[float, float] | None = None  # (at, total) at the last sample

    def tokens_per_s(self, at: float, total_tokens: float) -> float:
        """The generation rate since the previous call (0 on the first)."""
        prev, self._tokens_seen = self._tokens_seen, (at, total_tokens)
        if prev is None or at <= prev[0]:
            return 0.0
        return max(0.0, total_tokens - prev[1]) / (at - prev[0])

    def add(self, sample: Sample) -> None:
        self.samples.append(sample)

    def note_ttft(self, at: float, ttft_s: float) -> None:
        self.ttfts.append((at, ttft_s))

    def note_rejection(self, at: float, request_id: str | None, endpoint: str,
                       exc: HeadroomError) -> None:
        self.rejections.append(Rejection(at, request_id, endpoint, exc.status, exc.code, exc.param,
                                         public_message(exc)))

    def ttft_summary(self, now: float) -> dict[str, Any]:
        """Median, 95th percentile and latest TTFT over the window (None when there is none)."""
        recent = sorted(v for at, v in self.ttfts if now - at <= self.window_s)
        if not recent:
            return {"count": 0, "last_s": None, "p50_s": None, "p95_s": None}
        return {"count": len(recent), "last_s": round(self.ttfts[-1][1], 4),
                "p50_s": round(_quantile(recent, 0.5), 4), "p95_s": round(_quantile(recent, 0.95), 4)}

    def samples_since(self, since: float | None) -> list[dict[str, Any]]:
        return [asdict(s) for s in self.samples if since is None or s.at > since]

    def recent_rejections(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in reversed(self.rejections)]  # newest first


def _quantile(ordered: list[float], q: float) -> float:
    """Nearest-rank quantile of a sorted, non-empty list."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]
