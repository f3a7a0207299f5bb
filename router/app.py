"""Composition root: build the router's parts from its config and wire them together."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from aiohttp import web

from common.config import RouterConfig
from router.api import Api, error_middleware
from router.backlog import Backlog
from router.dispatch import Dispatcher
from router.reqid import RequestIds, add_header
from router.status import Metrics, StatusViews
from router.supervisor import SpawnSpec, Supervisor

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RouterState:
    """Facts learned while running (never written back into the config)."""

    draining: bool = False
    extra: dict[str, object] = field(default_factory=dict)


CONFIG = web.AppKey("config", RouterConfig)
STATE = web.AppKey("state", RouterState)
DISPATCHER = web.AppKey("dispatcher", Dispatcher)
SUPERVISOR = web.AppKey("supervisor", Supervisor)
API = web.AppKey("api", Api)
VIEWS = web.AppKey("views", StatusViews)


def worker_argv(cfg: RouterConfig, addr: str) -> list[str]:
    argv = [sys.executable, "-m", "worker", "--model", cfg.model, "--router", addr,
            "--parent-pipe", "--log-level", cfg.log_level, "--log-format", cfg.log_format]
    if cfg.memory_limit_mb is not None:
        argv += ["--memory-limit-mb", str(cfg.memory_limit_mb)]
    if cfg.max_running_requests is not None:
        argv += ["--max-running-requests", str(cfg.max_running_requests)]
    if cfg.oom_guard is not None:
        argv += ["--oom-guard", cfg.oom_guard]
    if cfg.unsafe_no_admission:
        argv.append("--unsafe-no-admission")
    return argv + list(cfg.worker_arg)


def make_app(cfg: RouterConfig, addr: str, env: Mapping[str, str]) -> web.Application:
    # The request id is outermost, so even an error response and its log line carry it.
    app = web.Application(middlewares=[RequestIds().middleware, error_middleware],
                          client_max_size=cfg.max_body_bytes)
    app.on_response_prepare.append(add_header)
    state = RouterState()
    metrics = Metrics()
    dispatcher = Dispatcher(addr, Backlog(cfg.max_queue), metrics)
    spawn = SpawnSpec(worker_argv(cfg, addr), dict(env)) if cfg.worker_mode == "spawn" else None
    supervisor = Supervisor(dispatcher, spawn, metrics)
    api = Api(dispatcher=dispatcher, metrics=metrics, model_id=cfg.model,
              default_max_tokens=cfg.default_max_tokens, max_n=cfg.max_n,
              tool_parser=cfg.tool_parser,
              queue_timeout_s=cfg.queue_timeout_s,
              api_key=cfg.api_key, is_draining=lambda: state.draining)
    dispatcher.hello_listeners.append(api.preload_tokenizer)
    views = StatusViews(dispatcher, supervisor, metrics, cfg.model, lambda: state.draining,
                        lambda: api.tokenizer_ready)
    app[CONFIG], app[STATE], app[DISPATCHER], app[SUPERVISOR], app[API], app[VIEWS] = (
        cfg, state, dispatcher, supervisor, api, views)

    async def admin_restart(request: web.Request) -> web.Response:
        api.check_auth(request)
        supervisor.restart_now()
        return web.json_response({"status": "restarting", "workers": [supervisor.describe()]})

    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/health", views.health)
    app.router.add_get("/v1/memory", views.memory)
    app.router.add_get("/metrics", views.metrics_text)
    app.router.add_get("/", views.page)
    app.router.add_get("/static/{name}", views.static)
    app.router.add_get("/status", views.status)
    app.router.add_post("/admin/workers/restart", admin_restart)
    app.cleanup_ctx.append(_background)
    return app


async def _background(app: web.Application) -> AsyncIterator[None]:
    """Start the dispatcher and supervisor with the app; stop them after it."""
    dispatcher, supervisor = app[DISPATCHER], app[SUPERVISOR]
    await dispatcher.start()
    await supervisor.start()
    sampler = asyncio.create_task(app[VIEWS].sample_loop(), name="status-sampler")
    yield
    sampler.cancel()
    await asyncio.gather(sampler, return_exceptions=True)
    await supervisor.stop()
    await dispatcher.stop()
    app[API].pool.shutdown(wait=False, cancel_futures=True)
