"""Fault figures: what a worker death costs clients, and a soak with periodic kills.

    python -m bench faults [--kills 20] [--soak-s 600] [--kill-every-s 30] [--json out.json]

- kills: for each of N SIGKILLs during streaming traffic, the time from the kill to the
  last in-flight client answered (an SSE error event or a 503), and from the kill to the
  first request served again, with and without the worker's own start time (mlx import +
  model load + calibration, as the router measured it) and the restart backoff the
  supervisor chose (0.5 s doubling while deaths follow each other).
- soak: mixed traffic (streaming and not, short and long) for a while, killing the worker
  every few seconds: requests sent, answered 200, answered with a clean error, lost (no
  answer, a transport error or a stream without its end) — must be 0 — and the router's RSS
  at start and end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench import cli

log = logging.getLogger("bench.faults")
ROOT = Path(__file__).resolve().parents[1]
# Kills closer than this would trip the supervisor's crash-loop guard (5 deaths in 60 s).
KILL_SPACING_S = 20.0


@dataclass
class Soak:
    sent: int = 0
    ok: int = 0
    clean_errors: int = 0
    lost: int = 0
    errors_by_code: dict[str, int] = field(default_factory=dict)


class RouterUnderTest:
    def __init__(self, workdir: Path, extra: list[str]) -> None:
        from tests.conftest import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "XDG_CACHE_HOME": str(workdir / "cache"), "XDG_RUNTIME_DIR": str(workdir),
               "XDG_CONFIG_HOME": str(workdir / "config"), "PYTHONPATH": str(ROOT)}
        self.log = open(workdir / "router.log", "wb")
        self.proc = psutil.Popen([sys.executable, "-m", "router", "--model", "demo", "--port",
                                  str(self.port), "--log-level", "warning", *extra], env=env,
                                 stdout=self.log, stderr=self.log, start_new_session=True)

    async def health(self, client: httpx.AsyncClient) -> dict[str, Any]:
        try:
            return (await client.get(self.url + "/health", timeout=5)).json()
        except (httpx.HTTPError, ValueError):
            return {}

    async def wait_ready(self, client: httpx.AsyncClient, old_pid: int | None, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            h = await self.health(client)
            w = (h.get("workers") or [{}])[0]
            if h.get("status") == "ok" and w.get("pid") != old_pid:
                return w
            await asyncio.sleep(0.02)
        raise TimeoutError("the worker did not become ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except psutil.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


async def stream_once(client: httpx.AsyncClient, url: str, max_tokens: int, soak: Soak | None = None) -> str:
    """One streaming request; returns "ok", "error:<code>" or "lost"."""
    body = {"prompt": f"soak {random.random()}", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
            if resp.status_code != 200:
                data = json.loads(await resp.aread())
                return f"error:{data['error']['code']}"
            error, done = None, False
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and '"error"' in line:
                    error = json.loads(line[6:])["error"]["code"]
                if line == "data: [DONE]":
                    done = True
            if not done:
                return "lost"
            return f"error:{error}" if error else "ok"
    except (httpx.HTTPError, ValueError, KeyError):
        return "lost"


async def timed(coro: Any) -> tuple[str, float]:
    outcome = await coro
    return outcome, time.monotonic()


async def measure_kills(r: RouterUnderTest, kills: int) -> dict[str, Any]:
    answered, serving, serving_net = [], [], []
    redispatched = 0
    async with httpx.AsyncClient() as client:
        worker = await r.wait_ready(client, None, 180)
        killed_at = 0.0
        for i in range(kills):
            if i:  # stay under the crash-loop limit (5 deaths in 60 s)
                await asyncio.sleep(max(0.0, KILL_SPACING_S - (time.monotonic() - killed_at)))
            worker = await r.wait_ready(client, None, 180)
            streams = [asyncio.create_task(timed(stream_once(client, r.url, 2000))) for _ in range(4)]
            await asyncio.sleep(1.0)  # every stream has produced output: none is re-dispatched
            killed_at = time.monotonic()
            os.kill(worker["pid"], signal.SIGKILL)
            results = await asyncio.gather(*streams)
            assert all(outcome != "lost" for outcome, _ in results), results
            errors = [ended for outcome, ended in results if outcome.startswith("error")]
            redispatched += len(results) - len(errors)
            if errors:
                answered.append(max(errors) - killed_at)
            worker = await r.wait_ready(client, worker["pid"], 180)
            while (await client.post(r.url + "/v1/completions", json={"prompt": "up?", "max_tokens": 1},
                                     timeout=60)).status_code != 200:
                await asyncio.sleep(0.01)
            took = time.monotonic() - killed_at
            serving.append(took)
            serving_net.append(took - float(worker.get("last_start_s") or 0.0)
                               - float(worker.get("last_backoff_s") or 0.0))
    health = await_health_sync(r)
    return {"kills": kills, "streams_redispatched_and_completed": redispatched, "restarts_seen": (health.get("workers") or [{}])[0].get("restarts"),
            **_summary("death_to_last_answered_s", answered),
            **_summary("death_to_serving_s", serving),
            **_summary("death_to_serving_minus_start_and_backoff_s", serving_net)}


def await_health_sync(r: RouterUnderTest) -> dict[str, Any]:
    try:
        return httpx.get(r.url + "/health", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}


def _summary(name: str, values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {f"{name}_p50": statistics.median(ordered), f"{name}_max": ordered[-1]}


async def soak(r: RouterUnderTest, seconds: float, kill_every_s: float, concurrency: int) -> dict[str, Any]:
    result = Soak()
    stop_at = time.monotonic() + seconds
    async with httpx.AsyncClient() as client:
        await r.wait_ready(client, None, 180)
        rss_start = r.proc.memory_info().rss

        async def traffic() -> None:
            while time.monotonic() < stop_at:
                result.sent += 1
                outcome = await stream_once(client, r.url, random.choice([8, 32, 200]))
                if outcome == "ok":
                    result.ok += 1
                elif outcome == "lost":
                    result.lost += 1
                else:
                    result.clean_errors += 1
                    code = outcome.split(":", 1)[1]
                    result.errors_by_code[code] = result.errors_by_code.get(code, 0) + 1

        async def killer() -> None:
            while time.monotonic() + kill_every_s < stop_at:
                await asyncio.sleep(kill_every_s)
                worker = ((await r.health(client)).get("workers") or [{}])[0]
                if worker.get("state") == "ready" and worker.get("pid"):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(worker["pid"], signal.SIGKILL)

        await asyncio.gather(killer(), *(traffic() for _ in range(concurrency)))
        rss_end = r.proc.memory_info().rss
    return {**asdict(result), "seconds": seconds, "kill_every_s": kill_every_s,
            "router_rss_start_bytes": rss_start, "router_rss_end_bytes": rss_end}


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("faults", __doc__)
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--soak-s", type=float, default=600.0)
    p.add_argument("--kill-every-s", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=6)
    ns = cli.parse(p, argv)
    with tempfile.TemporaryDirectory(prefix="hr-faults-") as tmp:
        r = RouterUnderTest(Path(tmp), [])
        try:
            out = {"kills": asyncio.run(measure_kills(r, ns.kills)) if ns.kills else None,
                   "soak": asyncio.run(soak(r, ns.soak_s, ns.kill_every_s, ns.concurrency))
                   if ns.soak_s > 0 else None}
        finally:
            r.stop()
    text = json.dumps(out, indent=2)
    print(text)
    if ns.json:
        ns.json.write_text(text)
    lost = (out["soak"] or {}).get("lost", 0)
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
