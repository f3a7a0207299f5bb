"""`serve`: start every system, warm it, run the workloads round-robin, summarize.

Fairness rules, and why:
- One run, one machine, one model folder for everyone: numbers from different runs are
  not comparable on a shared 2-core box.
- Round-robin per workload repetition, with the order rotated each time, so slow drift
  (thermal, a neighbour's job) spreads over all systems instead of landing on one.
- Every system gets the same prompts in a repetition; each prompt is unique (bench/prompts.py).
- All systems stay up for the whole run, idle while another is measured, so each one's
  idle cost is present in every measurement alike.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.metrics import (MixedRun, MixedSummary, RunResult, Summary, summarize,
                           summarize_mixed, workload_key)
from bench.paired import PairedSummary, run_paired, summarize_paired
from bench.prompts import PROMPT_TOKENS, make_prompts
from bench.systems import System, make_system

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeConfig:
    model: str = "demo"
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    num_requests: int | None = None     # per workload; None: max(32, 2 x concurrency)
    repeats: int = 2
    max_tokens: int = 64
    prompt_kinds: list[str] = field(default_factory=lambda: ["short"])
    mixed: bool = True
    paired: int = 32                    # prompts sent to every system back to back (0: none)
    mixed_long_tokens: int = 1024
    mixed_shorts: int = 8
    mixed_max_tokens: int = 16
    # After sending the long prompt, the short ones follow this much later: long enough
    # for every server to have tokenized it and begun its prefill.
    mixed_head_start_s: float = 0.3
    systems: list[str] = field(default_factory=lambda: ["headroom", "mlx_lm_server", "inprocess"])
    startup_timeout_s: float = 180.0
    workload_timeout_s: float = 300.0
    headroom_args: list[str] = field(default_factory=list)
    mlx_lm_args: list[str] = field(default_factory=list)
    peer_memory_limit_mb: int | None = None
    touch: bool = False
    command: str = ""
    log_dir: Path | None = None         # keep the servers' logs here (default: a temp dir, removed)


def requests_for(cfg: ServeConfig, concurrency: int) -> int:
    """Enough requests that every stream slot turns over at least once."""
    return cfg.num_requests if cfg.num_requests is not None else max(32, 2 * concurrency)


def resolve_model(name: str) -> tuple[str, Path, dict[str, Any]]:
    """(what headroom's --model gets, the folder everyone else loads, facts for the report)."""
    from worker.demo import default_cache_root, ensure_demo_model

    cache_root = default_cache_root(os.environ)
    if name == "demo":
        folder = ensure_demo_model(cache_root)
        return "demo", folder, {"name": "demo", "folder": str(folder)}
    if name == "bench-shaped":
        from bench.shaped import SHAPE, ensure_shaped_model, measure_decode_step_ms

        folder = ensure_shaped_model(cache_root)
        info = {"name": name, "folder": str(folder), "shape": SHAPE, "dtype": "float32",
                "decode_step_ms_batch8": measure_decode_step_ms(folder, batch=8),
                "decode_step_ms_batch1": measure_decode_step_ms(folder, batch=1)}
        return str(folder), folder, info
    folder = Path(name).expanduser()
    if not (folder / "config.json").is_file():
        raise SystemExit(f"--model {name!r}: not demo, bench-shaped or a local mlx-lm model folder")
    return str(folder), folder, {"name": "path", "folder": str(folder)}


def _machine() -> dict[str, Any]:
    import mlx.core as mx
    import mlx_lm

    return {"platform": platform.platform(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "mlx": getattr(mx, "__version__", "?"), "mlx_lm": getattr(mlx_lm, "__version__", "?"),
            "device": str(mx.default_device())}


def _git() -> dict[str, Any]:
    """The code under test: others edit router/worker/common while benchmarks run."""
    import subprocess

    from bench.procs import ROOT

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    dirty = git("status", "--porcelain", "--", "router", "worker", "common")
    return {"commit": git("rev-parse", "HEAD"), "dirty_files": dirty.splitlines()}


def _warm(system: System, encode: Any, cfg: ServeConfig) -> dict[str, Any]:
    """A first workload per system, discarded: model load, kernel setup, lazy imports."""
    num = max(2, max(cfg.concurrency))
    prompts = make_prompts(encode, f"warm-{system.name}", num, PROMPT_TOKENS[cfg.prompt_kinds[0]])
    run = system.run(prompts, concurrency=max(cfg.concurrency), max_tokens=cfg.max_tokens,
                     repetition=-1, timeout_s=cfg.workload_timeout_s)
    errors = [r.error for r in run.requests if not r.ok]
    if errors:
        log.warning("%s warm-up: %d of %d requests failed, e.g. %s", system.name, len(errors),
                    len(run.requests), errors[0])
    return {"requests": len(run.requests), "errors": len(errors), "wall_s": run.wall_s,
            "error_samples": sorted(set(e or "" for e in errors))[:3]}


def _paired(systems: list[System], encode: Any, cfg: ServeConfig) -> dict[str, PairedSummary]:
    """Short prompts at c=1, each sent to every system back to back (bench/paired.py)."""
    if cfg.paired <= 0:
        return {}
    prompts = make_prompts(encode, "p", cfg.paired, PROMPT_TOKENS["short"])
    results = run_paired(systems, prompts, cfg.max_tokens, cfg.workload_timeout_s)
    summaries = summarize_paired(results, cfg.max_tokens)
    for s in summaries.values():
        log.info("paired %-14s TTFT p50 %.2f ms, added %s ms, %d/%d ok", s.system, s.ttft_p50_ms,
                 "-" if s.added_ttft_ms is None else f"{s.added_ttft_ms:.2f}",
                 s.requests - s.errors, s.requests)
    return summaries


def _touch(system: System, encode: Any, cfg: ServeConfig) -> int:
    """One tiny request right before a measured workload; returns worker restarts it saw.

    Round-robin leaves each system idle while the others are measured. Headroom's router
    (as of this writing) takes a worker whose first step after >= 10 s idle outlasts a
    heartbeat for "wedged" and kills it (see bench/README.md); a touch takes that hit, if
    any, outside the measurement. Every system is touched alike.
    """
    before = system.worker_restarts()
    prompts = make_prompts(encode, f"touch-{system.name}-{time.monotonic_ns()}", 1, 8)
    run = system.run(prompts, concurrency=1, max_tokens=2, repetition=-2,
                     timeout_s=cfg.workload_timeout_s)
    if not all(r.ok for r in run.requests):
        log.warning("%s touch failed: %s", system.name, run.requests[0].error)
    return system.worker_restarts() - before


@dataclass(slots=True)
class Measured:
    runs: dict[tuple[str, str], list[RunResult]] = field(default_factory=dict)
    mixed: dict[str, list[MixedRun]] = field(default_factory=dict)
    touches: dict[str, int] = field(default_factory=dict)  # worker restarts seen by touches


def _rotated(systems: list[System], turn: int) -> list[System]:
    shift = turn % len(systems)
    return systems[shift:] + systems[:shift]


def _measure(systems: list[System], encode: Any, cfg: ServeConfig) -> Measured:
    """Every workload of every repetition on every system, in rotated order."""
    out = Measured()
    turn = 0
    for rep in range(cfg.repeats):
        for kind in cfg.prompt_kinds:
            for c in cfg.concurrency:
                prompts = make_prompts(encode, f"r{rep}{kind[0]}{c}", requests_for(cfg, c),
                                       PROMPT_TOKENS[kind])
                for system in _rotated(systems, turn):
                    run = _one_workload(system, encode, cfg, prompts, c, rep, out.touches)
                    run.prompt_kind = kind
                    out.runs.setdefault((system.name, workload_key(kind, c)), []).append(run)
                turn += 1
        if cfg.mixed:
            long_prompt = make_prompts(encode, f"r{rep}L", 1, cfg.mixed_long_tokens)[0]
            shorts = make_prompts(encode, f"r{rep}s", cfg.mixed_shorts, PROMPT_TOKENS["short"])
            for system in _rotated(systems, turn):
                out.mixed.setdefault(system.name, []).append(
                    _one_mixed(system, encode, cfg, long_prompt, shorts, rep, out.touches))
            turn += 1
    return out


def _one_workload(system: System, encode: Any, cfg: ServeConfig, prompts: list[Any], c: int,
                  rep: int, touches: dict[str, int]) -> RunResult:
    if cfg.touch:
        touches[system.name] = touches.get(system.name, 0) + _touch(system, encode, cfg)
    restarts, cpu_s = system.worker_restarts(), system.cpu_s()
    parts = system.cpu_parts() if hasattr(system, "cpu_parts") else {}
    run = system.run(prompts, concurrency=c, max_tokens=cfg.max_tokens, repetition=rep,
                     timeout_s=cfg.workload_timeout_s)
    run.cpu_s = system.cpu_s() - cpu_s
    if parts:
        run.cpu_parts_s = {role: s - parts.get(role, 0.0) for role, s in system.cpu_parts().items()}
    run.worker_restarts = system.worker_restarts() - restarts
    log.info("rep %d c=%d %-14s %6.1f tok/s  %d/%d ok", rep, c, system.name,
             sum(r.completion_tokens for r in run.requests if r.ok) / max(run.wall_s, 1e-9),
             sum(r.ok for r in run.requests), len(run.requests))
    return run


def _one_mixed(system: System, encode: Any, cfg: ServeConfig, long_prompt: Any,
               shorts: list[Any], rep: int, touches: dict[str, int]) -> MixedRun:
    if cfg.touch:
        touches[system.name] = touches.get(system.name, 0) + _touch(system, encode, cfg)
    restarts = system.worker_restarts()
    run = system.run_mixed(long_prompt, shorts, max_tokens=cfg.mixed_max_tokens,
                           head_start_s=cfg.mixed_head_start_s, repetition=rep,
                           timeout_s=cfg.workload_timeout_s)
    run.worker_restarts = system.worker_restarts() - restarts
    ttfts = sorted(r.ttft_s for r in run.shorts if r.ttft_s is not None)
    log.info("rep %d mixed %-14s long TTFT %s s, short TTFT max %s s, %d/%d ok", rep, system.name,
             f"{run.long.ttft_s:.2f}" if run.long.ttft_s is not None else "-",
             f"{ttfts[-1]:.2f}" if ttfts else "-",
             sum(r.ok for r in [run.long, *run.shorts]), len(run.shorts) + 1)
    return run


def run_serve(cfg: ServeConfig) -> dict[str, Any]:
    """Run everything; returns the report document (see bench/report.py)."""
    from mlx_lm.utils import load_tokenizer

    from bench import report

    model_arg, folder, model_info = resolve_model(cfg.model)
    encode = load_tokenizer(folder).encode
    if cfg.log_dir is not None:
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="headroom-bench-", dir=cfg.log_dir))  # 0700: fine as XDG_RUNTIME_DIR
    log.info("server logs in %s (%s)", run_dir, "kept" if cfg.log_dir else "removed after a clean run")
    warmup: dict[str, Any] = {}
    load_before = os.getloadavg()
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        systems: list[System] = []
        for name in cfg.systems:
            system = make_system(name, model_arg=model_arg, folder=folder, run_dir=run_dir,
                                 max_tokens=cfg.max_tokens, headroom_args=cfg.headroom_args,
                                 mlx_lm_args=cfg.mlx_lm_args,
                                 peer_memory_limit_mb=cfg.peer_memory_limit_mb)
            stack.callback(system.stop)  # registered before start: stopped even if start fails
            system.start(cfg.startup_timeout_s)
            systems.append(system)
        for system in systems:
            warmup[system.name] = _warm(system, encode, cfg)
        paired = _paired(systems, encode, cfg)
        measured = _measure(systems, encode, cfg)
        described = {s.name: s.describe() for s in systems}
    # Reached only without an exception: keep the server logs when something failed.
    if cfg.log_dir is None:
        shutil.rmtree(run_dir, ignore_errors=True)
    summaries: dict[str, dict[str, Summary]] = {}
    for (name, key), rs in measured.runs.items():
        summaries.setdefault(name, {})[key] = summarize(rs)
    mixed: dict[str, MixedSummary] = {name: summarize_mixed(rs) for name, rs in measured.mixed.items()}
    meta = {"command": cfg.command, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": _machine(), "git": _git(), "model": model_info, "max_tokens": cfg.max_tokens,
            "prompt_tokens": {k: PROMPT_TOKENS[k] for k in cfg.prompt_kinds},
            "requests": {str(c): requests_for(cfg, c) for c in cfg.concurrency},
            "paired_requests": cfg.paired,
            "repeats": cfg.repeats, "concurrency": cfg.concurrency,
            "mixed": {"long_prompt_tokens": cfg.mixed_long_tokens, "shorts": cfg.mixed_shorts,
                      "short_prompt_tokens": PROMPT_TOKENS["short"],
                      "max_tokens": cfg.mixed_max_tokens, "head_start_s": cfg.mixed_head_start_s}
            if cfg.mixed else None,
            "systems": described, "touch": cfg.touch,
            "worker_restarts_during_touches": measured.touches,
            "duration_s": round(time.monotonic() - started, 1),
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "argv": sys.argv}
    return report.build(meta, summaries, mixed, warmup, paired)
