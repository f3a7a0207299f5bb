"""Issue 10's CPU repro of a cost-model scale that grows from nothing: does it still?

    python -m bench.scale_repro [--root DIR] [--limit-mb 220]

A router on the demo model (``--memory-limit-mb 220 --oom-guard abort``) with its own empty
cache folder (so no calibration, prefix-cache entry or disk file of an earlier run is
reused): six ~600-token chats one at a time, then 8 completions of ~640 prompt tokens and
64 output tokens at once. Prints the statuses, the wall time of the requests, and the
worker's ``scale`` (with its history), ``max_request_tokens``, the worst measured /
predicted step and ``peak_bytes / limit_bytes`` from ``/v1/memory``. ``--root`` runs
another checkout's code (e.g. an older commit exported with ``git archive``), so two
versions can be compared in turns on one machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.systems import Headroom

WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma")
STARTUP_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 300.0


def words(rnd: random.Random, n: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(n))


async def drive(url: str) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        rnd = random.Random(7)
        started = time.monotonic()
        statuses = []
        for _ in range(6):  # ~600 tokens each with the demo's byte-level tokenizer
            async with s.post(url + "/v1/chat/completions", json={
                    "model": "demo", "messages": [{"role": "user", "content": words(rnd, 112)}],
                    "max_tokens": 16}) as r:
                await r.read()
                statuses.append(r.status)

        async def one() -> int:
            async with s.post(url + "/v1/completions", json={
                    "model": "demo", "prompt": words(rnd, 128), "max_tokens": 64, "ignore_eos": True}) as r:
                await r.read()
                return r.status

        statuses += await asyncio.gather(*(one() for _ in range(8)))
        wall = time.monotonic() - started
        async with s.get(url + "/v1/memory") as r:
            w = (await r.json())["workers"][0]
    return {"statuses": statuses, "wall_s": round(wall, 1), "scale": w.get("scale"),
            "scale_history": w.get("scale_history"), "max_request_tokens": w.get("max_request_tokens"),
            "worst_measured_over_predicted": w.get("worst_measured_over_predicted"),
            "peak_over_limit": round(w["peak_bytes"] / w["limit_bytes"], 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scale_repro", description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=None,
                    help="the checkout whose router and worker run (default: this one)")
    ap.add_argument("--limit-mb", type=int, default=220)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="scale-repro-") as tmp:
        run_dir = Path(tmp)
        router = Headroom("demo", run_dir, ["--memory-limit-mb", str(args.limit_mb), "--oom-guard", "abort"])
        # Its own cache folder: no calibration or demo build of an earlier run is reused.
        router.proc.env["XDG_CACHE_HOME"] = str(run_dir / "cache")
        if args.root is not None:
            router.proc.cwd = args.root.resolve()
            router.proc.env["PYTHONPATH"] = str(router.proc.cwd)
        try:
            router.start(STARTUP_TIMEOUT_S)
            doc = asyncio.run(drive(router.url))
        finally:
            router.stop()
    doc["root"] = str(args.root or "this checkout")
    print(json.dumps(doc))
    return 0 if all(s == 200 for s in doc["statuses"]) else 1


if __name__ == "__main__":
    sys.exit(main())
