"""Memory figures: safety and utilisation under a tight limit, with and without admission.

    python -m bench memory [--limit-mb 200] [--requests 48] [--concurrency 16] [--json out.json]

One randomised mix (prompt lengths, max_tokens; fixed seed so every system sees the same
requests) runs against three routers on the demo model:
- ``admission``: --memory-limit-mb L --oom-guard abort (the guard makes an overshoot fatal)
- ``no_admission``: the same with --unsafe-no-admission (shows the guard is real)
- ``unlimited``: no limit (the throughput reference)
Figures: aborts, peak/limit, peak above weights / budget (utilisation), tokens/s under the
limit vs unlimited, errors. Plus the router's admission decision time (p50/p99), measured
in-process on the pure functions the router calls per request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench import cli
from bench.faults import RouterUnderTest

log = logging.getLogger("bench.memory")


def mix(n: int, seed: int = 7) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"prompt": [rng.randrange(3, 500) for _ in range(rng.choice([20, 40, 80, 160, 320]))],
             "max_tokens": rng.choice([16, 32, 64, 128]), "ignore_eos": True, "temperature": 0}
            for _ in range(n)]


async def run_mix(r: RouterUnderTest, bodies: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)
    codes: dict[str, int] = {}
    tokens = 0

    async def one(client: httpx.AsyncClient, body: dict[str, Any]) -> None:
        nonlocal tokens
        async with sem:
            try:
                resp = await client.post(r.url + "/v1/completions", json=body, timeout=600)
                key = str(resp.status_code) if resp.status_code == 200 else resp.json()["error"]["code"]
                if resp.status_code == 200:
                    tokens += resp.json()["usage"]["completion_tokens"]
            except (httpx.HTTPError, ValueError, KeyError):
                key = "lost"
            codes[key] = codes.get(key, 0) + 1

    async with httpx.AsyncClient() as client:
        first = await r.wait_ready(client, None, 180)
        started = time.monotonic()
        await asyncio.gather(*(one(client, b) for b in bodies))
        elapsed = time.monotonic() - started
        await asyncio.sleep(0.5)  # let a dying worker's exit be recorded
        health = (await client.get(r.url + "/health", timeout=10)).json()
        report = (await client.get(r.url + "/v1/memory", timeout=10)).json()["workers"]
    worker = health["workers"][0]
    out: dict[str, Any] = {"codes": codes, "tokens_per_s": tokens / elapsed, "seconds": elapsed,
                           "restarts": worker["restarts"], "same_pid": worker["pid"] == first["pid"],
                           "last_exit": worker.get("last_exit")}
    if report:
        w = report[0]
        out.update(peak_over_limit=w["peak_bytes"] / w["limit_bytes"],
                   utilisation=(w["peak_bytes"] - w["weights_bytes"]) / max(w["budget_bytes"], 1),
                   worst_measured_over_predicted=w["worst_measured_over_predicted"],
                   limit_bytes=w["limit_bytes"])
    return out


def decision_timing(samples: int = 20000) -> dict[str, float]:
    """The router's per-request admission work, on the pure functions it calls."""
    from common.costmodel import CostModel
    from router.fleet import admission

    m = CostModel(kv_bytes_per_token=65536, num_layers=4, prefill_a_bytes=90000.0,
                  prefill_c_bytes=170.0, budget_bytes=150 << 20, context_length=4096,
                  prefill_step_tokens=512)
    view = admission.WorkerView(model=m, admission=True, max_running=32, report_age_s=0.1)
    rng = random.Random(1)
    times = []
    for _ in range(samples):
        prompt, out = rng.randrange(1, 3000), rng.randrange(1, 1000)
        in_flight = [rng.randrange(100, 800) for _ in range(rng.randrange(0, 16))]
        t = time.perf_counter()
        if admission.check_ever(m, True, prompt, out) is None:
            admission.can_dispatch(view, in_flight, prompt, out)
        times.append(time.perf_counter() - t)
    times.sort()
    return {"decision_p50_us": times[len(times) // 2] * 1e6,
            "decision_p99_us": times[int(len(times) * 0.99)] * 1e6}


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("memory", __doc__)
    p.add_argument("--limit-mb", type=int, default=200)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=16)
    ns = cli.parse(p, argv)
    bodies = mix(ns.requests)
    limit = ["--memory-limit-mb", str(ns.limit_mb), "--oom-guard", "abort"]
    systems = {"admission": limit, "no_admission": [*limit, "--unsafe-no-admission"], "unlimited": []}
    out: dict[str, Any] = {"limit_mb": ns.limit_mb, "requests": ns.requests,
                           "concurrency": ns.concurrency, **decision_timing()}
    for name, extra in systems.items():
        with tempfile.TemporaryDirectory(prefix="hr-mem-") as tmp:
            r = RouterUnderTest(Path(tmp), extra)
            try:
                log.info("running the mix on %s", name)
                out[name] = asyncio.run(run_mix(r, bodies, ns.concurrency))
            finally:
                r.stop()
    adm, unl = out["admission"], out["unlimited"]
    out["tokens_per_s_limited_over_unlimited"] = adm["tokens_per_s"] / max(unl["tokens_per_s"], 1e-9)
    text = json.dumps(out, indent=2, default=str)
    print(text)
    if ns.json:
        ns.json.write_text(text)
    safe = adm["restarts"] == 0 and adm.get("peak_over_limit", 2) <= 1.0
    return 0 if safe else 1


if __name__ == "__main__":
    sys.exit(main())
