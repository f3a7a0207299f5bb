"""What operators watch: /health, /v1/memory, /metrics (prometheus-client), the status
page at / and its data at /status.

/, /static/* and /status answer without the API key, like /health: the page is for
anyone who can reach the port. They show counts, states, memory and error codes, never a
prompt, a key, a file path or a worker's stderr (those stay in /health and the logs).
"""

from __future__ import annotations

import asyncio
import time
from importlib import resources
from collections.abc import Callable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Enum, Gauge, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from common.version import __version__
from router.fleet.dispatch import Dispatcher
from router.fleet.fleet import Fleet, ModelState
from router.fleet.link import WorkerLink
from router.fleet.supervisor import WorkerState
from router.ops.access import DETAILED
from router.ops.history import SAMPLE_INTERVAL_S, History, Sample

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
        self.memory = Gauge("headroom_worker_memory_bytes", "Each worker's latest memory report.",
                            ["model", "worker", "field"], registry=r)
        self.cost_model = Gauge("headroom_cost_model", "Each worker's cost model correction: "
                                "scale (1 = the fitted model) and the worst measured/predicted step.",
                                ["model", "worker", "field"], registry=r)
        self.workers = Gauge("headroom_workers", "Workers by model and state.", ["model", "state"],
                             registry=r)
        self.model_state = Gauge("headroom_model_state", "1 for each model's current state.",
                                 ["model", "state"], registry=r)
        self.lease = Gauge("headroom_worker_lease_bytes", "Each worker's share of the host budget.",
                           ["model", "worker"], registry=r)
        self.host = Gauge("headroom_host_memory_bytes", "The host budget and what is leased of it.",
                          ["field"], registry=r)
        self.history = History()  # the last minutes, for the status page


class PromptCacheMetrics:
    """The workers' prompt caches, read from their latest reports at each scrape, summed over
    the workers: counters are the workers' own totals (a restarted or unloaded worker starts
    again from zero, which Prometheus reads as a counter reset), gauges bytes and entries per
    tier. Hits, misses and evictions carry the tier that served (or evicted) them; summed
    over tiers, hits are every reuse. A RAM miss that the disk served is a RAM miss and a
    disk hit."""

    def __init__(self, caches: Callable[[], list[dict[str, Any]]]) -> None:
        self._caches = caches  # each worker's latest ``prompt_cache`` report

    def collect(self) -> Iterator[Metric]:
        caches = [c for c in self._caches() if c.get("enabled")]
        if not caches:
            return
        by_tier = [_by_tier(c) for c in caches]
        for name, what, labels in (
                ("hits", "Prompts that reused cached KV, by tier.", ["tier"]),
                ("misses", "Prompts that found nothing to reuse in a tier.", ["tier"]),
                ("evictions", "Cache entries evicted, by tier and reason.", ["tier", "reason"]),
                ("writes", "Entries written to the disk tier.", ["tier"]),
                ("corrupt", "Untrusted cache files removed (partial, damaged, foreign).", ["tier"]),
                ("dropped", "Entries not written: the writer's queue was full.", ["tier"])):
            family = CounterMetricFamily(f"headroom_prompt_cache_{name}", what, labels=labels)
            for key, n in _summed(t.get(name) for t in by_tier).items():
                family.add_metric(key.split("/"), n)
            yield family
        yield CounterMetricFamily("headroom_prompt_cache_cached_tokens", "Prompt tokens served from the cache.",
                                  value=sum(_int(c.get("cached_tokens")) or 0 for c in caches))
        yield CounterMetricFamily("headroom_prompt_cache_faults", "Lookups and stores that failed inside the "
                                  "cache (a bug, logged by the worker): served cold or not kept.",
                                  value=sum(_int(c.get("faults")) or 0 for c in caches))
        size = GaugeMetricFamily("headroom_prompt_cache_bytes", "Cached KV bytes, by tier.", labels=["tier"])
        count = GaugeMetricFamily("headroom_prompt_cache_entries", "Cache entries, by tier.", labels=["tier"])
        tiers = [t for c in caches if isinstance(t := c.get("tiers"), dict)]
        for tier, n in _summed({k: v.get("bytes") for k, v in t.items() if isinstance(v, dict)}
                               for t in tiers).items():
            size.add_metric([tier], n)
        for tier, n in _summed({k: v.get("entries") for k, v in t.items() if isinstance(v, dict)}
                               for t in tiers).items():
            count.add_metric([tier], n)
        yield from (size, count)
        yield from _block_metrics(caches, tiers)


def _block_metrics(caches: list[dict[str, Any]], tiers: list[dict[str, Any]]) -> Iterator[Metric]:
    """The block store's figures (workers whose cache keeps whole sequences have none)."""
    blocks = [b for c in caches if isinstance(b := c.get("blocks"), dict)]
    if not blocks:
        return
    held = GaugeMetricFamily("headroom_prompt_cache_blocks", "KV blocks held, by tier (a block in "
                             "both tiers counts in each).", labels=["tier"])
    for tier, n in _summed({k: v.get("blocks") for k, v in t.items() if isinstance(v, dict)}
                           for t in tiers).items():
        held.add_metric([tier], n)
    yield held
    yield GaugeMetricFamily("headroom_prompt_cache_shared_blocks",
                            "KV blocks that more than one cached sequence holds (each held once).",
                            value=sum(_int(b.get("shared")) or 0 for b in blocks))
    yield GaugeMetricFamily("headroom_prompt_cache_shared_bytes", "Bytes of the shared KV blocks.",
                            value=sum(_int(b.get("shared_bytes")) or 0 for b in blocks))
    written = CounterMetricFamily("headroom_prompt_cache_written_bytes",
                                  "Bytes of KV blocks written to the disk tier.", labels=["tier"])
    written.add_metric(["disk"], sum(_int(b.get("written_bytes")) or 0 for b in blocks))
    yield written


def _by_tier(cache: dict[str, Any]) -> dict[str, dict[str, int]]:
    """One worker's counters by metric, keyed "tier" or "tier/reason"."""
    tiers = cache.get("tiers") if isinstance(cache.get("tiers"), dict) else {}
    disk = tiers.get("disk") if isinstance(tiers.get("disk"), dict) else None
    hits_by_kind = cache.get("hits_by_kind") if isinstance(cache.get("hits_by_kind"), dict) else {}
    from_disk = _int(hits_by_kind.get("disk")) or 0
    out: dict[str, dict[str, int]] = {
        "hits": {"ram": (_int(cache.get("hits")) or 0) - from_disk},
        "misses": {"ram": (_int(cache.get("misses")) or 0) + from_disk},
        "evictions": {f"ram/{reason}": _int(n) or 0 for reason, n in (cache.get("evictions") or {}).items()}}
    if disk is not None:
        out["hits"]["disk"] = _int(disk.get("hits")) or 0
        out["misses"]["disk"] = _int(disk.get("misses")) or 0
        out["evictions"]["disk/capacity"] = _int(disk.get("evictions")) or 0
        for name in ("writes", "corrupt", "dropped"):
            out[name] = {"disk": _int(disk.get(name)) or 0}
    return out


def _summed(maps: Any) -> dict[str, int]:
    """Per-key sums of numeric maps (None and non-maps skipped)."""
    out: dict[str, int] = {}
    for m in maps:
        for key, value in (m or {}).items() if isinstance(m, dict) else ():
            out[str(key)] = out.get(str(key), 0) + (_int(value) or 0)
    return out


MEMORY_GAUGES = ("limit_bytes", "budget_bytes", "active_bytes", "cache_bytes", "peak_bytes",
                 "headroom_bytes", "reserved_bytes", "mlx_limit_bytes")
# The workers' fields summed into each chart sample.
SAMPLE_FIELDS = ("limit_bytes", "active_bytes", "cache_bytes", "reserved_bytes", "headroom_bytes")
# The worker report's fields the status page shows (the rest stays in /v1/memory).
PAGE_MEMORY_FIELDS = MEMORY_GAUGES + ("weights_bytes", "system_available_bytes", "device", "device_name",
                                      "context_length", "max_request_tokens", "running",
                                      "max_running_requests")
# The page's files, served from the package (router/ops/static/), never from elsewhere.
STATIC_TYPES = {".html": "text/html", ".css": "text/css", ".js": "text/javascript",
                ".svg": "image/svg+xml"}
# The page may load only what this router serves, and may not be framed by another site.
PAGE_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
                "Content-Security-Policy": "default-src 'none'; script-src 'self'; "
                "style-src 'self'; connect-src 'self'; img-src 'self' data:; "
                "frame-ancestors 'none'; base-uri 'none'; form-action 'none'"}



def without_log_tail(worker: dict[str, Any]) -> dict[str, Any]:
    """A worker's description without its log's tail: stderr may hold paths and prompts,
    for callers with the API key only."""
    if not worker.get("last_exit"):
        return worker
    return {**worker, "last_exit": {k: v for k, v in worker["last_exit"].items() if k != "stderr_tail"}}

class StatusViews:
    """Handlers for the operator endpoints; they read state, they never change it."""

    def __init__(self, dispatcher: Dispatcher, fleet: Fleet, metrics: Metrics,
                 model_id: str, is_draining: Any, tokenizer_ready: Any,
                 warnings: list[str] | None = None) -> None:
        self.dispatcher = dispatcher
        self.fleet = fleet
        self.metrics = metrics
        self.model_id = model_id
        self.is_draining = is_draining
        self.tokenizer_ready = tokenizer_ready   # (tokenizer path) -> loaded?
        self.warnings = list(warnings or [])
        metrics.registry.register(PromptCacheMetrics(
            lambda: [link.status.prompt_cache for link in dispatcher.links.values() if link.status]))

    def _link(self, incarnation: int | None) -> WorkerLink | None:
        return self.dispatcher.links.get(incarnation) if incarnation is not None else None

    def worker_summaries(self) -> list[dict[str, Any]]:
        out = []
        for w in self.fleet.workers.values():
            summary = w.sup.describe()
            summary["lease_bytes"] = w.lease_bytes
            summary["stopping"] = w.stopping
            link = self._link(w.sup.incarnation)
            summary["running"] = len(link.in_flight) if link else 0
            if link is not None and link.status is not None:
                summary["headroom_bytes"] = link.status.headroom_bytes
                summary["max_request_tokens"] = link.status.max_request_tokens
            out.append(summary)
        return out

    def is_serving(self) -> bool:
        """A worker is ready and its tokenizer loaded; or, with models loaded on demand,
        nothing has failed (an idle router with nothing loaded is healthy)."""
        links = [link for link in self.dispatcher.links.values() if not link.retiring]
        if any(self.tokenizer_ready(link.hello.tokenizer_path) for link in links):
            return True
        if self.fleet.preloads():
            return False
        states = {w.sup.state for w in self.fleet.workers.values() if not w.stopping}
        return WorkerState.FAILED not in states and not self.dispatcher.unavailable

    def health_body(self, detailed: bool = True) -> tuple[int, dict[str, Any]]:
        """``detailed=False`` (a caller without the API key) leaves out what could name a
        file: the worker's log tail and a model given as a path."""
        workers = self.worker_summaries()
        if not detailed:
            workers = [without_log_tail(w) for w in workers]
        ok = self.is_serving() and not self.is_draining()
        if ok:
            status = "ok"
        elif self.is_draining():
            status = "draining"
        elif any(w["state"] == WorkerState.READY.value for w in workers):
            status = "loading tokenizer"
        else:
            status = workers[0]["state"] if workers else "starting"
        model = self.model_id if detailed else public_model_name(self.model_id)
        models = self.fleet.describe_models()
        if not detailed:
            for m in models:
                m.pop("source", None)
        body = {"status": status, "model": model, "queued": self.dispatcher.num_queued(),
                "models": models, "workers": workers, "warnings": self.warnings}
        if self.dispatcher.channel.refused is not None:
            body["refused_workers"] = [{**self.dispatcher.channel.refused,
                                        "reason": "protocol version mismatch"}]
        return (200 if ok else 503), body

    async def health(self, request: web.Request) -> web.Response:
        code, body = self.health_body(detailed=request.get(DETAILED, False))
        return web.json_response(body, status=code)

    async def memory(self, request: web.Request) -> web.Response:
        workers = []
        leases = {w.sup.incarnation: w for w in self.fleet.workers.values()}
        for link in self.dispatcher.links.values():
            if link.status is None:
                continue
            report = link.status.to_dict()
            report["report_age_s"] = round(self.dispatcher.clock() - link.status_at, 3)
            report["incarnation"] = link.incarnation
            report["model"] = link.model_alias
            report["pid"] = link.hello.pid
            owner = leases.get(link.incarnation)
            report["lease_bytes"] = owner.lease_bytes if owner else None
            report["queued"] = self.dispatcher.num_queued(link.model_alias)
            workers.append(report)
        return web.json_response({"queued": self.dispatcher.num_queued(), "workers": workers,
                                  "host": self.fleet.describe_host(),
                                  "models": self.fleet.describe_models()})

    async def metrics_text(self, request: web.Request) -> web.Response:
        self.refresh_gauges()
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    def refresh_gauges(self) -> None:
        m = self.metrics
        m.queued.set(self.dispatcher.num_queued())
        m.running.set(sum(len(link.in_flight) for link in self.dispatcher.links.values()))
        for gauge in (m.memory, m.cost_model, m.workers, m.model_state, m.lease):
            gauge.clear()  # workers come and go: no stale series
        for link in self.dispatcher.links.values():
            worker = str(link.hello.pid)
            if link.status is None:
                continue
            for name in MEMORY_GAUGES:
                value = getattr(link.status, name)
                if value is not None:  # mlx_limit_bytes: None where MLX has no limit
                    m.memory.labels(model=link.model_alias, worker=worker, field=name).set(value)
            for name in ("scale", "worst_measured_over_predicted"):
                m.cost_model.labels(model=link.model_alias, worker=worker, field=name).set(
                    getattr(link.status, name))
        for w in self.fleet.workers.values():
            m.workers.labels(model=w.model, state=w.sup.state.value).inc()
            if w.lease_bytes is not None:
                m.lease.labels(model=w.model, worker=str(w.sup.pid)).set(w.lease_bytes)
        for info in self.fleet.describe_models():
            for state in ModelState:
                m.model_state.labels(model=info["id"], state=state.value).set(
                    1 if info["state"] == state.value else 0)
        host = self.fleet.describe_host()
        for name in ("budget_bytes", "leased_bytes"):
            if isinstance(host.get(name), int):
                m.host.labels(field=name).set(host[name])

    # -- the status page and its data ------------------------------------------------

    def take_sample(self, now: float) -> Sample:
        """One chart point: the latest worker report, the queue, and the token rate."""
        total = self.metrics.registry.get_sample_value("headroom_generated_tokens_total") or 0.0
        links = list(self.dispatcher.links.values())
        reports = [link.status for link in links if link.status is not None]
        summed = {f: sum(getattr(r, f) for r in reports) if reports else None for f in SAMPLE_FIELDS}
        sample = Sample(at=round(now, 3), queued=self.dispatcher.num_queued(),
                        running=sum(len(link.in_flight) for link in links),
                        tokens_per_s=round(self.metrics.history.tokens_per_s(now, total), 2), **summed)
        self.metrics.history.add(sample)
        return sample

    async def sample_loop(self) -> None:
        while True:
            self.take_sample(time.time())
            await asyncio.sleep(SAMPLE_INTERVAL_S)

    def status_body(self, since: float | None) -> dict[str, Any]:
        """Everything the page and `mlx-router status` show, safe to give without a key."""
        _, health = self.health_body()
        history = self.metrics.history
        now = time.time()
        latest = history.samples[-1] if history.samples else None
        workers = self._page_workers()
        return {"status": health["status"], "model": public_model_name(self.model_id),
                "version": __version__, "at": now, "queued": health["queued"],
                "running": sum(w["running"] for w in workers),
                "tokens_per_s": latest.tokens_per_s if latest else 0.0,
                "ttft": history.ttft_summary(now), "workers": workers,
                "models": self._page_models(), "host": self.fleet.describe_host(),
                "rejections": history.recent_rejections(), "warnings": health["warnings"],
                "sample_interval_s": SAMPLE_INTERVAL_S, "window_s": history.window_s,
                "history": history.samples_since(since)}

    def _page_models(self) -> list[dict[str, Any]]:
        """Each model the router offers: loaded or not, pinned, its workers and queue (no
        source path: the page is served without a key)."""
        models = self.fleet.describe_models()
        for m in models:
            m.pop("source", None)
        return models

    def _page_workers(self) -> list[dict[str, Any]]:
        out = []
        for w in self.fleet.workers.values():
            worker = without_log_tail(w.sup.describe())  # /health has it, with the key
            if worker["incarnation"] is not None:  # 62 bits: more than a JavaScript number holds
                worker["incarnation"] = str(worker["incarnation"])
            link = self._link(w.sup.incarnation)
            worker["running"] = len(link.in_flight) if link else 0
            worker["memory"] = worker["prompt_cache"] = None
            if link is not None and link.status is not None:
                worker["memory"] = {f: getattr(link.status, f) for f in PAGE_MEMORY_FIELDS}
                worker["memory"]["report_age_s"] = round(self.dispatcher.clock() - link.status_at, 3)
                worker["prompt_cache"] = _numbers(link.status.prompt_cache) if link.status.prompt_cache else None
            out.append(worker)
        return out

    async def status(self, request: web.Request) -> web.Response:
        try:
            since = float(request.query["since"]) if "since" in request.query else None
        except ValueError:
            raise web.HTTPBadRequest(reason="since must be a number (unix seconds)") from None
        return web.json_response(self.status_body(since), headers={"Cache-Control": "no-store"})

    async def page(self, request: web.Request) -> web.Response:
        return _static_response("index.html")

    async def static(self, request: web.Request) -> web.Response:
        return _static_response(request.match_info["name"])


def public_model_name(model: str) -> str:
    """A local folder is shown by its name only; a hub id or 'demo' as given."""
    if model.startswith(("/", "~", ".")):
        return model.rstrip("/").rsplit("/", 1)[-1]
    return model


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _numbers(d: dict[str, Any]) -> dict[str, Any]:
    """Numbers and nested groups of numbers only: a cache's counts, never its folder."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = value
        elif isinstance(value, dict):
            out[key] = _numbers(value)
    return out


def _static_response(name: str) -> web.Response:
    suffix = name[name.rfind("."):] if "." in name else ""
    folder = resources.files("router.ops") / "static"
    if "/" in name or name.startswith(".") or suffix not in STATIC_TYPES:
        raise web.HTTPNotFound()
    path = folder / name
    if not path.is_file():
        raise web.HTTPNotFound()
    return web.Response(body=path.read_bytes(), content_type=STATIC_TYPES[suffix],
                        charset="utf-8", headers=PAGE_HEADERS)
