"""Issue 10's CPU repro of a cost-model scale that grows from nothing: does it still?

    python -m bench.scale_repro [--root DIR] [--port 8420] [--limit-mb 220]

A router on the demo model (``--memory-limit-mb 220 --oom-guard abort``) with its own empty
cache folder (so no calibration, prefix-cache entry or disk file of an earlier run is
reused): six ~600-token chats one at a time, then 8 completions of ~640 prompt tokens and
64 output tokens at once. Prints the statuses, the wall time of the requests, and the
worker's ``scale`` (with its history), ``max_request_tokens``, the worst measured /
predicted step and ``peak_bytes / limit_bytes`` from ``/v1/memory``. ``--root`` runs another checkout's code
(e.g. an older commit exported with ``git archive``), so two versions can be compared in
turns on one machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma")
HEALTH_WAIT_S = 180.0
REQUEST_TIMEOUT_S = 300.0


def words(rnd: random.Random, n: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(n))


async def drive(url: str) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        deadline = time.monotonic() + HEALTH_WAIT_S
        while True:
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200 and (await r.json())["models"][0]["workers"]:
                        break
            except (aiohttp.ClientError, KeyError, IndexError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"no healthy worker within {HEALTH_WAIT_S:.0f} s")
            await asyncio.sleep(1.0)
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
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                    help="the checkout whose router and worker run (default: this one)")
    ap.add_argument("--port", type=int, default=8420)
    ap.add_argument("--limit-mb", type=int, default=220)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="scale-repro-") as cache:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_ROUTER_", "MLX_WORKER_"))}
        env.update(PYTHONPATH=str(args.root), XDG_CACHE_HOME=cache, HF_HUB_OFFLINE="1")
        log = open(Path(cache) / "router.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "router", "--model", "demo", "--port", str(args.port),
                                 "--memory-limit-mb", str(args.limit_mb), "--oom-guard", "abort"],
                                cwd=args.root, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            doc = asyncio.run(drive(f"http://127.0.0.1:{args.port}"))
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
    doc["root"] = str(args.root)
    print(json.dumps(doc))
    return 0 if all(s == 200 for s in doc["statuses"]) else 1


if __name__ == "__main__":
    sys.exit(main())
