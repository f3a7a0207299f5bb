"""main() behind the mlx-router script: load config, set up logging, run the app."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from common.config import RouterConfig, check_addr, env_snapshot, explicit_config, load, permanent_exit
from common.curve import ServerKeys, load_server_keys
from common.errors import ConfigError, NoWorker
from common.log import config_error_line, setup_logging
from common.protocol import ExitCode
from router.fleet.models import build_catalog, check_pins
from router.ops import ipc

log = logging.getLogger("router")

# How often the drain loop looks at the in-flight count.
DRAIN_POLL_S = 0.1
# How long aiohttp waits for handlers once the drain is over (they only write an error).
SHUTDOWN_GRACE_S = 5.0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    env = env_snapshot()
    if args and args[0] == "service":
        from router.ops.service import run_command

        return run_command(args, env)
    if args and args[0] == "status":
        from router.ops import console

        return console.main(args[1:])
    if args and args[0] == "keys":
        from router.ops.keys import run_command as run_keys

        return run_keys(args[1:], env)
    from router.ops.access import BadHttpLogFilter, load_api_keys  # imports aiohttp

    try:
        cfg = load(RouterConfig, args, env, prog="mlx-router")
        config_file = explicit_config(args, env, "router")
        if config_file is not None and "MLX_WORKER_CONFIG" not in env:
            env = {**env, "MLX_WORKER_CONFIG": str(Path(config_file).expanduser().resolve())}
        api_keys = load_api_keys(cfg)
        link_keys = load_server_keys(cfg.curve_secret_key, cfg.curve_authorized_keys)
        addr = cfg.worker_addr or ipc.default_worker_addr(cfg.port, env)
        check_addr(addr, "--worker-addr")
        catalog = build_catalog(cfg.model, cfg.models_dir)  # a bad model list is a clear ConfigError here
        check_pins(catalog, cfg.pin)
        lock = ipc.lock_addr(addr)
    except ConfigError as exc:
        print(config_error_line("mlx-router", exc.message, args, env), file=sys.stderr)
        return permanent_exit(ExitCode.CONFIG_ERROR, args)  # as the worker: systemd will not restart it
    setup_logging(cfg.log_level, cfg.log_format, process="mlx-router", context={"model": ",".join(cfg.model) or cfg.models_dir or ""})
    logging.getLogger("aiohttp.server").addFilter(BadHttpLogFilter())
    stdin_is_terminal = sys.stdin is not None and sys.stdin.isatty()
    foreground = exits_on_permanent_failure(cfg, len(catalog), stdin_is_terminal)
    try:
        return asyncio.run(serve(cfg, addr, env, api_keys, link_keys, foreground))
    finally:
        if lock is not None:
            lock.close()


def exits_on_permanent_failure(cfg: RouterConfig, num_models: int, stdin_is_terminal: bool) -> bool:
    """Whether a worker that cannot start (ExitCode.PERMANENT: a wrong model path, a bad flag)
    ends the router: only in a terminal, with one model whose workers it spawns. There the
    person who typed the command reads the error at once; under launchd or systemd (no
    terminal), with several models or external workers, the router stays up for the others
    and /health says what failed."""
    return stdin_is_terminal and num_models == 1 and cfg.worker_mode == "spawn"


async def serve(cfg: RouterConfig, addr: str, env: dict[str, str], api_keys: list[str],
                link_keys: ServerKeys | None, foreground: bool = False) -> int:
    # Imported here: `mlx-router status` and `service` need neither aiohttp nor the tokenizer.
    from aiohttp import web

    from router.app import API, DISPATCHER, FLEET, STATE, make_app

    app = make_app(cfg, addr, env, api_keys=api_keys, link_keys=link_keys,
                   exits_on_permanent_failure=foreground)
    # After the drain, unfinished requests are answered with an error (below): what is left
    # for the handlers is writing it, well within this.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S,
                           keepalive_timeout=cfg.idle_timeout_s,
                           max_line_size=cfg.max_header_bytes, max_field_size=cfg.max_header_bytes)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port, reuse_address=True)
    try:
        await site.start()
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", cfg.host, cfg.port, exc)
        await runner.cleanup()
        return 1
    port = runner.addresses[0][1] if runner.addresses else cfg.port  # --port 0: the one given
    log.info("mlx-router listening on http://%s:%d (workers: %s, mode %s)", cfg.host, port,
             addr, cfg.worker_mode)
    stop = app[STATE].stop
    loop = asyncio.get_running_loop()
    # Signal handlers only set a flag or enqueue work; the loop does the rest.
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, app[FLEET].restart_all)
    await stop.wait()
    app[STATE].draining = True
    log.info("[shutdown] draining up to %.0fs (%d in flight)", cfg.drain_timeout_s,
             app[API].num_in_flight)
    deadline = loop.time() + cfg.drain_timeout_s
    while app[API].num_in_flight and loop.time() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    log.info("[shutdown] stopping (%d still in flight)", app[API].num_in_flight)
    if app[API].num_in_flight:
        # Past --drain-timeout: answered now, an error event and the stream's end, rather
        # than left to aiohttp's own wait (a minute, past a service manager's stop timeout).
        app[DISPATCHER].fail_all(NoWorker("the server is shutting down; retry shortly"))
    await runner.cleanup()
    return app[STATE].exit_code


if __name__ == "__main__":
    sys.exit(main())
