"""Restart and stop timing: ``python -m bench.restart [--root DIR] [--model M] [--idle-s S]``.

A router on the demo model (or ``--model``, with ``--router-arg`` flags; from the checkout
``--root``, default this one), then, after ``--idle-s`` (1 s) idle and once the worker's
standby has finished its imports (unless ``--no-wait-standby``), each: an operator
restart (``POST /admin/workers/restart``) and a SIGKILL of the worker, twice: seconds until
the old process is gone and until the new worker serves a completion (its first token),
that first request's time to first token against the median of the next three (a worker
that warmed its kernels before it said ready is as quick on its first), and the new worker's
start by phase from its log (from a standby or a new process; imports, weights, EOS ids,
calibration and boot, warm start); then a stop, and whether the router's log shows a kill
or a heartbeat warning. Two checkouts run back to back on one machine give the before
and after (an older checkout's log has no phases: they are left out).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.procs import free_port, pid_gone

ROOT = Path(__file__).resolve().parents[1]
READY_S = 120.0
# The worker's own account of its start (worker/__main__.py, worker/loader.py).
START_LINE = re.compile(r"mlx-worker\[(?P<pid>\d+)\].*start to ready in (?P<total>[\d.]+) s \((?P<how>[^)]*)\): "
                        r"imports (?P<imports>[\d.]+) s, model loaded in (?P<load>[\d.]+) s, "
                        r"calibration and boot (?P<boot>[\d.]+) s, warm start (?P<warm>[\d.]+) s")
# Beside the weights: the EOS ids (read from the folder's files, or its tokenizer loaded);
# a checkout before 2026-12-05 09:30 loaded the tokenizer always ("tokenizer N s").
LOAD_LINE = re.compile(r"mlx-worker\[(?P<pid>\d+)\].*loaded .*: weights (?P<weights>[\d.]+) s, "
                       r"(?:tokenizer (?P<tokenizer>[\d.]+) s|EOS .* from (?P<source>.+?) \((?P<eos>[\d.]+) s)")


def _wait(what: str, predicate: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.02)


def phases(lines: list[str], pid: int) -> dict[str, Any]:
    """Worker ``pid``'s start by phase, from its log lines (empty for an older checkout)."""
    out: dict[str, Any] = {}
    for line in lines:
        if f"mlx-worker[{pid}]" not in line:
            continue
        if m := START_LINE.search(line):
            out.update(start=m["how"], worker_ready_s=float(m["total"]), imports_s=float(m["imports"]),
                       load_s=float(m["load"]), boot_s=float(m["boot"]), warm_start_s=float(m["warm"]))
        elif m := LOAD_LINE.search(line):
            out.update(weights_s=float(m["weights"]), eos_s=float(m["eos"] or m["tokenizer"]),
                       eos_from=m["source"] or "its tokenizer")
    return out


def _wait_standby(health: Any, timeout_s: float = READY_S) -> float | None:
    """Until the worker's standby is there and done importing (its CPU time still for a
    second: it waits on its stdin); seconds waited, None if none came. A restart while the
    standby still imports measures the imports (on the H200's host ~14 s), not the restart."""
    import psutil

    started = time.monotonic()
    deadline = started + timeout_s
    while time.monotonic() < deadline:
        pid = health().get("workers", [{}])[0].get("standby_pid")
        if pid:
            try:
                proc = psutil.Process(pid)
                before = sum(proc.cpu_times()[:2])
                time.sleep(1.0)
                if sum(proc.cpu_times()[:2]) - before < 0.01:
                    return round(time.monotonic() - started, 2)
                continue
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.2)
    return None


def measure(root: Path, run_dir: Path, model: str = "demo", router_args: tuple[str, ...] = (),
            idle_s: float = 1.0, wait_standby: bool = True) -> dict[str, Any]:
    port = free_port()
    env = dict(os.environ, XDG_RUNTIME_DIR=str(run_dir), HF_HUB_OFFLINE="1", PYTHONPATH=str(root))
    log_path = run_dir / "router.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "router", "--model", model, "--port", str(port),
                                 "--api-key", "k", "--prompt-cache-dir", str(run_dir / "pc"), *router_args],
                                cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": "Bearer k"}, timeout=60)

    def health() -> dict[str, Any]:
        try:
            return dict(http.get("/health").json())
        except (httpx.HTTPError, ValueError):
            return {}

    try:
        _wait("healthy router", lambda: health().get("status") == "ok", READY_S)
        http.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4})
        rows = []
        for how in ("restart", "sigkill", "restart", "sigkill"):
            time.sleep(idle_s)
            standby_s = _wait_standby(health) if wait_standby else None
            old = health()["workers"][0]["pid"]
            started = time.monotonic()
            if how == "restart":
                http.post("/admin/workers/restart")
            else:
                os.kill(old, signal.SIGKILL)
            gone_s: list[float] = []

            def serving() -> bool:
                if not gone_s and pid_gone(old):
                    gone_s.append(time.monotonic() - started)
                h = health()
                return h.get("status") == "ok" and h["workers"][0]["pid"] != old

            _wait("restarted worker", serving, READY_S)
            status, first = _first_token_s(http, f"after {how} {len(rows)}")
            serving_s = time.monotonic() - started
            # A warmed worker's first request is as quick as its next ones
            warm = statistics.median(_first_token_s(http, f"warm {len(rows)} {i}")[1] for i in range(3))
            rows.append({"how": how, "standby_waited_s": standby_s,
                         "old_gone_s": round(gone_s[0], 3) if gone_s else None,
                         "serving_s": round(serving_s, 2), "status": status,
                         "first_ttft_s": round(first, 3), "warm_ttft_s": round(warm, 3),
                         "first_over_warm": round(first / warm, 2) if warm else None,
                         "pid": health()["workers"][0]["pid"]})
    finally:
        http.close()
        proc.terminate()
        proc.wait(30)
    lines = log_path.read_text(errors="replace").splitlines()
    for row in rows:
        row.update(phases(lines, row.pop("pid")))
    return {"root": str(root), "model": model, "restarts": rows,
            "kills_in_log": sum("killing worker" in line for line in lines),
            # A SIGKILLed worker is sent a heartbeat or two before its exit is seen: only
            # those after a restart or the stop would be a normal stop's.
            "heartbeat_warnings": [line for line in lines if "Host unreachable" in line]}


def _first_token_s(http: httpx.Client, prompt: str) -> tuple[int, float]:
    """A streamed completion's status and its time to first token (to its end if none)."""
    started = time.monotonic()
    with http.stream("POST", "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 4,
                                                       "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break
        return response.status_code, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.restart", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout whose router runs")
    p.add_argument("--model", default="demo", help="what the router serves (demo, a folder)")
    p.add_argument("--router-arg", action="append", default=[],
                   help="one more router flag, e.g. --router-arg=--memory-limit-mb=20797")
    p.add_argument("--idle-s", type=float, default=1.0, help="idle seconds before each restart")
    p.add_argument("--no-wait-standby", action="store_true",
                   help="restart without waiting for the standby to finish its imports")
    p.add_argument("--keep-log", type=Path, default=None, metavar="FILE",
                   help="copy the router's log (its worker's lines included) here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        try:
            print(json.dumps(measure(args.root.resolve(), Path(tmp), args.model, tuple(args.router_arg),
                                     args.idle_s, not args.no_wait_standby), indent=1))
        finally:
            if args.keep_log is not None and (Path(tmp) / "router.log").exists():
                shutil.copyfile(Path(tmp) / "router.log", args.keep_log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
