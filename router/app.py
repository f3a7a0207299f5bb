"""Composition root: build the router's parts from its config and wire them together."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field

from aiohttp import web

import psutil

from common.config import RouterConfig, parse_duration
from common.curve import ServerKeys
from common.errors import HeadroomError
from router.fleet.channel import Channel
from router.fleet.dispatch import Dispatcher
from router.fleet.fleet import Fleet
from router.fleet.models import ModelSpec, build_catalog, check_pins
from router.fleet.placement import lease_mb
from router.fleet.standby import WORKER_MODULE
from router.fleet.supervisor import SpawnSpec
from router.http import anthropic_output, responses_output
from router.http.anthropic_api import Messages
from router.http.api import Api
from router.http.http_errors import make_error_middleware
from router.http.limits import Limits
from router.http.openapi import build_spec
from router.http.reqid import KEY as REQUEST_ID
from router.http.reqid import RequestIds, add_header
from router.http.responses_api import Responses
from router.ops import access
from router.ops.access import DETAILED, AccessPolicy
from router.ops.curve_server import CurveServer
from router.ops.status import Metrics, StatusViews, without_log_tail

log = logging.getLogger(__name__)
MIB = 1 << 20


@dataclass(slots=True)
class RouterState:
    """Facts learned while running (never written back into the config)."""

    draining: bool = False
    extra: dict[str, object] = field(default_factory=dict)
    # A foreground run in a terminal of one spawned model (see router/__main__.py): a worker
    # that cannot start (a wrong path, a bad flag) ends the router with its error.
    exits_on_permanent_failure: bool = False
    exit_code: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)  # main() stops when it is set

    def halt(self, why: str, code: int) -> None:
        """Stop the router, to exit with ``code``."""
        log.error("[shutdown] exiting: %s (a foreground run with one model stops here; "
                  "under launchd or systemd the router stays up and /health says why)", why)
        self.exit_code = code
        self.stop.set()


CONFIG = web.AppKey("config", RouterConfig)
STATE = web.AppKey("state", RouterState)
DISPATCHER = web.AppKey("dispatcher", Dispatcher)
FLEET = web.AppKey("fleet", Fleet)
API = web.AppKey("api", Api)
VIEWS = web.AppKey("views", StatusViews)


def prompt_cache_argv(cfg: RouterConfig) -> list[str]:
    """The prompt cache flags, passed through to the spawned worker as given."""
    argv = ["--prompt-cache-entries", str(cfg.prompt_cache_entries)]
    for flag, value in (("--prompt-cache-bytes", cfg.prompt_cache_bytes),
                        ("--prompt-cache-disk-bytes", cfg.prompt_cache_disk_bytes),
                        ("--prompt-cache-dir", cfg.prompt_cache_dir)):
        if value is not None:
            argv += [flag, str(value)]
    return argv + (["--no-prompt-cache"] if cfg.no_prompt_cache else [])


def worker_argv(cfg: RouterConfig, addr: str, model: str | None = None,
                limit_mb: int | None = None) -> list[str]:
    """The spawned worker's command; ``limit_mb``: its share of the host budget."""
    source = model if model is not None else cfg.model[0]
    argv = [sys.executable, *WORKER_MODULE, "--model", source, "--router", addr,
            "--parent-pipe", "--log-level", cfg.log_level, "--log-format", cfg.log_format]
    limit = limit_mb if limit_mb is not None else cfg.memory_limit_mb
    if limit is not None:
        argv += ["--memory-limit-mb", str(limit)]
    if cfg.max_running_requests is not None:
        argv += ["--max-running-requests", str(cfg.max_running_requests)]
    if cfg.oom_guard is not None:
        argv += ["--oom-guard", cfg.oom_guard]
    if cfg.unsafe_no_admission:
        argv.append("--unsafe-no-admission")
    argv += prompt_cache_argv(cfg)
    if cfg.trust_remote_code:
        argv.append("--trust-remote-code")
    if cfg.curve_secret_key and addr.startswith("tcp://"):
        # The spawned worker uses the router's own keypair, which the router authorizes.
        argv += ["--curve-server-key", cfg.curve_secret_key, "--curve-secret-key", cfg.curve_secret_key]
    return argv + list(cfg.worker_arg)


def worker_env(env: Mapping[str, str]) -> dict[str, str]:
    """The spawned worker's environment, without the router's secrets."""
    return {k: v for k, v in env.items() if k not in ("MLX_ROUTER_API_KEY",)}


# With several models and no --host-memory-mb, workers may hold this share of the RAM.
DEFAULT_HOST_FRACTION = 0.75
# Without --keep-alive, several models unload after this long idle (Ollama's default).
DEFAULT_KEEP_ALIVE_S = 300.0


def make_fleet(cfg: RouterConfig, addr: str, env: Mapping[str, str], dispatcher: Dispatcher,
               metrics: Metrics) -> Fleet:
    """The models and their workers: one model is started at once and kept (as a
    single-model server does) unless --keep-alive says otherwise; several load on demand."""
    catalog = build_catalog(cfg.model, cfg.models_dir)
    check_pins(catalog, cfg.pin)
    several = len(catalog) > 1
    keep_alive_s = parse_duration(cfg.keep_alive, "--keep-alive") if cfg.keep_alive is not None \
        else (DEFAULT_KEEP_ALIVE_S if several else -1.0)
    budget = cfg.host_memory_mb * MIB if cfg.host_memory_mb is not None else (
        int(psutil.virtual_memory().total * DEFAULT_HOST_FRACTION) if several else None)
    cap = cfg.memory_limit_mb * MIB if cfg.memory_limit_mb is not None else None

    def make_spawn(spec: ModelSpec, lease_bytes: int | None) -> SpawnSpec:
        limit = lease_mb(lease_bytes) if lease_bytes is not None else None
        return SpawnSpec(worker_argv(cfg, addr, spec.source, limit), worker_env(env), cfg.standby_delay_s)

    return Fleet(catalog, dispatcher, metrics,
                 make_spawn=make_spawn if cfg.worker_mode == "spawn" else None,
                 budget_bytes=budget, cap_bytes=cap, keep_alive_s=keep_alive_s, pins=cfg.pin,
                 replicas=cfg.replicas, preload=True, stall_timeout_s=cfg.stall_timeout_s)


def make_app(cfg: RouterConfig, addr: str, env: Mapping[str, str], *,
             api_keys: Sequence[str], link_keys: ServerKeys | None,
             exits_on_permanent_failure: bool = False) -> web.Application:
    """The router's app. Keys are read in main(), where a bad file is a clear ConfigError:
    ``api_keys`` from ``access.load_api_keys``, ``link_keys`` from ``curve.load_server_keys``;
    ``exits_on_permanent_failure`` too (``RouterState``)."""
    policy = AccessPolicy.build(api_keys, cfg.host, cfg.allowed_host, cfg.cors_origin)
    # The request id is outermost, so even an error response and its log line carry it;
    # access comes inside the error middleware, which answers its refusals.
    state = RouterState(exits_on_permanent_failure=exits_on_permanent_failure)
    metrics = Metrics()

    def note_refusal(request: web.Request, exc: HeadroomError) -> None:
        metrics.rejections.labels(code=exc.code).inc()
        resource = request.match_info.route.resource
        metrics.history.note_rejection(time.time(), request.get(REQUEST_ID),
                                       resource.canonical if resource else "-", exc)

    # Each API answers errors in its own shape; OpenAI's is the default.
    errors = make_error_middleware({"/v1/messages": anthropic_output.error_body,
                                    "/v1/responses": responses_output.error_body})
    app = web.Application(middlewares=[RequestIds().middleware, errors,
                                       access.make_access_middleware(policy, note_refusal)],
                          client_max_size=cfg.max_body_bytes)
    app.on_response_prepare.append(add_header)
    app.on_response_prepare.append(access.make_cors_signal(policy))
    channel = Channel(addr, metrics, curve=CurveServer(link_keys, metrics) if link_keys else None)
    dispatcher = Dispatcher(channel, cfg.max_queue, metrics)
    fleet = make_fleet(cfg, addr, env, dispatcher, metrics)
    if state.exits_on_permanent_failure:
        fleet.on_permanent_failure = state.halt
    api = Api(dispatcher=dispatcher, fleet=fleet, metrics=metrics,
              default_max_tokens=cfg.default_max_tokens, queue_timeout_s=cfg.queue_timeout_s,
              limits=Limits.from_config(cfg), is_draining=lambda: state.draining,
              trust_remote_code=cfg.trust_remote_code, max_n=cfg.max_n,
              tool_parser=cfg.tool_parser)
    dispatcher.hello_listeners.append(api.preload_tokenizer)
    warnings = access.exposure_warnings(cfg, policy)
    for warning in warnings:
        log.warning("%s", warning)
    views = StatusViews(dispatcher, fleet, metrics, fleet.catalog[0].alias if len(fleet.catalog) == 1
                        else ",".join(fleet.models), lambda: state.draining, api.has_tokenizer,
                        warnings)
    app[CONFIG], app[STATE], app[DISPATCHER], app[FLEET], app[API], app[VIEWS] = (
        cfg, state, dispatcher, fleet, api, views)

    async def admin_restart(request: web.Request) -> web.Response:
        fleet.restart_all()
        workers = [w.sup.describe() for w in fleet.workers.values()]
        if not request.get(DETAILED, False):
            workers = [without_log_tail(w) for w in workers]
        return web.json_response({"status": "restarting", "workers": workers})

    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    messages = Messages(api)
    app.router.add_post("/v1/messages", messages.create)
    app.router.add_post("/v1/messages/count_tokens", messages.count_tokens)
    app.router.add_post("/v1/responses", Responses(api).create)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/v1/models/{model_id:.+}", api.model)
    app.router.add_get("/health", views.health)
    app.router.add_get("/v1/memory", views.memory)
    app.router.add_get("/metrics", views.metrics_text)
    app.router.add_get("/", views.page)

    async def openapi(request: web.Request) -> web.Response:
        link = next(iter(dispatcher.links.values()), None)
        return web.json_response(build_spec(api.limits, link.hello.context_length if link else None))

    app.router.add_get("/static/{name}", views.static)
    app.router.add_get("/status", views.status)
    app.router.add_post("/admin/workers/restart", admin_restart)
    app.router.add_get("/openapi.json", openapi)
    app.cleanup_ctx.append(_background)
    return app


async def _background(app: web.Application) -> AsyncIterator[None]:
    """Start the dispatcher and supervisor with the app; stop them after it."""
    dispatcher, fleet = app[DISPATCHER], app[FLEET]
    await dispatcher.start()
    await fleet.start()
    preimport = asyncio.ensure_future(app[API].import_tokenizer_backend())
    sampler = asyncio.create_task(app[VIEWS].sample_loop(), name="status-sampler")
    yield
    sampler.cancel()
    await asyncio.gather(sampler, preimport, return_exceptions=True)
    await fleet.stop()
    await dispatcher.stop()
    app[API].pool.shutdown(wait=False, cancel_futures=True)
