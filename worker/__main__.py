"""main() behind the mlx-worker script: load config, load the model, serve."""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from common.config import WorkerConfig, env_snapshot, load, permanent_exit
from common.curve import load_client_keys
from common.errors import ConfigError
from common.log import config_error_line, setup_logging
from common.protocol import ExitCode

if TYPE_CHECKING:
    from worker.distributed import PeerWatch

log = logging.getLogger("worker")

# First argument of a standby (worker/standby.py): imports done, it waits on stdin for its
# arguments. The router's supervisor spawns it; people never need it.
STANDBY_FLAG = "--standby"


def main(argv: Sequence[str] | None = None, *, started_at: float | None = None,
         standby: bool = False) -> int:
    """``started_at`` (wall clock) and ``standby``: when and how this start began, if not
    with this process (``worker/standby.py`` calls main once told to go)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == [STANDBY_FLAG]:
        from worker.standby import stand_by

        told = stand_by()
        return 0 if told is None else main(told[0], started_at=told[1], standby=True)
    clock = StartClock(started_at if started_at is not None else _process_started_at(), standby)
    env = env_snapshot()
    try:
        cfg = load(WorkerConfig, args, env, prog="mlx-worker")
        curve = load_client_keys(cfg.curve_server_key, cfg.curve_secret_key)
    except ConfigError as exc:
        print(config_error_line("mlx-worker", exc.message, args, env), file=sys.stderr)
        return permanent_exit(ExitCode.CONFIG_ERROR, args)
    incarnation = cfg.incarnation if cfg.incarnation is not None else secrets.randbits(62)
    setup_logging(cfg.log_level, cfg.log_format, process="mlx-worker",
                  context={"incarnation": incarnation, "model": cfg.model})

    from worker.requirements import too_old

    problems = too_old()
    if problems:
        print(f"mlx-worker: cannot start: {'; '.join(problems)}; install the versions "
              "pyproject.toml requires", file=sys.stderr)
        return permanent_exit(ExitCode.CONFIG_ERROR, (), cfg.service_manager)

    # mlx, mlx-lm and transformers: after config is good (a standby has them already).
    from worker.boot import NotEnoughMemory, build_server
    from worker.loader import LoadError, load_model

    clock.mark("imports")
    try:
        loaded = load_model(cfg.model, env, trust_remote_code=cfg.trust_remote_code)
    except LoadError as exc:
        log.error("model failed to load: %s", exc)
        return permanent_exit(ExitCode.LOAD_ERROR, (), cfg.service_manager)
    clock.mark("load")

    group = None
    watch: PeerWatch | None = None
    if cfg.distributed:
        from worker.distributed import join, run_follower

        # Each rank would keep its own slice of every entry: not built yet.
        cfg = dataclasses.replace(cfg, no_prompt_cache=True)
        group, watch = join(cfg.distributed, cfg.rank, loaded.model)
        if group.rank() != 0:
            code = run_follower(group, loaded)
            watch.stand_down()  # rank 0 stopped the group (or is gone): its sockets close
            return code

    try:
        server = build_server(cfg, loaded, incarnation, _cache_dir(env), curve, env, group=group)
    except NotEnoughMemory as exc:
        log.error("%s", exc)
        return permanent_exit(ExitCode.NO_MEMORY, (), cfg.service_manager)
    clock.mark("boot")
    log.info("%s", clock.summary(server.core.memory.warmup_s or 0.0))
    if cfg.parent_pipe:
        _watch_parent(server.on_parent_gone)
    try:
        code = server.run()
    except Exception:
        # A bug outside a step (a step's own errors end in ENGINE_ERROR inside run). Exit
        # now: the interpreter's teardown, with MLX's and the disk writer's threads alive,
        # can crash (SIGSEGV) and hide this traceback's cause from the router's log.
        log.critical("the worker's loop failed", exc_info=True)
        _exit_now(ExitCode.ENGINE_ERROR)
    if watch is not None:
        watch.stand_down()  # the followers' sockets close as they leave
        _stop_group(server.engine)
    _exit_now(code)
    return code  # not reached


class StartClock:
    """A start's seconds by phase, for one log line: what a restart costs, and where."""

    def __init__(self, started_at: float, standby: bool) -> None:
        self.started_at = started_at          # wall clock: the process's creation, or the go
        self.standby = standby
        self.phases: dict[str, float] = {}
        self._last = started_at

    def mark(self, phase: str) -> None:
        now = time.time()
        self.phases[phase] = max(0.0, now - self._last)
        self._last = now

    def summary(self, warmup_s: float) -> str:
        p = self.phases
        return (f"start to ready in {self._last - self.started_at:.2f} s "
                f"({'from a standby, told to go' if self.standby else 'from a new process'}): "
                f"imports {p.get('imports', 0.0):.2f} s, model loaded in {p.get('load', 0.0):.2f} s, "
                f"calibration and boot {max(0.0, p.get('boot', 0.0) - warmup_s):.2f} s, "
                f"warm start {warmup_s:.2f} s")


def _process_started_at() -> float:
    """This process's creation (wall clock): the interpreter's own start counts as imports."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - a figure for the log only
        return time.time()


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown: everything owed to others is done (the
    router told, queued writes bounded, sockets closed); freeing the model's arrays one by
    one, and the device's context, is work the kernel does at once when the process ends."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _stop_group(engine: object) -> None:
    """Rank 0 leaves: the followers exit too (a group whose peer is gone cannot step)."""
    try:
        engine.finish()  # type: ignore[attr-defined]
    except RuntimeError as exc:  # a follower already gone
        log.warning("could not stop the other ranks: %s", exc)


def _cache_dir(env: dict[str, str]) -> Path | None:
    from worker.demo import default_cache_root

    try:
        return default_cache_root(env)
    except ValueError:  # no HOME and no XDG_CACHE_HOME: calibrate every start
        return None


def _watch_parent(on_gone: object) -> None:
    """A spawned worker exits when its router's pipe closes: no orphan keeps the memory."""

    def watch() -> None:
        try:
            while os.read(sys.stdin.fileno(), 4096):
                pass
        except OSError:
            pass
        on_gone()  # type: ignore[operator]

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
