"""Router-only figures: requests/s and latency of paths that never touch the worker.

    python -m bench router [--seconds 10] [--connections 32] [--json out.json]

Two paths: `GET /health` and a never-fits rejection (a short prompt whose max_tokens is
above the worker's max_request_tokens: answered 400 by the router before tokenizing).
The load generator runs in a second process (aiohttp, keep-alive connections, closed
loop). Where the machine allows, the router and the generator are pinned to different
cores (said in the output).
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench import cli
from bench.faults import RouterUnderTest

log = logging.getLogger("bench.routeronly")


async def _load(url: str, method: str, body: bytes | None, seconds: float, connections: int) -> dict[str, Any]:
    import aiohttp

    latencies: list[float] = []
    statuses: dict[int, int] = {}
    stop_at = time.monotonic() + seconds
    headers = {"Content-Type": "application/json"}
    conn = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def worker() -> None:
            while time.monotonic() < stop_at:
                t = time.perf_counter()
                async with session.request(method, url, data=body, headers=headers) as resp:
                    await resp.read()
                    statuses[resp.status] = statuses.get(resp.status, 0) + 1
                latencies.append(time.perf_counter() - t)

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(connections)))
        elapsed = time.monotonic() - started
    latencies.sort()
    return {"requests": len(latencies), "requests_per_s": len(latencies) / elapsed,
            "p50_ms": latencies[len(latencies) // 2] * 1e3,
            "p99_ms": latencies[int(len(latencies) * 0.99)] * 1e3, "statuses": statuses}


def _generator(args: tuple[str, str, bytes | None, float, int, int | None], out: Any) -> None:
    url, method, body, seconds, connections, cpu = args
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    out.put(asyncio.run(_load(url, method, body, seconds, connections)))


def run_load(url: str, method: str, body: bytes | None, seconds: float, connections: int,
             cpu: int | None) -> dict[str, Any]:
    """The load generator in a second process."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_generator, args=((url, method, body, seconds, connections, cpu), out))
    proc.start()
    result = out.get(timeout=seconds + 60)
    proc.join(30)
    return result


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("router", __doc__)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--connections", type=int, default=32)
    ns = cli.parse(p, argv)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pinned = len(cpus) >= 2
    out: dict[str, Any] = {"pinning": f"router on cpu {cpus[0]}, load generator on cpu {cpus[1]}"
                           if pinned else "not pinned (fewer than 2 CPUs available)"}
    with tempfile.TemporaryDirectory(prefix="hr-router-") as tmp:
        r = RouterUnderTest(Path(tmp), ["--max-queue", "100000"])
        try:
            with httpx.Client() as client:
                asyncio.run(_wait(r))
                limit = client.get(r.url + "/v1/memory").json()["workers"][0]["max_request_tokens"]
            if pinned:
                os.sched_setaffinity(r.proc.pid, {cpus[0]})
            never_fits = json.dumps({"model": "m", "prompt": "hi", "max_tokens": limit + 1}).encode()
            for name, method, path, body in (("health", "GET", "/health", None),
                                             ("never_fits", "POST", "/v1/completions", never_fits)):
                log.info("loading %s for %.0fs", name, ns.seconds)
                out[name] = run_load(r.url + path, method, body, ns.seconds, ns.connections,
                                     cpus[1] if pinned else None)
            out["router_cpu_s"] = sum(r.proc.cpu_times()[:2])
        finally:
            r.stop()
    text = json.dumps(out, indent=2)
    print(text)
    if ns.json:
        ns.json.write_text(text)
    return 0


async def _wait(r: RouterUnderTest) -> None:
    async with httpx.AsyncClient() as client:
        await r.wait_ready(client, None, 180)


if __name__ == "__main__":
    sys.exit(main())
