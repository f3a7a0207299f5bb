"""The three systems under test behind one interface: start, run a workload, stop.

- headroom:      `python -m router` (it spawns and supervises its worker), `ignore_eos: true`.
- mlx_lm_server: `python -m mlx_lm.server`, batching flags set to Headroom's worker
                 defaults. It has no way to suppress EOS short of a logit_bias, which
                 would switch its decode to the per-row logits-processor path and make it
                 slower than as shipped; so it runs as shipped, and the client checks every
                 request's usage.completion_tokens == max_tokens instead.
- inprocess:     mlx-lm's BatchGenerator in this process (bench/inprocess.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Protocol

from bench.client import run_mixed, run_workload
from bench.cpusplit import role as process_role
from bench.inprocess import MAX_BATCH_SIZE, PREFILL_BATCH_SIZE, PREFILL_STEP_SIZE, InProcess
from bench.metrics import MixedRun, RunResult
from bench.procs import ServerProcess, free_port, server_env
from bench.prompts import Prompt

log = logging.getLogger(__name__)

SYSTEMS: tuple[str, ...] = ("headroom", "mlx_lm_server", "inprocess")


class System(Protocol):
    name: str

    def start(self, timeout_s: float) -> None: ...

    def run(self, prompts: list[Prompt], *, concurrency: int, max_tokens: int, repetition: int,
            timeout_s: float) -> RunResult: ...

    def run_mixed(self, long_prompt: Prompt, shorts: list[Prompt], *, max_tokens: int,
                  head_start_s: float, repetition: int, timeout_s: float) -> MixedRun: ...

    def describe(self) -> dict[str, Any]: ...

    def worker_restarts(self) -> int:
        """Restarts of a supervised worker so far (0 for systems without one)."""
        ...

    def cpu_s(self) -> float:
        """CPU seconds (user + system) its processes have used so far."""
        ...

    def stop(self) -> None: ...


class HttpSystem:
    """A server subprocess on a free loopback port, driven by bench/client.py."""

    def __init__(self, name: str, argv_tail: list[str], run_dir: Path,
                 extra_body: dict[str, Any]) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra_body = extra_body
        argv = [sys.executable, *argv_tail, "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = ServerProcess(name, argv, server_env(run_dir), run_dir / f"{name}.log",
                                  self.url + "/health")
        self.startup_s: float | None = None

    def start(self, timeout_s: float) -> None:
        self.proc.start()
        self.startup_s = self.proc.wait_healthy(timeout_s)

    def run(self, prompts: list[Prompt], *, concurrency: int, max_tokens: int, repetition: int,
            timeout_s: float) -> RunResult:
        async def bounded() -> RunResult:
            # The per-request timeout bounds each request; this bounds the workload.
            async with asyncio.timeout(timeout_s):
                return await run_workload(self.url, self.name, prompts, concurrency=concurrency,
                                          max_tokens=max_tokens, extra_body=self.extra_body,
                                          repetition=repetition, request_timeout_s=timeout_s)
        return asyncio.run(bounded())

    def run_mixed(self, long_prompt: Prompt, shorts: list[Prompt], *, max_tokens: int,
                  head_start_s: float, repetition: int, timeout_s: float) -> MixedRun:
        async def bounded() -> MixedRun:
            async with asyncio.timeout(timeout_s):
                return await run_mixed(self.url, self.name, long_prompt, shorts,
                                       max_tokens=max_tokens, head_start_s=head_start_s,
                                       extra_body=self.extra_body, repetition=repetition,
                                       request_timeout_s=timeout_s)
        return asyncio.run(bounded())

    def describe(self) -> dict[str, Any]:
        return {"argv": self.proc.argv, "request_extra": self.extra_body,
                "startup_s": self.startup_s, "log": str(self.proc.log_path)}

    def worker_restarts(self) -> int:
        return 0

    def cpu_s(self) -> float:
        """The server and its children (Headroom's worker is the router's child)."""
        return sum(self.cpu_parts().values())

    def cpu_parts(self) -> dict[str, float]:
        """CPU seconds so far by role: the server process, its workers and standbys, others.

        Which process burns the CPU is the first question when a system's CPU per token is
        high. A process that exits in a workload (a restarted worker) takes its CPU with it.
        """
        import psutil

        assert self.proc.popen is not None
        parts: dict[str, float] = {}
        try:
            root = psutil.Process(self.proc.popen.pid)
            for p in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    t = p.cpu_times()
                    role = "server" if p.pid == root.pid else process_role(p.cmdline())
                    parts[role] = parts.get(role, 0.0) + t.user + t.system
        except psutil.NoSuchProcess:
            pass
        return parts

    def stop(self) -> None:
        code = self.proc.stop()
        log.info("stopped %s (exit %s)", self.name, code)


class Headroom(HttpSystem):
    def __init__(self, model_arg: str, run_dir: Path, extra_args: list[str]) -> None:
        # The disk tier in the run's own folder: never the user's cache, never an earlier run's.
        super().__init__("headroom", ["-m", "router", "--model", model_arg,
                                      "--prompt-cache-dir", str(run_dir / "prompt-cache"), *extra_args], run_dir,
                         {"ignore_eos": True})
        self.worker_pid: int | None = None

    def start(self, timeout_s: float) -> None:
        super().start(timeout_s)
        # Remember the worker: it runs in its own session, out of killpg's reach.
        self.worker_pid = self._worker().get("pid")
        if self.worker_pid is None:
            log.warning("could not read the headroom worker's pid from /health")

    def _worker(self) -> dict[str, Any]:
        """The worker's entry in /health ({} when it cannot be read)."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5.0) as resp:
                worker = json.loads(resp.read())["workers"][0]
            return worker if isinstance(worker, dict) else {}
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return {}

    def worker_restarts(self) -> int:
        """A restart during a workload is invisible to the client when the router retries
        the requests that had produced nothing; /health counts it."""
        worker = self._worker()
        if isinstance(worker.get("pid"), int):
            self.worker_pid = worker["pid"]  # a restarted worker has a new pid; stop() needs it
        restarts = worker.get("restarts", 0)
        return restarts if isinstance(restarts, int) else 0

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "worker_pid": self.worker_pid}

    def stop(self) -> None:
        super().stop()  # the router stops its worker on SIGTERM
        if self.worker_pid is not None:
            _stop_pid(self.worker_pid, "worker")


class MlxLmServer(HttpSystem):
    def __init__(self, folder: Path, run_dir: Path, max_tokens: int, extra_args: list[str]) -> None:
        # Batching as Headroom's worker does it. --prompt-cache-size 0: our prompts are
        # unique, so its prefix cache can only "hit" on a few shared leading tokens (a BOS,
        # a tag), which it serves by deep-copying a whole cached KV and trimming it; that
        # measures its cache, not its serving path, and no other system has one.
        flags = ["--model", str(folder), "--max-tokens", str(max_tokens),
                 "--decode-concurrency", str(MAX_BATCH_SIZE),
                 "--prompt-concurrency", str(PREFILL_BATCH_SIZE),
                 "--prefill-step-size", str(PREFILL_STEP_SIZE), "--prompt-cache-size", "0",
                 *extra_args]
        # "default_model" selects the --model folder; any other name is loaded as a repo.
        super().__init__("mlx_lm_server", ["-m", "mlx_lm.server", *flags], run_dir,
                         {"model": "default_model"})


def bound_mlx_memory(limit_mb: int | None) -> None:
    """Bound the MLX of this process (the in-process peers run here): at most ``limit_mb``
    in use, and a buffer cache of at most a quarter of it. On a shared GPU an unbounded
    in-process peer kept what it had freed in MLX's buffer cache until the card was full
    (the H200 on 2026-12-05: 6 GB left free, and Headroom's worker beside it hit real
    out-of-memory errors under its own 20 GB limit)."""
    import mlx.core as mx

    if limit_mb:
        mx.set_memory_limit(limit_mb << 20)
        mx.set_cache_limit((limit_mb << 20) // 4)


def release_mlx_memory() -> None:
    """Give what an in-process peer freed back to the device before the next system runs."""
    import gc

    import mlx.core as mx

    gc.collect()
    mx.clear_cache()


class InProcessSystem:
    name = "inprocess"

    def __init__(self, folder: Path, memory_limit_mb: int | None = None) -> None:
        self.folder = folder
        self.memory_limit_mb = memory_limit_mb
        self.engine: InProcess | None = None
        self.startup_s: float | None = None

    def start(self, timeout_s: float) -> None:
        started = time.monotonic()
        bound_mlx_memory(self.memory_limit_mb)
        self.engine = InProcess(self.folder)
        self.startup_s = time.monotonic() - started

    def run(self, prompts: list[Prompt], *, concurrency: int, max_tokens: int, repetition: int,
            timeout_s: float) -> RunResult:
        assert self.engine is not None
        return self.engine.run(prompts, concurrency=concurrency, max_tokens=max_tokens,
                               repetition=repetition, timeout_s=timeout_s)

    def run_mixed(self, long_prompt: Prompt, shorts: list[Prompt], *, max_tokens: int,
                  head_start_s: float, repetition: int, timeout_s: float) -> MixedRun:
        assert self.engine is not None
        return self.engine.run_mixed(long_prompt, shorts, max_tokens=max_tokens,
                                     head_start_s=head_start_s, repetition=repetition,
                                     timeout_s=timeout_s)

    def describe(self) -> dict[str, Any]:
        return {"batch_generator": {"completion_batch_size": MAX_BATCH_SIZE,
                                    "prefill_batch_size": PREFILL_BATCH_SIZE,
                                    "prefill_step_size": PREFILL_STEP_SIZE, "stop_tokens": None},
                "startup_s": self.startup_s}

    def worker_restarts(self) -> int:
        return 0

    def cpu_s(self) -> float:
        # This process: while the in-process system runs, nothing else here does work.
        return time.process_time()

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        release_mlx_memory()


def make_system(name: str, *, model_arg: str, folder: Path, run_dir: Path, max_tokens: int,
                headroom_args: list[str], mlx_lm_args: list[str],
                peer_memory_limit_mb: int | None = None) -> System:
    if name == "headroom":
        return Headroom(model_arg, run_dir, headroom_args)
    if name == "mlx_lm_server":
        return MlxLmServer(folder, run_dir, max_tokens, mlx_lm_args)
    if name == "inprocess":
        return InProcessSystem(folder, peer_memory_limit_mb)
    raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")


def _stop_pid(pid: int, must_contain: str) -> None:
    """TERM, then KILL, one process by id, if it is still the process we think it is."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if not any(must_contain in part for part in proc.cmdline()):
            return  # exited and the id was reused: not ours
        proc.terminate()
        _, alive = psutil.wait_procs([proc], timeout=10.0)
        if alive:
            log.warning("%s %d ignored SIGTERM; killing it", must_contain, pid)
            proc.kill()
            psutil.wait_procs([proc], timeout=5.0)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return  # already gone
