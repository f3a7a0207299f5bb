"""Where a streamed request's first-token time goes, stage by stage, on one clock.

    python -m bench.ttft_split --url http://127.0.0.1:8080 --log router.log [--requests 40]
                               [--api-key KEY, default $MLX_ROUTER_API_KEY]

Run against a router started with ``--log-level debug --log-format json`` (its log holds
the worker's lines too: the router relays the worker's stderr). Short prompts go one at
a time, each with its own ``X-Request-Id``; the client notes the wall clock when it sends
and when the first chunk with text arrives. The log's DEBUG lines (JSON ``ts`` to the
microsecond, one host so one clock) then place every stage between the two:

    client send → handler      the client's request and aiohttp's parse, up to our handler
    handler → enqueued         parse, checks, template, tokenizing ("HTTP before the queue")
    enqueued → dispatched      the router's queue and routing
    dispatched → received      ZeroMQ to the worker, its wake and receive
    received → admitted        the worker's checks, prefix-cache lookup, the gate, the insert
    admitted → worker sent     the engine's steps up to the first token (and the loop between them)
    worker sent → router got   ZeroMQ back, the router's receive
    router got → first byte    the handler's wake, the collector, the write
    first byte → client        the client's read and parse

DEBUG logging adds its own writes to the path (a few per request), so the stages are a
little slower than at INFO; compare stages with each other, and the total with paired runs.
gpu_run's ``split`` part runs this on the lent GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import calendar
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

STAGES = ("client send → handler", "handler → enqueued", "enqueued → dispatched",
          "dispatched → received", "received → admitted", "admitted → worker sent", "worker sent → router got",
          "router got → first byte", "first byte → client")
_ADMITTED = re.compile(r"admitted ([\d.]+) ms after its frame arrived")
_ADMIT_PARTS = re.compile(r"\(decode ([\d.]+), checks and prefix cache ([\d.]+), gate ([\d.]+), "
                          r"insert ([\d.]+), commit ([\d.]+)\)")
ADMIT_PARTS = ("decode", "checks and prefix cache", "gate", "insert", "commit")
_FINISHED = re.compile(r"before the queue ([\d.]+)ms, first token to first byte ([\d.]+)ms")


@dataclass(slots=True)
class Trace:
    """One request's wall-clock stamps (seconds since the epoch)."""

    sent: float = 0.0
    first_chunk: float | None = None
    stamps: dict[str, float] = field(default_factory=dict)

    def stages_ms(self) -> dict[str, float] | None:
        s = self.stamps
        need = ("enqueued", "dispatched", "admitted", "admit_ms", "worker_sent", "router_got", "before_ms",
                "byte_ms")
        if self.first_chunk is None or any(k not in s for k in need):
            return None
        handler = s["enqueued"] - s["before_ms"] / 1e3
        first_byte = s["router_got"] + s["byte_ms"] / 1e3
        received = s["admitted"] - s["admit_ms"] / 1e3
        points = [self.sent, handler, s["enqueued"], s["dispatched"], received, s["admitted"],
                  s["worker_sent"], s["router_got"], first_byte, self.first_chunk]
        return {name: (b - a) * 1e3 for name, a, b in zip(STAGES, points, points[1:])}


def _ts(value: str) -> float:
    """``2026-12-04T13:54:40.123456Z`` → seconds since the epoch."""
    whole, _, frac = value.rstrip("Z").partition(".")
    return calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S")) + float(f"0.{frac or 0}")


def read_log(text: str, traces: dict[str, Trace]) -> None:
    """Fill each trace's stamps from the router's (and relayed worker's) JSON lines."""
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        trace = traces.get(str(rec.get("request_id")))
        if trace is None or "ts" not in rec:
            continue
        msg, at, s = str(rec.get("msg", "")), _ts(rec["ts"]), trace.stamps
        if msg.startswith("queued for"):
            s["enqueued"] = at
        elif msg.startswith("dispatched"):
            s.setdefault("dispatched", at)
        elif (m := _ADMITTED.match(msg)) is not None:
            s.setdefault("admitted", at)
            s.setdefault("admit_ms", float(m.group(1)))
            if (parts := _ADMIT_PARTS.search(msg)) is not None:
                for name, value in zip(ADMIT_PARTS, parts.groups()):
                    s.setdefault(f"admit {name}", float(value))
        elif msg.startswith("first token") and "after admission" in msg:
            s.setdefault("worker_sent", at)
        elif msg.startswith("first token after"):
            s.setdefault("router_got", at)
        elif (m := _FINISHED.search(msg)) is not None:
            s["before_ms"], s["byte_ms"] = float(m.group(1)), float(m.group(2))


async def send(url: str, prompts: list[str], max_tokens: int, gap_s: float,
               api_key: str | None = None) -> dict[str, Trace]:
    """One streamed completion at a time on one keep-alive connection."""
    traces: dict[str, Trace] = {}
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=1)) as session:
        for i, prompt in enumerate(prompts):
            rid = f"split-{i}-{int(time.time() * 1e3) % 100000}"
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                    "ignore_eos": True}
            trace = traces[rid] = Trace(sent=time.time())
            headers = {"X-Request-Id": rid}
            if api_key:
                headers["Authorization"] = f"Bearer {api_key}"
            async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
                resp.raise_for_status()
                async for raw in resp.content:
                    if trace.first_chunk is None and raw.startswith(b"data: {") and _has_text(raw):
                        trace.first_chunk = time.time()
            await asyncio.sleep(gap_s)
    return traces


def _has_text(raw: bytes) -> bool:
    try:
        chunk = json.loads(raw[len(b"data: "):])
    except ValueError:
        return False
    return any(c.get("text") for c in chunk.get("choices") or [])


def summarize(traces: dict[str, Trace], skip: int = 2) -> dict[str, Any]:
    """Median and p90 of each stage over the traced requests (the first ``skip`` dropped)."""
    rows = [st for t in list(traces.values())[skip:] if (st := t.stages_ms()) is not None]
    out: dict[str, Any] = {"requests": len(rows), "untraced": len(traces) - skip - len(rows)}
    # The worker's admission, part by part.
    parted = [t.stamps for t in list(traces.values())[skip:] if f"admit {ADMIT_PARTS[0]}" in t.stamps]
    if parted:
        out["admission parts p50_ms"] = {name: round(statistics.median(p[f"admit {name}"] for p in parted), 3)
                                         for name in ADMIT_PARTS}
    # The client's own figure needs no log (at INFO, or another server, only it is there).
    ttfts = sorted((t.first_chunk - t.sent) * 1e3 for t in list(traces.values())[skip:] if t.first_chunk)
    if ttfts:
        out["client_ttft_p50_ms"] = round(statistics.median(ttfts), 3)
    # A fresh router's first requests, stage by stage: where a cold start's time goes.
    out["first"] = [{k: round(v, 3) for k, v in st.items()} if (st := t.stages_ms()) else None
                    for t in list(traces.values())[:skip]]
    if not rows:
        return out
    for name in (*STAGES, "total"):
        values = sorted(sum(r.values()) if name == "total" else r[name] for r in rows)
        out[name] = {"p50_ms": round(statistics.median(values), 3),
                     "p90_ms": round(values[int(0.9 * (len(values) - 1))], 3)}
    return out


def run(url: str, log_path: Path, prompts: list[str], max_tokens: int = 8, gap_s: float = 0.3,
        settle_s: float = 1.0, api_key: str | None = None) -> dict[str, Any]:
    traces = asyncio.run(send(url, prompts, max_tokens, gap_s, api_key))
    time.sleep(settle_s)  # the relayed worker lines reach the router's log
    read_log(log_path.read_text(errors="replace"), traces)
    return summarize(traces)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--log", type=Path, required=True, help="the router's stderr (JSON, DEBUG)")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--api-key", default=os.environ.get("MLX_ROUTER_API_KEY"),
                   help="for a router run with --api-key (default: $MLX_ROUTER_API_KEY)")
    args = p.parse_args(argv)
    # A fresh start per prompt and run: no prompt-cache hit (a hit's copy is another path).
    nonce = f"{time.time_ns() % 10**9:09d}"
    prompts = [f"{nonce[i % 9:]}{i} Request {i}: say something about the number {i * 7}."
               for i in range(args.requests)]
    print(json.dumps(run(args.url, args.log, prompts, args.max_tokens, api_key=args.api_key), indent=2,
                     ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
