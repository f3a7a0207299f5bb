"""What operators watch: /health, /v1/memory, /metrics (prometheus-client) and a status page."""

from __future__ import annotations

import html
import json
import time
from pathlib import PurePath
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Enum, Gauge, Histogram
from prometheus_client import generate_latest

from router.access import AUTHORIZED
from router.dispatch import Dispatcher
from router.supervisor import Supervisor, WorkerState

# Latency buckets from 1 ms to 2 min: TTFT spans queueing as well as prefill.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    """Every metric the router exports, in one registry per app (tests run several)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("headroom_requests", "HTTP API requests by endpoint and status.",
                                ["endpoint", "status"], registry=r)
        self.rejections = Counter("headroom_rejections", "Requests refused, by error code.",
                                  ["code"], registry=r)
        self.generated_tokens = Counter("headroom_generated_tokens", "Tokens generated.", registry=r)
        self.prompt_tokens = Counter("headroom_prompt_tokens", "Prompt tokens admitted.", registry=r)
        self.ttft = Histogram("headroom_time_to_first_token_seconds",
                              "From request arrival to the first token.", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.queue_wait = Histogram("headroom_queue_wait_seconds", "Time spent queued.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.queued = Gauge("headroom_queued_requests", "Requests waiting in the router's queue.",
                            registry=r)
        self.running = Gauge("headroom_running_requests", "Requests running on the worker.", registry=r)
        self.worker_state = Enum("headroom_worker_state", "The worker's state.",
                                 states=[s.value for s in WorkerState], registry=r)
        self.worker_restarts = Counter("headroom_worker_restarts", "Worker restarts.", registry=r)
        self.worker_exits = Counter("headroom_worker_exits", "Worker exits by cause.", ["cause"],
                                    registry=r)
        self.worker_rejects = Counter("headroom_worker_rejects", "Worker rejects by reason.",
                                      ["reason"], registry=r)
        self.dispatched = Counter("headroom_dispatched_requests", "Requests sent to a worker.",
                                  registry=r)
        self.cancelled = Counter("headroom_cancelled_requests",
                                 "Requests cancelled (client gone or stop string), by where.",
                                 ["where"], registry=r)
        self.slow_readers = Counter("headroom_slow_readers",
                                    "Streams dropped because their client stopped reading.",
                                    registry=r)
        self.refused_handshakes = Counter(
            "headroom_refused_handshakes", "Worker connections refused by CURVE, by reason.",
            ["reason"], registry=r)
        self.bad_frames = Counter("headroom_bad_frames", "Malformed frames dropped.", registry=r)
        self.memory = Gauge("headroom_worker_memory_bytes", "The worker's latest memory report.",
                            ["field"], registry=r)
        self.cost_model = Gauge("headroom_cost_model", "The worker's cost model correction: "
                                "scale (1 = the fitted model) and the worst measured/predicted step.",
                                ["field"], registry=r)


MEMORY_GAUGES = ("limit_bytes", "budget_bytes", "active_bytes", "cache_bytes", "peak_bytes",
                 "headroom_bytes", "reserved_bytes")


def public_model_name(model: str) -> str:
    """A model given as a local path is shown by its folder name only."""
    if model.startswith(("/", "~", ".")) or "\\" in model:
        return PurePath(model).name or "model"
    return model


class StatusViews:
    """Handlers for the operator endpoints; they read state, they never change it."""

    def __init__(self, dispatcher: Dispatcher, supervisor: Supervisor, metrics: Metrics,
                 model_id: str, is_draining: Any, tokenizer_ready: Any,
                 warnings: list[str] | None = None) -> None:
        self.dispatcher = dispatcher
        self.supervisor = supervisor
        self.metrics = metrics
        self.model_id = model_id
        self.is_draining = is_draining
        self.tokenizer_ready = tokenizer_ready
        self.warnings = list(warnings or [])

    def worker_summary(self) -> dict[str, Any]:
        summary = self.supervisor.describe()
        link = self.dispatcher.link
        report = link.status if link else None
        if report:
            summary["headroom_bytes"] = report.get("headroom_bytes")
            summary["running"] = len(link.in_flight) if link else 0
            summary["max_request_tokens"] = report.get("max_request_tokens")
        return summary

    def health_body(self, detailed: bool = True) -> tuple[int, dict[str, Any]]:
        """``detailed=False`` (a caller without the API key) leaves out what could name a
        file: the worker's log tail and a model given as a path."""
        worker = self.worker_summary()
        if not detailed and worker.get("last_exit"):
            worker["last_exit"] = {k: v for k, v in worker["last_exit"].items()
                                   if k != "stderr_tail"}
        ready = worker["state"] == WorkerState.READY.value
        ok = ready and self.tokenizer_ready() and not self.is_draining()
        if ok:
            status = "ok"
        elif self.is_draining():
            status = "draining"
        else:
            status = "loading tokenizer" if ready else worker["state"]
        model = self.model_id if detailed else public_model_name(self.model_id)
        body = {"status": status, "model": model, "queued": len(self.dispatcher.backlog),
                "workers": [worker], "warnings": self.warnings}
        if self.dispatcher.refused is not None:
            body["refused_workers"] = [{**self.dispatcher.refused,
                                        "reason": "protocol version mismatch"}]
        return (200 if ok else 503), body

    async def health(self, request: web.Request) -> web.Response:
        code, body = self.health_body(detailed=request.get(AUTHORIZED, False))
        return web.json_response(body, status=code)

    async def memory(self, request: web.Request) -> web.Response:
        link = self.dispatcher.link
        workers = []
        if link is not None and link.status is not None:
            report = dict(link.status)
            report["report_age_s"] = round(self.dispatcher.clock() - link.status_at, 3)
            report["incarnation"] = link.incarnation
            workers.append(report)
        return web.json_response({"queued": len(self.dispatcher.backlog), "workers": workers})

    async def metrics_text(self, request: web.Request) -> web.Response:
        self.refresh_gauges()
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    def refresh_gauges(self) -> None:
        m = self.metrics
        m.queued.set(len(self.dispatcher.backlog))
        link = self.dispatcher.link
        m.running.set(len(link.in_flight) if link else 0)
        if link is not None and link.status is not None:
            for name in MEMORY_GAUGES:
                value = link.status.get(name)
                if isinstance(value, (int, float)):
                    m.memory.labels(field=name).set(value)
            for name in ("scale", "worst_measured_over_predicted"):
                value = link.status.get(name)
                if isinstance(value, (int, float)):
                    m.cost_model.labels(field=name).set(value)

    async def page(self, request: web.Request) -> web.Response:
        code, body = self.health_body(detailed=request.get(AUTHORIZED, False))
        pretty = html.escape(json.dumps(body, indent=2))
        text = (f"<!doctype html><title>Headroom</title><h1>Headroom: {html.escape(body['status'])}"
                f"</h1><p>{time.strftime('%Y-%m-%d %H:%M:%S')}</p><pre>{pretty}</pre>"
                "<p><a href='/health'>/health</a> · <a href='/v1/memory'>/v1/memory</a> · "
                "<a href='/metrics'>/metrics</a></p>")
        return web.Response(text=text, content_type="text/html")
