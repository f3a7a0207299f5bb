"""Many-model figures: cold load, swap, idle memory, replicas.

    python -m bench models [--swaps 3] [--concurrency 16] [--json out.json]

- cold: from a request for an unloaded model to its first token (Headroom starts the worker
  on demand), against mlx_lm.server from process start to its first token.
- swap: two models in a host budget that holds one: from a request for the other model to
  its first token (Headroom stops the idle worker, waits for its exit, starts the other),
  against mlx_lm.server stopped and restarted with the other model.
- idle: the router's RSS with several models and nothing loaded (and its worker count).
- replicas: requests per second and tokens per second of 2 workers of one model against 1,
  at the same concurrency (CPU, one host: the ratio says whether replicas help on one box).

The two models are the demo model and a copy with its output head negated.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench import cli
from bench.procs import ServerProcess, free_port, server_env

log = logging.getLogger("bench.models")
ROOT = Path(__file__).resolve().parents[1]
START_S = 120.0
PROMPT = "Say something."


def make_models(root: Path) -> tuple[Path, Path]:
    import mlx.core as mx

    from worker.demo import default_cache_root, ensure_demo_model

    demo = ensure_demo_model(default_cache_root(dict(os.environ)))
    alpha, beta = root / "alpha", root / "beta"
    for folder in (alpha, beta):
        shutil.copytree(demo, folder, dirs_exist_ok=True)
    weights = mx.load(str(beta / "model.safetensors"))
    weights["lm_head.weight"] = -weights["lm_head.weight"]
    mx.save_safetensors(str(beta / "model.safetensors"), weights, metadata={"format": "mlx"})
    return alpha, beta


class Server(ServerProcess):
    """bench/procs.py's server process on a free port, started at once."""

    def __init__(self, argv: list[str], run_dir: Path, name: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(name, [sys.executable, *argv, "--port", str(self.port)], server_env(run_dir),
                         run_dir / f"{name}-{self.port}.log", self.url + "/health")
        self.start()

    def rss_bytes(self) -> tuple[int, int]:
        """This process's RSS and how many child processes it has."""
        assert self.popen is not None
        proc = psutil.Process(self.popen.pid)
        return proc.memory_info().rss, len(proc.children(recursive=True))


def first_token_s(url: str, model: str, deadline_s: float = START_S) -> float:
    """Seconds from now to the first streamed token, retrying while the server is not up."""
    started = time.monotonic()
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "stream": True, "temperature": 0.0}
    while time.monotonic() - started < deadline_s:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=START_S) as r:
                if r.status_code == 200:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"no first token from {url} within {deadline_s:.0f}s")


def wait_ok(url: str) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url}/health never answered 200")


def headroom(run: Path, alpha: Path, beta: Path, swaps: int) -> dict[str, Any]:
    router = Server(["-m", "router", "--model", f"alpha={alpha}", "--model", f"beta={beta}",
                     "--host-memory-mb", "120", "--worker-addr",
                     f"ipc://{run}/headroom.sock"], run, "headroom")
    try:
        wait_ok(router.url)
        time.sleep(2.0)  # settle: the idle figure is the steady state
        rss, children = router.rss_bytes()
        cold = first_token_s(router.url, "alpha")
        warm = first_token_s(router.url, "alpha")
        swap_s = [first_token_s(router.url, name) for _ in range(swaps) for name in ("beta", "alpha")]
    finally:
        router.stop()
    return {"idle_router_rss_bytes": rss, "idle_workers": children, "cold_ttft_s": cold,
            "warm_ttft_s": warm, "swap_ttft_s": swap_s}


def mlx_lm_server(run: Path, alpha: Path, beta: Path, swaps: int) -> dict[str, Any]:
    def start(folder: Path) -> Server:
        return Server(["-m", "mlx_lm.server", "--model", str(folder)], run, "mlx_lm")

    t0 = time.monotonic()
    server = start(alpha)
    first_token_s(server.url, "default_model")
    cold = time.monotonic() - t0  # from the process start: it loads at start
    swap_s = []
    try:
        for _ in range(swaps):
            for folder in (beta, alpha):
                t0 = time.monotonic()
                server.stop()
                server = start(folder)
                first_token_s(server.url, "default_model")
                swap_s.append(time.monotonic() - t0)
    finally:
        server.stop()
    return {"cold_ttft_s": cold, "swap_ttft_s": swap_s}


async def load(url: str, concurrency: int, num_requests: int, max_tokens: int) -> dict[str, float]:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
    tokens = 0
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(num_requests):
        queue.put_nowait(i)

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while not queue.empty():
            queue.get_nowait()
            r = await client.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            tokens += r.json()["usage"]["completion_tokens"]

    started = time.monotonic()
    async with httpx.AsyncClient(timeout=START_S) as client:
        await asyncio.gather(*(one(client) for _ in range(concurrency)))
    wall = time.monotonic() - started
    return {"wall_s": wall, "requests_per_s": num_requests / wall, "tokens_per_s": tokens / wall}


def replicas(run: Path, alpha: Path, replica_counts: list[int], concurrency: int,
             num_requests: int, max_tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in replica_counts:
        router = Server(["-m", "router", "--model", str(alpha), "--replicas", str(n),
                         "--worker-addr", f"ipc://{run}/replicas{n}.sock"], run, f"replicas{n}")
        try:
            deadline = time.monotonic() + START_S
            while sum(w.get("state") == "ready" for w in _health(router.url).get("workers", [])) < n:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{n} workers not ready")
                time.sleep(0.2)
            asyncio.run(load(router.url, concurrency, concurrency, max_tokens))  # warm
            out[str(n)] = asyncio.run(load(router.url, concurrency, num_requests, max_tokens))
        finally:
            router.stop()
    return out


def _health(url: str) -> dict[str, Any]:
    try:
        return httpx.get(url + "/health", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return {}


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("models", __doc__)
    p.add_argument("--swaps", type=int, default=3, help="round trips alpha → beta → alpha")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--skip", default="", help="comma-separated: headroom,mlx_lm,replicas")
    ns = cli.parse(p, argv)
    skip = set(ns.skip.split(","))
    with tempfile.TemporaryDirectory(prefix="bench-models-") as tmp:
        run = Path(tmp)
        alpha, beta = make_models(run)
        doc: dict[str, Any] = {}
        if "headroom" not in skip:
            doc["headroom"] = headroom(run, alpha, beta, ns.swaps)
        if "mlx_lm" not in skip:
            doc["mlx_lm_server"] = mlx_lm_server(run, alpha, beta, ns.swaps)
        if "replicas" not in skip:
            doc["replicas"] = replicas(run, alpha, [1, 2], ns.concurrency, ns.requests,
                                       ns.max_tokens)
    print(report(doc))
    if ns.json:
        ns.json.write_text(json.dumps(doc, indent=2))
    return 0


def report(doc: dict[str, Any]) -> str:
    lines = []
    h, m = doc.get("headroom"), doc.get("mlx_lm_server")
    if h:
        lines.append(f"router idle RSS, nothing loaded: {h['idle_router_rss_bytes'] / 2**20:.0f} MiB "
                     f"({h['idle_workers']} workers)")
        lines.append(f"headroom cold load TTFT {h['cold_ttft_s']:.2f} s, warm {h['warm_ttft_s']:.3f} s, "
                     f"swap TTFT median {statistics.median(h['swap_ttft_s']):.2f} s")
    if m:
        lines.append(f"mlx_lm.server cold start to first token {m['cold_ttft_s']:.2f} s, "
                     f"restart-with-the-other-model median {statistics.median(m['swap_ttft_s']):.2f} s")
    if h and m:
        lines.append(f"swap ratio headroom / mlx_lm.server: "
                     f"{statistics.median(h['swap_ttft_s']) / statistics.median(m['swap_ttft_s']):.2f}")
    r = doc.get("replicas")
    if r and "1" in r and "2" in r:
        for n, v in r.items():
            lines.append(f"replicas {n}: {v['tokens_per_s']:.0f} tok/s, {v['requests_per_s']:.2f} req/s")
        lines.append(f"two replicas / one: {r['2']['tokens_per_s'] / r['1']['tokens_per_s']:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
