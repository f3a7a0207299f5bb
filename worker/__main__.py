"""main() behind the mlx-worker script: load config, load the model, serve."""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from common.config import WorkerConfig, env_snapshot, load, permanent_exit
from common.curve import load_client_keys
from common.errors import ConfigError
from common.log import setup_logging
from common.protocol import ExitCode

if TYPE_CHECKING:
    from worker.distributed import PeerWatch

log = logging.getLogger("worker")


def main(argv: Sequence[str] | None = None) -> int:
    env = env_snapshot()
    try:
        cfg = load(WorkerConfig, sys.argv[1:] if argv is None else argv, env, prog="mlx-worker")
        curve = load_client_keys(cfg.curve_server_key, cfg.curve_secret_key)
    except ConfigError as exc:
        print(f"mlx-worker: {exc.message}", file=sys.stderr)
        return permanent_exit(ExitCode.CONFIG_ERROR, sys.argv[1:] if argv is None else argv)
    incarnation = cfg.incarnation if cfg.incarnation is not None else secrets.randbits(62)
    setup_logging(cfg.log_level, cfg.log_format, process="mlx-worker",
                  context={"incarnation": incarnation, "model": cfg.model})

    from worker.requirements import too_old

    problems = too_old()
    if problems:
        print(f"mlx-worker: cannot start: {'; '.join(problems)}; install the versions "
              "pyproject.toml requires", file=sys.stderr)
        return permanent_exit(ExitCode.CONFIG_ERROR, (), cfg.service_manager)

    from worker.loader import LoadError, load_model  # imports mlx: after config is good

    try:
        loaded = load_model(cfg.model, env, trust_remote_code=cfg.trust_remote_code)
    except LoadError as exc:
        log.error("model failed to load: %s", exc)
        return permanent_exit(ExitCode.LOAD_ERROR, (), cfg.service_manager)

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

    from worker.boot import build_server, NotEnoughMemory

    try:
        server = build_server(cfg, loaded, incarnation, _cache_dir(env), curve, env, group=group)
    except NotEnoughMemory as exc:
        log.error("%s", exc)
        return permanent_exit(ExitCode.NO_MEMORY, (), cfg.service_manager)
    if cfg.parent_pipe:
        _watch_parent(server.on_parent_gone)
    code = server.run()
    if watch is not None:
        watch.stand_down()  # the followers' sockets close as they leave
        _stop_group(server.engine)
    _exit_now(code)
    return code  # not reached


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
