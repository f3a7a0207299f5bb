"""`python -m bench.gpu_run PART...`: issue 10's figures on a GPU, one piece per argument.

Run on the lent H200 through `bench/gpu_run.sh` (which installs the carried wheels first);
see bench/README.md ("On the lent GPU") for the exact `run` calls. Parts, in the order given:

- info:   MLX's device and `mx.device_info()`, what worker/devices.py's probe reads, NVML's
          view, and whether 2 GiB allocated through MLX shows in the GPU's free memory.
- build:  the Llama-3-8B-shaped 4-bit model (bench/gpumodel.py) into --model-dir, unless
          it is already there; the build's timings.
- shape:  the transient of one forward over a grid of chunks (1 to 2048 tokens) and
          contexts (0 to 8k), and decode steps of 1-32 rows, against the calibration probe's
          fit (bench/calshape.py, in its own process).
- ttft:   a fresh router (limit = weights + --budget-mb): time to healthy, then the time to
          first token of the first short request vs the second, a 1024-token prompt twice, 640 and 1536 tokens,
          and two batches of 8 (a fresh worker compiles kernels for each new shape).
- split:  a fresh router at DEBUG with JSON logs; --split-requests short prompts one at a
          time, each request's first-token time cut into stages on one clock (bench/ttft_split.py).
- memory: a tight limit (weights + --tight-budget-mb, or with --tight-over runtime weights +
          the measured runtime baseline + margin + it, --oom-guard abort): a burst of
          --burst requests of ~--burst-prompt-tokens + --burst-max-tokens, all at once;
          every status and error code, restarts and the worker pid before and after,
          peak_bytes vs limit_bytes, and /v1/memory every --snapshot-s.
- profile: one stream at a time for --profile-s seconds (--profile-max-tokens each, greedy,
          ignore_eos), the client's inter-token gaps against in-process mlx-lm's on the same
          prompts, the worker's own account of its loop (`/v1/memory` `loop`: time inside and
          around the engine's step), and py-spy samples of the worker and the router when
          py-spy is installed (raw folded stacks: `<out>/profile-{worker,router}.txt`).
- serve:  `python -m bench serve --model DIR` (headroom vs mlx_lm.server vs in-process) with
          the limit set; arguments after `--` go to it (e.g. `-- --concurrency 1,8`).
- agents: `python -m bench agents --model DIR` (coding-agent sessions: cold and cached-turn
          TTFT on the three systems) with the limit set, at its defaults (issue 25's sizes:
          sessions 1,8, 5 turns, 2k -> 8k tokens); arguments after `--` go to it too.

Each part writes `<out>/<part>.json`; server logs are appended to `<out>/logs.txt`. Every
wait is bounded; every router gets --memory-limit-mb. Model files stay out of --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from bench.client import one_request, request_body
from bench.metrics import percentile
from bench.procs import pid_gone
from bench.prompts import Prompt, make_prompts

log = logging.getLogger("bench.gpu_run")

PARTS = ("info", "build", "shape", "runtime", "ttft", "faults", "split", "memory", "profile", "serve", "agents",
         "cpuprofile")
ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
# Past the probe's rate limit on device reads (worker.memory.SYSTEM_READ_INTERVAL_S).
SNAPSHOT_SETTLE_S = 0.3
# cpuprofile: every thread's CPU time is read this often, and the worker counts as serving
# (py-spy starts on it) once it used this share of a core over one such interval.
CPUPROFILE_LOOK_S = 2.0
CPUPROFILE_BUSY = 0.5


def weights_mb(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) // MIB + 1


def encoder(model_dir: Path) -> Callable[[str], list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def write(out: Path, part: str, doc: dict[str, Any]) -> None:
    (out / f"{part}.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    log.info("%s: %s", part, json.dumps(doc, default=str)[:3000])


def append_log(out: Path, title: str, path: Path) -> None:
    text = path.read_text(errors="replace") if path.is_file() else "(no log)\n"
    with open(out / "logs.txt", "a") as fh:
        fh.write(f"\n===== {title} ({path.name}) =====\n{text[-2_000_000:]}")


# --- info -------------------------------------------------------------------------------

def part_info(args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx

    from worker.devices import CudaProbe, make_probe

    doc: dict[str, Any] = {"mlx": mx.__version__, "default_device": str(mx.default_device()),
                           "metal": mx.metal.is_available(), "cuda": mx.cuda.is_available(),
                           "device_info": dict(mx.device_info())}
    probe = make_probe(args.probe_limit_mb)
    doc["probe"] = {"class": type(probe).__name__, "device": probe.device,
                    "device_name": getattr(probe, "device_name", None), "limit_bytes": probe.limit_bytes,
                    "reading": _reading(probe)}
    doc["nvml"] = _nvml_view()
    if isinstance(probe, CudaProbe):
        # Does memory MLX allocates show in the GPU's free memory (and NVML's per-process
        # figure)? If MLX took managed memory it might not until touched.
        before = dict(mx.device_info())
        a = mx.ones((512, 1024, 1024), dtype=mx.float32)  # 2 GiB
        mx.eval(a)
        time.sleep(SNAPSHOT_SETTLE_S)
        during = dict(mx.device_info())
        doc["alloc_2gib"] = {"free_before": before.get("free_memory"), "free_during": during.get("free_memory"),
                             "active_during": mx.get_active_memory(), "nvml_during": _nvml_view(),
                             "probe_during": _reading(probe, fresh=True)}
        del a
        mx.clear_cache()
        time.sleep(SNAPSHOT_SETTLE_S)
        doc["alloc_2gib"]["free_after_clear"] = dict(mx.device_info()).get("free_memory")
    doc["nvidia_smi"] = _run(["nvidia-smi", "--query-gpu=name,memory.total,memory.used,memory.free,"
                              "driver_version", "--format=csv"])
    return doc


def _reading(probe: Any, fresh: bool = False) -> dict[str, int]:
    if fresh:
        time.sleep(SNAPSHOT_SETTLE_S)
    r = probe.read()
    return {"active_bytes": r.active_bytes, "cache_bytes": r.cache_bytes, "peak_bytes": r.peak_bytes,
            "footprint_bytes": r.footprint_bytes, "system_available_bytes": r.system_available_bytes}


def _nvml_view() -> dict[str, Any]:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        procs = [{"pid": p.pid, "used": p.usedGpuMemory}
                 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
        return {"total": mem.total, "free": mem.free, "used": mem.used, "name": str(pynvml.nvmlDeviceGetName(h)),
                "processes": procs, "my_pid": os.getpid()}
    except Exception as exc:  # noqa: BLE001 - a report of what the machine has; absent is a finding
        return {"error": f"{type(exc).__name__}: {exc}"}


def _run(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{type(exc).__name__}: {exc}"


# --- build ------------------------------------------------------------------------------

def run_module(args: argparse.Namespace, title: str, module_argv: list[str]) -> str:
    """``python -m`` one of this checkout's modules within the part's timeout, its output
    appended to ``logs.txt``; its stdout, or RuntimeError with the tail of its stderr."""
    proc = subprocess.run([sys.executable, "-m", *module_argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=args.part_timeout_s)
    with open(args.out / "logs.txt", "a") as fh:
        fh.write(f"\n===== {title} =====\n{proc.stderr[-20000:]}{proc.stdout}")
    if proc.returncode != 0:
        raise RuntimeError(f"{title} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return proc.stdout


def part_build(args: argparse.Namespace) -> dict[str, Any]:
    from bench import gpumodel

    manifest = args.model_dir / gpumodel.MANIFEST
    if manifest.is_file():
        return {"reused": True, **json.loads(manifest.read_text())}
    started = time.monotonic()
    run_module(args, "build", ["bench.gpumodel", "--out", str(args.model_dir), *(["--tiny"] if args.tiny else [])])
    return {"reused": False, "wall_s": round(time.monotonic() - started, 2), **json.loads(manifest.read_text())}


# --- shape ------------------------------------------------------------------------------

def part_shape(args: argparse.Namespace) -> dict[str, Any]:
    path = args.out / "shape-points.json"
    out = run_module(args, "shape", ["bench.calshape", "--model", str(args.model_dir), "--out", str(path),
                                     *args.shape_arg])
    doc = json.loads(path.read_text())
    return {"table": out.split("\n{")[0], **{k: v for k, v in doc.items() if k != "points"}}


# --- routers ----------------------------------------------------------------------------

def start_router(args: argparse.Namespace, run_dir: Path, limit_mb: int, extra: list[str]) -> Any:
    from bench.systems import Headroom

    router = Headroom(str(args.model_dir), run_dir, ["--memory-limit-mb", str(limit_mb), *extra])
    router.start(args.startup_timeout_s)  # sets startup_s: seconds to a healthy /health
    return router


async def get_json(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
            return dict(await resp.json())
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def worker_of(health: dict[str, Any]) -> dict[str, Any]:
    workers = health.get("workers") or [{}]
    return dict(workers[0])


# --- ttft -------------------------------------------------------------------------------

async def _ttft_sequence(url: str, encode: Callable[[str], list[int]], max_tokens: int) -> dict[str, Any]:
    shorts = make_prompts(encode, "ttft-short", 3 + 16, 32)
    longs = make_prompts(encode, "ttft-long", 2, 1024)
    body: Callable[[Prompt], dict[str, Any]] = lambda p: request_body(p, max_tokens, {"ignore_eos": True})
    target = url + "/v1/completions"
    out: dict[str, Any] = {}
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        # Then prompts of lengths no request had before (640, 1536): whether a new shape
        # pays for kernels on a warm worker, or only the first prompt of a fresh one.
        others = [make_prompts(encode, f"ttft-len{n}", 1, n)[0] for n in (640, 1536)]
        for name, prompt in [("short_1", shorts[0]), ("short_2", shorts[1]), ("short_idle", shorts[18]),
                             ("long_1", longs[0]), ("long_2", longs[1]),
                             ("len640", others[0]), ("len1536", others[1])]:
            if name == "short_idle":
                # As long idle as the fresh worker was before short_1 (about a second and a
                # half after "ready"): what idling alone costs a warm worker's first token.
                await asyncio.sleep(1.5)
            r = await one_request(session, target, body(prompt), max_tokens)
            out[name] = {"ttft_ms": _ms(r.ttft_s), "latency_ms": _ms(r.latency_s), "error": r.error,
                         "prompt_tokens": len(prompt.token_ids)}
        for name, group in [("batch8_1", shorts[2:10]), ("batch8_2", shorts[10:18])]:
            rs = await asyncio.gather(*(one_request(session, target, body(p), max_tokens) for p in group))
            ttfts = sorted(_ms(r.ttft_s) or 0.0 for r in rs)
            out[name] = {"ttft_ms_max": ttfts[-1], "ttft_ms_median": ttfts[len(ttfts) // 2],
                         "errors": [r.error for r in rs if r.error]}
        out["memory"] = await get_json(session, url + "/v1/memory")
        out["health"] = await get_json(session, url + "/health")
    for a, b in [("short_1", "short_2"), ("long_1", "long_2")]:
        if out[a]["ttft_ms"] and out[b]["ttft_ms"]:
            out[f"{a}_over_{b}"] = round(out[a]["ttft_ms"] / out[b]["ttft_ms"], 2)
    # A fresh worker that compiles kernels inside a step can be killed by the router's
    # watchdog (seen on the H200: "engine loop wedged"); the restarts say so.
    out["worker_restarts"] = worker_of(out["health"]).get("restarts")
    out["batch8_1_over_batch8_2"] = round(out["batch8_1"]["ttft_ms_max"] / max(out["batch8_2"]["ttft_ms_max"], 1e-9), 2)
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 2)


def part_runtime(args: argparse.Namespace) -> dict[str, Any]:
    """``bench.runtime``: what this process holds beyond MLX's count after each step of the
    agents' shape, and after ``mx.clear_cache()`` (what the gate's runtime set-aside is)."""
    path, text = args.out / "runtime.json", args.out / "runtime.txt"
    argv = [sys.executable, "-m", "bench.runtime", "--model", str(args.model_dir), "--out", str(path),
            *args.runtime_arg]
    # Its lines go to $OUT as they are read: a run cut short by the part's or the call's
    # limit still brings back every point it measured.
    proc = _run_within(args, "runtime", argv, text)
    print(text.read_text()[-6000:])
    if not path.exists():
        raise RuntimeError(f"bench.runtime ended ({proc.returncode}) before its summary; runtime.txt has its points")
    doc = json.loads(path.read_text())
    return {"summary": doc["summary"], "baseline_mib": doc["baseline_mib"], "source": doc["source"]}


def part_ttft(args: argparse.Namespace) -> dict[str, Any]:
    limit_mb = weights_mb(args.model_dir) + args.budget_mb
    with tempfile.TemporaryDirectory(prefix="gpu-ttft-") as tmp:
        router = start_router(args, Path(tmp), limit_mb, args.router_arg)
        try:
            seq = asyncio.run(asyncio.wait_for(_ttft_sequence(router.url, encoder(args.model_dir),
                                                              args.max_tokens), args.part_timeout_s))
        finally:
            router.stop()
            append_log(args.out, "ttft router", router.proc.log_path)
    return {"limit_mb": limit_mb, "healthy_after_s": round(router.startup_s or 0, 2), **seq}


# --- faults -----------------------------------------------------------------------------

# The JSON and the tool call that killed the worker on the H200 when its llguidance was old.
_PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                             "age": {"type": "integer", "minimum": 0, "maximum": 150}},
           "required": ["name", "age"], "additionalProperties": False}
_GRAMMAR_BODIES = {
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": _PERSON}}},
    "tool_choice_required": {"tools": [{"type": "function", "function": {"name": "f", "parameters": _PERSON}}],
                             "tool_choice": "required"},
}
_UNCLEAN = ("SIGKILL", "killing worker", "Host unreachable", "did not stop")


def _http(method: str, url: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> tuple[int, Any]:
    req = urllib.request.Request(url, method=method, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def _restart_timing(url: str, how: str, timeout_s: float) -> dict[str, Any]:
    """Seconds from the restart (operator's, or SIGKILL of the worker) to the old process
    gone and to the new worker's first answer."""
    old = worker_of(_http("GET", url + "/health")[1]).get("pid")
    started = time.monotonic()
    if how == "restart":
        _http("POST", url + "/admin/workers/restart")
    else:
        os.kill(old, signal.SIGKILL)
    gone_s = None
    deadline = started + timeout_s
    while time.monotonic() < deadline:
        if gone_s is None and pid_gone(old):
            gone_s = time.monotonic() - started
        status, health = _http("GET", url + "/health")
        if status == 200 and worker_of(health).get("pid") not in (None, old) and gone_s is not None:
            break
        time.sleep(0.05)
    ready_s = time.monotonic() - started
    status, _ = _http("POST", url + "/v1/completions", {"model": "m", "prompt": "after", "max_tokens": 4})
    return {"old_pid_gone_s": None if gone_s is None else round(gone_s, 3), "ready_s": round(ready_s, 2),
            "served_s": round(time.monotonic() - started, 2), "status": status,
            "restart": worker_of(_http("GET", url + "/health")[1]).get("last_exit")}


def part_faults(args: argparse.Namespace) -> dict[str, Any]:
    """Issue 30 on the GPU: grammar requests (each alone and beside plain ones) leave the
    worker serving; an operator restart and a SIGKILL, timed; a stop with no SIGKILL."""
    limit_mb = weights_mb(args.model_dir) + args.budget_mb
    out: dict[str, Any] = {"limit_mb": limit_mb}
    with tempfile.TemporaryDirectory(prefix="gpu-faults-") as tmp:
        router = start_router(args, Path(tmp), limit_mb, args.router_arg)
        out["healthy_after_s"] = round(router.startup_s or 0, 2)
        url = router.url
        try:
            pid = worker_of(_http("GET", url + "/health")[1]).get("pid")
            msgs = [{"role": "user", "content": "Who is it?"}]
            for name, extra in _GRAMMAR_BODIES.items():
                status, body = _http("POST", url + "/v1/chat/completions",
                                     {"model": "m", "messages": msgs, "max_tokens": 64, "temperature": 0, **extra})
                choice = (body or {}).get("choices", [{}])[0] if status == 200 else {}
                out[name] = {"status": status, "finish": choice.get("finish_reason"),
                             "message": choice.get("message") if status == 200 else body}
            out["same_pid_after_grammars"] = worker_of(_http("GET", url + "/health")[1]).get("pid") == pid
            for how in ("restart", "sigkill", "restart"):
                out.setdefault("restarts", []).append({"how": how, **_restart_timing(url, how, 120.0)})
        finally:
            started = time.monotonic()
            router.stop()
            out["stop_s"] = round(time.monotonic() - started, 2)
            log_text = router.proc.log_path.read_text(errors="replace")
            out["unclean_lines"] = [line for line in log_text.splitlines() if any(u in line for u in _UNCLEAN)][:20]
            out["worker_timing_lines"] = [line for line in log_text.splitlines()
                                          if any(k in line for k in ("[shutdown] done", "loaded", "calibrat",
                                                                     "warm", "ready:", "spawned"))][:40]
            append_log(args.out, "faults router", router.proc.log_path)
    return out


# --- split ------------------------------------------------------------------------------

def part_split(args: argparse.Namespace) -> dict[str, Any]:
    """One fresh router per variant: ``debug`` (the stages), ``info`` (the client's figure
    at the default log level), each also ``-nodisk`` (the prompt cache's disk tier off)."""
    from bench import ttft_split

    limit_mb = weights_mb(args.model_dir) + args.budget_mb
    out: dict[str, Any] = {"limit_mb": limit_mb}
    for variant in args.split_variants.split(","):
        level, _, nodisk = variant.partition("-")
        extra = ["--log-level", level, "--log-format", "json", *args.router_arg]
        extra += ["--prompt-cache-disk-bytes", "0"] if nodisk else []
        prompts = make_prompts(encoder(args.model_dir), f"split-{variant}-{time.time_ns() % 10**6}",
                               args.split_requests, 32)
        with tempfile.TemporaryDirectory(prefix="gpu-split-") as tmp:
            router = start_router(args, Path(tmp), limit_mb, extra)
            try:
                out[variant] = ttft_split.run(router.url, router.proc.log_path, [p.text for p in prompts],
                                              max_tokens=args.max_tokens)
            finally:
                router.stop()
                if level == "debug":
                    append_log(args.out, f"split {variant} router", router.proc.log_path)
        out["prompt_tokens"] = len(prompts[0].token_ids)
    return out


# --- memory -----------------------------------------------------------------------------

async def _burst(args: argparse.Namespace, url: str, prompts: list[Prompt]) -> dict[str, Any]:
    snapshots: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    done = asyncio.Event()
    started = time.monotonic()

    async def snap(session: aiohttp.ClientSession) -> None:
        while not done.is_set():
            mem = await get_json(session, url + "/v1/memory")
            for w in mem.get("workers") or []:
                snapshots.append({"t_s": round(time.monotonic() - started, 2), "queued": mem.get("queued"),
                                  **{k: v for k, v in w.items() if k != "cost_model"},
                                  "cost_model": w.get("cost_model")})
            with_timeout = asyncio.wait_for(done.wait(), args.snapshot_s)
            try:
                await with_timeout
            except asyncio.TimeoutError:
                pass

    async def one(session: aiohttp.ClientSession, prompt: Prompt) -> None:
        body = {"prompt": prompt.text, "max_tokens": args.burst_max_tokens, "temperature": 0.0,
                "ignore_eos": True}
        sent = time.monotonic()
        entry: dict[str, Any] = {"prompt_tokens": len(prompt.token_ids)}
        try:
            async with session.post(url + "/v1/completions", json=body) as resp:
                data = await resp.json(content_type=None)
                entry["status"] = resp.status
                if resp.status == 200:
                    entry["completion_tokens"] = data["usage"]["completion_tokens"]
                else:
                    entry["error"] = data.get("error", data)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:
            entry["status"] = "lost"
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
        entry["latency_s"] = round(time.monotonic() - sent, 2)
        results.append(entry)

    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=len(prompts) + 2)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        before = worker_of(await get_json(session, url + "/health"))
        snapper = asyncio.create_task(snap(session))
        await asyncio.gather(*(one(session, p) for p in prompts))
        wall_s = time.monotonic() - started
        done.set()
        await snapper
        await asyncio.sleep(0.5)  # let a dying worker's exit be recorded
        after_health = await get_json(session, url + "/health")
        final = await get_json(session, url + "/v1/memory")
    return _burst_summary(before, worker_of(after_health), final, results, snapshots, wall_s)


def _burst_summary(before: dict[str, Any], after: dict[str, Any], final: dict[str, Any],
                   results: list[dict[str, Any]], snapshots: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    statuses: dict[str, int] = {}
    for r in results:
        err = r.get("error")
        code = err.get("code") if isinstance(err, dict) else None
        key = f"{r['status']}" + (f":{code}" if code else "")
        statuses[key] = statuses.get(key, 0) + 1
    report = (final.get("workers") or [{}])[0]
    peaks = [s["peak_bytes"] for s in snapshots if isinstance(s.get("peak_bytes"), int)]
    peak = max([*peaks, report.get("peak_bytes", 0) or 0])
    limit = report.get("limit_bytes") or next((s["limit_bytes"] for s in snapshots if s.get("limit_bytes")), None)
    weights, budget = report.get("weights_bytes"), report.get("budget_bytes")
    return {
        "statuses": statuses, "wall_s": round(wall_s, 2),
        "tokens": sum(r.get("completion_tokens", 0) for r in results),
        "pid_before": before.get("pid"), "pid_after": after.get("pid"),
        "same_pid": before.get("pid") == after.get("pid"),
        "restarts_before": before.get("restarts"), "restarts_after": after.get("restarts"),
        "last_exit": after.get("last_exit"),
        "peak_bytes": peak, "limit_bytes": limit,
        "peak_over_limit": round(peak / limit, 4) if limit else None,
        "utilisation": round((peak - weights) / budget, 4) if weights and budget else None,
        "max_running_seen": max((s.get("running") or 0 for s in snapshots), default=0),
        "final_memory": report, "requests": sorted(results, key=lambda r: r["latency_s"]),
        "snapshots": snapshots,
    }


def runtime_limit_mb(weights: int, baseline: int, budget: int, slack: int = 0) -> int:
    """The limit (MiB) whose budget is ``budget`` bytes for a worker holding ``baseline``
    bytes beyond ``weights`` (the worker's own rule: limit - weights - baseline - margin),
    plus ``slack`` for the baseline's variation between processes (on the H200 one process
    settled at 1.58 GB, the next at 1.81 GB, and refused to start on what was left)."""
    from worker.memory import safety_margin

    baseline += slack
    above = budget + baseline
    for _ in range(8):  # the margin is a share of what lies above the weights: a fixed point
        above = budget + baseline + safety_margin(weights + above, weights)
    return -(-(weights + above) // MIB)


def _measured_baseline(args: argparse.Namespace) -> tuple[int, int]:
    """(weights, runtime baseline) in bytes as a worker counts them after its warm start
    (``/v1/memory``), from a router started under the loose limit (weights + --budget-mb)."""
    with tempfile.TemporaryDirectory(prefix="gpu-baseline-") as tmp:
        router = start_router(args, Path(tmp), weights_mb(args.model_dir) + args.budget_mb, args.router_arg)
        try:
            report = _worker_report(router.url)
            return int(report["weights_bytes"]), int(report["baseline_bytes"])
        finally:
            router.stop()
            append_log(args.out, "baseline router", router.proc.log_path)


def part_memory(args: argparse.Namespace) -> dict[str, Any]:
    limit_mb = weights_mb(args.model_dir) + args.tight_budget_mb
    baseline = None
    if args.tight_over == "runtime":  # --tight-budget-mb of *budget*: weights + baseline + margin below it
        weights, baseline = _measured_baseline(args)  # the worker's own figures, not file sizes
        limit_mb = runtime_limit_mb(weights, baseline, args.tight_budget_mb * MIB, args.tight_slack_mb * MIB)
    prompts = make_prompts(encoder(args.model_dir), "burst", args.burst, args.burst_prompt_tokens)
    extra = ["--oom-guard", "abort", "--queue-timeout", str(args.queue_timeout_s), *args.router_arg]
    with tempfile.TemporaryDirectory(prefix="gpu-memory-") as tmp:
        router = start_router(args, Path(tmp), limit_mb, extra)
        try:
            burst = asyncio.run(asyncio.wait_for(_burst(args, router.url, prompts), args.part_timeout_s))
        finally:
            router.stop()
            append_log(args.out, "memory router", router.proc.log_path)
    return {"limit_mb": limit_mb, "tight_budget_mb": args.tight_budget_mb, "tight_over": args.tight_over,
            "measured_baseline_bytes": baseline, "burst": args.burst,
            "prompt_tokens": args.burst_prompt_tokens, "max_tokens": args.burst_max_tokens,
            "healthy_after_s": round(router.startup_s or 0, 2), **burst}


# --- profile ----------------------------------------------------------------------------

async def _one_at_a_time(url: str, prompts: list[Prompt], max_tokens: int, seconds: float) -> list[Any]:
    target, results = url + "/v1/completions", []
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for prompt in prompts:
            if time.monotonic() > deadline:
                break
            results.append(await one_request(session, target,
                                             request_body(prompt, max_tokens, {"ignore_eos": True}), max_tokens))
    return results


def _gaps_ms(results: list[Any]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    gaps = [g * 1e3 for r in ok for g in r.itls_s]
    if not gaps:
        return {"requests": len(results), "errors": [r.error for r in results if r.error][:3]}
    return {"requests": len(results), "ok": len(ok), "gaps": len(gaps),
            "itl_p50_ms": round(percentile(gaps, 50), 3), "itl_mean_ms": round(sum(gaps) / len(gaps), 3),
            "ttft_p50_ms": round(percentile([r.ttft_s * 1e3 for r in ok], 50), 2)}


def _py_spy() -> str | None:
    """py-spy's executable: on the PATH or beside this interpreter (a venv not activated)."""
    import shutil

    return shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))


def _spy(pid: int | None, path: Path, seconds: float) -> subprocess.Popen[bytes] | None:
    exe = _py_spy()
    if exe is None or pid is None:
        return None
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", "250",
                             "--format", "raw", "--nonblocking", "-o", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _profile_window(args: argparse.Namespace, prompts: list[Prompt], extra: list[str],
                    spy: bool) -> tuple[dict[str, Any], int]:
    """One Headroom router, requests one at a time for --profile-s: (figures, requests run)."""
    out: dict[str, Any] = {"router_args": extra}
    with tempfile.TemporaryDirectory(prefix="gpu-profile-") as tmp:
        router = start_router(args, Path(tmp), weights_mb(args.model_dir) + args.budget_mb, [*extra, *args.router_arg])
        try:
            asyncio.run(_one_at_a_time(router.url, prompts[:3], args.profile_max_tokens, 60))  # warm
            before = _loop_of(router.url)
            spies = [_spy(router.worker_pid, args.out / "profile-worker.txt", args.profile_s),
                     _spy(router.proc.popen.pid if router.proc.popen else None,
                          args.out / "profile-router.txt", args.profile_s)] if spy else []
            try:
                results = asyncio.run(_one_at_a_time(router.url, prompts[3:], args.profile_max_tokens,
                                                     args.profile_s))
                after = _loop_of(router.url)
            finally:
                if spy:
                    out["py_spy"] = [_spy_done(s) for s in spies]
            out.update(_gaps_ms(results))
            steps = after.get("steps", 0) - before.get("steps", 0)
            if steps > 0:
                out["worker_loop"] = {
                    "steps": steps,
                    "engine_ms_per_step": round((after["engine_s"] - before["engine_s"]) / steps * 1e3, 3),
                    "overhead_us_per_step": round(((after["busy_s"] - after["engine_s"] - after.get("store_s", 0))
                                                   - (before["busy_s"] - before["engine_s"] - before.get("store_s", 0)))
                                                  / steps * 1e6, 1)}
            out["disk_tier"] = (_worker_report(router.url).get("prompt_cache", {}).get("tiers") or {}).get("disk")
        finally:
            router.stop()
            append_log(args.out, "profile router", router.proc.log_path)
    return out, len(results)


def part_profile(args: argparse.Namespace) -> dict[str, Any]:
    """Headroom (prompt cache's disk tier on), in-process mlx-lm, then Headroom with the disk
    tier off, on the same prompts one at a time: in-process between the two Headroom windows
    shows how far the machine itself drifts (on the H200 in-process ITL ran 6.1-8.3 ms
    across runs, and a Headroom window once took 12 ms a step with the disk tier off)."""
    prompts = make_prompts(encoder(args.model_dir), "profile", 200, 32)
    out: dict[str, Any] = {"limit_mb": weights_mb(args.model_dir) + args.budget_mb,
                           "max_tokens": args.profile_max_tokens}
    out["headroom"], used = _profile_window(args, prompts, [], spy=True)
    if not used:
        return out
    from bench.inprocess import InProcess

    engine = InProcess(args.model_dir)
    try:
        engine.run(prompts[:3], concurrency=1, max_tokens=args.profile_max_tokens, repetition=0, timeout_s=60)
        run = engine.run(prompts[3:3 + used], concurrency=1, max_tokens=args.profile_max_tokens,
                         repetition=0, timeout_s=args.profile_s * 2)
    finally:
        engine.close()
    out["inprocess"] = _gaps_ms(run.requests)
    out["headroom_disk_off"], _ = _profile_window(args, prompts, ["--prompt-cache-disk-bytes", "0"], spy=False)
    for key in ("headroom", "headroom_disk_off"):
        if "itl_mean_ms" in out[key] and "itl_mean_ms" in out["inprocess"]:
            out[key]["itl_mean_added_us"] = round((out[key]["itl_mean_ms"] - out["inprocess"]["itl_mean_ms"]) * 1e3, 1)
            out[key]["ttft_p50_added_ms"] = round(out[key]["ttft_p50_ms"] - out["inprocess"]["ttft_p50_ms"], 2)
    return out


def _spy_done(spy: subprocess.Popen[bytes] | None) -> str | None:
    """py-spy's last words (the sample count, or why it could not sample); never left running."""
    if spy is None:
        return None
    try:
        _, err = spy.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        spy.kill()
        _, err = spy.communicate()
    return err.decode(errors="replace")[-300:]


def _worker_report(url: str) -> dict[str, Any]:
    """The first worker's latest memory report in ``/v1/memory`` ({} when none)."""
    import urllib.request

    with urllib.request.urlopen(url + "/v1/memory", timeout=10) as resp:
        workers = json.loads(resp.read()).get("workers") or [{}]
    return dict(workers[0])


def _loop_of(url: str) -> dict[str, Any]:
    time.sleep(SNAPSHOT_SETTLE_S)  # the worker publishes its status every 0.25 s
    return dict(_worker_report(url).get("loop") or {})


# --- serve ------------------------------------------------------------------------------

def part_serve(args: argparse.Namespace) -> dict[str, Any]:
    limit_mb = weights_mb(args.model_dir) + args.budget_mb
    defaults = ["--concurrency", "1,8,32", "--prompt-tokens", "short,long", "--touch"]
    keep = Path(tempfile.mkdtemp(prefix="gpu-serve-logs-"))
    argv = [sys.executable, "-m", "bench", "serve", "--model", str(args.model_dir),
            "--json", str(args.out / "serve-bench.json"), "--keep-logs", str(keep),
            f"--headroom-arg=--memory-limit-mb={limit_mb}", f"--peer-memory-limit-mb={limit_mb}",
            *(args.serve_args or defaults)]
    log.info("serve: %s", " ".join(argv))
    started = time.monotonic()
    with open(args.out / "serve.txt", "w") as table, open(args.out / "logs.txt", "a") as logs:
        logs.write("\n===== serve (bench progress) =====\n")
        logs.flush()
        proc = subprocess.run(argv, cwd=ROOT, stdout=table, stderr=logs, timeout=args.part_timeout_s)
    print((args.out / "serve.txt").read_text())
    # Headroom's own log (the router's and worker's lines): why a request failed is there.
    for path in sorted(keep.glob("*/headroom*.log")):
        append_log(args.out, f"serve {path.name}", path)
    return {"returncode": proc.returncode, "limit_mb": limit_mb, "argv": argv,
            "wall_s": round(time.monotonic() - started, 2)}


def _run_within(args: argparse.Namespace, title: str, argv: list[str], stdout: Path) -> subprocess.Popen[bytes]:
    """``argv`` with its output in ``stdout`` and its log in ``logs.txt`` (both written as
    it goes), stopped (``_stop_bench``) at ``--part-timeout-s``."""
    with open(stdout, "w") as out, open(args.out / "logs.txt", "a") as logs:
        logs.write(f"\n===== {title} =====\n")
        logs.flush()
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=logs)
        try:
            proc.wait(args.part_timeout_s)
        except subprocess.TimeoutExpired:
            _stop_bench(proc)
    return proc


def _stop_bench(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM first (the bench then stops its servers), SIGKILL if it has not gone in 30 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def part_agents(args: argparse.Namespace) -> dict[str, Any]:
    """`python -m bench agents` on the GPU model; its own defaults are the issue's sizes."""
    limit_mb = weights_mb(args.model_dir) + args.budget_mb
    keep = Path(tempfile.mkdtemp(prefix="gpu-agents-logs-"))
    argv = [sys.executable, "-m", "bench", "agents", "--model", str(args.model_dir),
            "--json", str(args.out / "agents-bench.json"), "--keep-logs", str(keep),
            f"--headroom-arg=--memory-limit-mb={limit_mb}", f"--peer-memory-limit-mb={limit_mb}",
            *args.serve_args]
    log.info("agents: %s", " ".join(argv))
    started = time.monotonic()
    proc = _run_within(args, "agents (bench progress)", argv, args.out / "agents.txt")
    print((args.out / "agents.txt").read_text())
    for path in sorted(keep.glob("*/headroom*.log")):
        append_log(args.out, f"agents {path.name}", path)
    return {"returncode": proc.returncode, "limit_mb": limit_mb, "argv": argv,
            "wall_s": round(time.monotonic() - started, 2)}


def part_cpuprofile(args: argparse.Namespace) -> dict[str, Any]:
    """``bench serve`` (default: long prompts at c = 32, every system, one repetition) with
    every thread's CPU time counted from the kernel from when the Headroom worker first
    serves (the starts and their kernel compiles left out), and that worker profiled by
    py-spy with ``--idle --native`` from then (a thread waiting on the device without
    the GIL looks idle to a Python profile): which process and thread burns the CPU per
    token, and in what (bench/cpusplit.py)."""
    from bench.cpusplit import ThreadClock, parse_raw, summary

    exe = _py_spy()
    if exe is None:  # the kernel's counts by thread still come
        log.warning("cpuprofile: py-spy is not installed (carry .whl/d with the install call): no worker profile")
    limit_mb = weights_mb(args.model_dir) + args.budget_mb
    keep = Path(tempfile.mkdtemp(prefix="gpu-cpuprofile-logs-"))
    defaults = ["--concurrency", "32", "--prompt-tokens", "long", "--repeats", "1", "--no-mixed", "--paired", "0"]
    argv = [sys.executable, "-m", "bench", "serve", "--model", str(args.model_dir),
            "--json", str(args.out / "cpuprofile-bench.json"), "--keep-logs", str(keep),
            f"--headroom-arg=--memory-limit-mb={limit_mb}", f"--peer-memory-limit-mb={limit_mb}",
            *(args.serve_args or defaults)]
    log.info("cpuprofile: %s", " ".join(argv))
    raw = args.out / "cpuprofile-worker.raw"
    clock, spy, spied = ThreadClock(), None, None
    started = time.monotonic()
    with open(args.out / "cpuprofile-serve.txt", "w") as table, open(args.out / "logs.txt", "a") as logs:
        logs.write("\n===== cpuprofile (bench progress) =====\n")
        logs.flush()
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=table, stderr=logs)
        seen: dict[int, float] = {}
        try:
            while proc.poll() is None and time.monotonic() - started < args.part_timeout_s:
                time.sleep(CPUPROFILE_LOOK_S)
                totals = clock.look(proc.pid)
                # Busy and serving: a worker's start (calibration, warm start) burns a core
                # too, in NVRTC's kernel compiles on a fresh machine (83 % of the samples of
                # the first profile, 2026-12-05, which started there).
                serving = _serving_pids(keep)
                busy = [pid for pid, cpu in totals.items() if clock.roles.get(pid) in ("worker", "standby")
                        and pid in serving and cpu - seen.get(pid, cpu) > CPUPROFILE_BUSY * CPUPROFILE_LOOK_S]
                seen = totals
                if spied is None and busy:  # the worker serves: count and profile from here
                    spied = busy[0]
                    clock.restart()
                if spy is None and spied is not None and exe is not None:
                    spy = subprocess.Popen([exe, "record", "--pid", str(spied), "--duration", str(round(args.profile_s)),
                                            "--rate", "50", "--idle", "--native", "--threads", "--format", "raw",
                                            "-o", str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        finally:
            if proc.poll() is None:
                _stop_bench(proc)
            spy_said = _spy_done(spy)
    names, profiles = parse_raw(raw.read_text(errors="replace").splitlines()) if raw.exists() else ({}, {})
    rows = clock.rows(names)
    busiest = [r["tid"] for r in rows if r["pid"] == spied][:4]
    report = "\n".join([
        (args.out / "cpuprofile-serve.txt").read_text(),
        "CPU seconds by thread over the run (kernel counts):",
        *(f"  {r['role']:<14} pid {r['pid']:>7} tid {r['tid']:>7} {r['thread'][:20]:<20} {r['comm'][:16]:<16} "
          f"{r['cpu_s']:>8.2f} s"
          for r in rows[:30]),
        f"py-spy on the worker (pid {spied}): {spy_said}",
        summary(profiles, names, busiest)])
    (args.out / "cpuprofile.txt").write_text(report)
    print(report[-12000:])
    for path in sorted(keep.glob("*/headroom*.log")):
        append_log(args.out, f"cpuprofile {path.name}", path)
    return {"returncode": proc.returncode, "limit_mb": limit_mb, "argv": argv, "worker_pid": spied,
            "threads": rows[:30], "wall_s": round(time.monotonic() - started, 2)}


_SERVING = re.compile(r"worker (\d+) \(incarnation \d+\) serving")


def _serving_pids(keep: Path) -> set[int]:
    """Workers that said they serve, in the kept Headroom logs under ``keep``."""
    pids: set[int] = set()
    for path in keep.glob("*/headroom*.log"):
        pids.update(int(m.group(1)) for m in _SERVING.finditer(path.read_text(errors="replace")))
    return pids


RUNNERS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "info": part_info, "build": part_build, "shape": part_shape, "runtime": part_runtime, "ttft": part_ttft,
    "faults": part_faults,
    "split": part_split, "memory": part_memory,
    "profile": part_profile, "serve": part_serve, "agents": part_agents, "cpuprofile": part_cpuprofile}


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("parts", nargs="+", choices=PARTS, metavar="PART", help=", ".join(PARTS))
    p.add_argument("--model-dir", type=Path, default=Path("/root/gpumodel"))
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")))
    p.add_argument("--tiny", action="store_true", help="build: the tiny shape (a CPU check)")
    p.add_argument("--budget-mb", type=int, default=16384, help="ttft, serve, agents: limit = weights + this")
    p.add_argument("--tight-budget-mb", type=int, default=3072, help="memory: limit = weights + this")
    p.add_argument("--tight-over", choices=("weights", "runtime"), default="weights",
                   help="memory: 'runtime' makes --tight-budget-mb the worker's budget: a first router "
                        "measures the runtime baseline, then limit = weights + baseline + margin + this")
    p.add_argument("--tight-slack-mb", type=int, default=384,
                   help="memory, with --tight-over runtime: room for the runtime baseline's variation "
                        "between processes (the budget the worker got is in the result)")
    p.add_argument("--burst", type=int, default=32)
    p.add_argument("--burst-prompt-tokens", type=int, default=1000)
    p.add_argument("--burst-max-tokens", type=int, default=200)
    p.add_argument("--request-timeout-s", type=float, default=150.0, help="memory: per request")
    p.add_argument("--queue-timeout-s", type=float, default=120.0, help="memory: the router's --queue-timeout")
    p.add_argument("--snapshot-s", type=float, default=1.0, help="memory: /v1/memory every this often")
    p.add_argument("--max-tokens", type=int, default=16, help="ttft: output tokens per request")
    p.add_argument("--split-requests", type=int, default=40, help="split: requests one at a time")
    p.add_argument("--split-variants", default="debug,debug-nodisk,info,info-nodisk",
                   help="split: LEVEL[-nodisk],... one fresh router each")
    p.add_argument("--profile-s", type=float, default=30.0, help="profile: seconds of one-at-a-time requests")
    p.add_argument("--profile-max-tokens", type=int, default=128, help="profile: output tokens per request")
    p.add_argument("--shape-arg", action="append", default=[], metavar="ARG",
                   help="shape: an argument for bench.calshape (repeatable, e.g. --shape-arg=--contexts=0,4096)")
    p.add_argument("--probe-limit-mb", type=int, default=40000, help="info: the probe's --memory-limit-mb")
    p.add_argument("--runtime-arg", action="append", default=[], metavar="ARG",
                   help="runtime: an argument for bench.runtime (repeatable, e.g. --runtime-arg=--rows=8)")
    p.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="extra router flag for ttft and memory (repeat; e.g. --router-arg=--log-level=debug)")
    p.add_argument("--startup-timeout-s", type=float, default=240.0)
    p.add_argument("--part-timeout-s", type=float, default=540.0)
    return p


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    serve_args = raw[raw.index("--") + 1:] if "--" in raw else []
    args = make_parser().parse_args(raw[:raw.index("--")] if "--" in raw else raw)
    args.serve_args = serve_args
    logging.basicConfig(level="INFO", stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    failed = []
    for part in args.parts:
        started = time.monotonic()
        log.info("part %s: starting", part)
        try:
            doc = RUNNERS[part](args)
        except Exception as exc:  # noqa: BLE001 - one part failing must not lose the others' figures
            log.exception("part %s failed", part)
            doc = {"error": f"{type(exc).__name__}: {exc}"}
            failed.append(part)
        doc["part_s"] = round(time.monotonic() - started, 2)
        write(args.out, part, doc)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
