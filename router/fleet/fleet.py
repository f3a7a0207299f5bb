"""Which workers run: models loaded on demand within one host budget, unloaded when idle.

The fleet holds one supervisor per worker (spawned or external) and decides, with
router/fleet/placement.py, when a model's worker is started and which idle workers stop to make
room; the supervisors then do the starting and stopping, and the dispatcher routes jobs to
whichever workers are linked. One reconcile step, run on every change and a few times a
second: unload what idled past its keep-alive, then place what is wanted and not loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from common import costmodel
from common.costmodel import CostModel
from common.errors import InsufficientMemory
from common.protocol import ExitCode, Hello, Limit, Trim
from router.fleet import placement
from router.fleet.dispatch import Dispatcher
from router.fleet.link import STALL_TIMEOUT_S
from router.fleet.models import ModelSpec, resolve
from router.fleet.placement import Action, Footprint, Resident
from router.fleet.supervisor import SpawnSpec, Supervisor, SupervisorMetrics, WorkerState

log = logging.getLogger(__name__)

RECONCILE_INTERVAL_S = 0.25
# Before a model has ever loaded, its worker's runtime baseline is a guess: MLX, the
# tokenizer and Python's own memory, beside the weights.
BASELINE_ESTIMATE_BYTES = 64 << 20
WEIGHTS_OVERHEAD = 1.1


class ModelState(StrEnum):
    LOADED = "loaded"
    LOADING = "loading"
    UNLOADED = "unloaded"


@dataclass(slots=True)
class Served:
    """What the fleet knows of one model at run time (never written into the config)."""

    spec: ModelSpec
    pinned: bool
    keep_alive_s: float                   # the default, or the latest request's keep_alive
    waiters: int = 0                      # requests waiting for its first worker's hello
    last_used_at: float = 0.0
    tokenizer_path: str | None = None
    cost_model: CostModel | None = None
    learned: Footprint | None = None      # from a worker's own report: beats the estimate
    min_lease_bytes: int = 0              # a worker with less exited: not enough memory

    def __post_init__(self) -> None:
        if self.spec.folder is not None:
            self.tokenizer_path = str(self.spec.folder)


@dataclass(slots=True)
class Worker:
    key: int
    model: str
    sup: Supervisor
    lease_bytes: int | None               # None: no host budget (the worker sizes itself)
    stopping: bool = False
    started_at: float = field(default_factory=time.monotonic)


class Fleet:
    """The catalog's models and the workers that serve them."""

    def __init__(self, catalog: list[ModelSpec], dispatcher: Dispatcher, metrics: SupervisorMetrics, *,
                 make_spawn: Callable[[ModelSpec, int | None], SpawnSpec] | None,
                 budget_bytes: int | None, cap_bytes: int | None, keep_alive_s: float,
                 pins: tuple[str, ...] = (), replicas: int = 1, preload: bool = False,
                 stall_timeout_s: float = STALL_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.catalog = catalog
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.make_spawn = make_spawn
        self.budget_bytes = budget_bytes
        self.cap_bytes = cap_bytes
        self.replicas = replicas
        self.preload = preload
        self.stall_timeout_s = stall_timeout_s
        self.clock = clock
        self.models = {s.alias: Served(s, pinned=s.alias in pins, keep_alive_s=keep_alive_s)
                       for s in catalog}
        self.workers: dict[int, Worker] = {}
        self._keys = itertools.count(1)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._pending: set[asyncio.Task[None]] = set()
        # Called (why, the worker's exit code) when a model's every worker has exited for a
        # reason that will repeat (ExitCode.PERMANENT); the app sets it when that ends the router.
        self.on_permanent_failure: Callable[[str, int], None] | None = None
        dispatcher.assign = self.assign
        dispatcher.hello_listeners.append(self.on_hello)
        dispatcher.on_shutdown = self.on_worker_shutdown
        dispatcher.change_listeners.append(self.on_change)

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        if self.make_spawn is None:  # external workers: a slot per model until one connects
            for served in self.models.values():
                await self._add(served.spec.alias, None, None)
        self.reconcile()  # what starts at once is listed by the first /health
        self._tasks.append(asyncio.create_task(self._reconcile_loop(), name="fleet-reconcile"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(w.sup.stop() for w in self.workers.values()),
                             *self._pending, return_exceptions=True)

    def restart_all(self) -> None:
        for w in list(self.workers.values()):
            if self.budget_bytes is not None and w.lease_bytes is not None \
                    and w.sup.state is WorkerState.FAILED and w.sup.is_exited and not w.stopping:
                # Its lease stopped counting when it failed, and others may hold that room
                # now: placed again, within the budget, rather than restarted with its old share.
                self.dispatcher.set_unavailable(w.model, None)
                self._retire(w, "restarted by an operator: placed again")
                continue
            w.sup.restart_now()
        self._wake.set()

    # -- what the API asks -----------------------------------------------------------

    def resolve(self, name: str) -> Served | None:
        spec = resolve(self.catalog, name)
        return self.models[spec.alias] if spec is not None else None

    def footprint(self, served: Served) -> Footprint:
        fp = self._footprint(served)
        if fp.need_bytes < served.min_lease_bytes:  # a worker found less too small
            fp = dataclasses.replace(fp, fixed_bytes=served.min_lease_bytes - fp.min_request_bytes)
        return fp

    def _footprint(self, served: Served) -> Footprint:
        if served.learned is not None:
            return served.learned
        spec = served.spec
        fixed = int((spec.weights_bytes or 0) * WEIGHTS_OVERHEAD) + BASELINE_ESTIMATE_BYTES
        if spec.kv_bytes_per_token is None:  # unknown: ask for everything that is free
            return Footprint(fixed, 0, 1 << 62)
        kv = spec.kv_bytes_per_token
        return Footprint(fixed, kv * costmodel.MIN_REQUEST_TOKENS,
                         kv * costmodel.roundup(spec.context_length or 4096))

    def check_fits(self, served: Served) -> None:
        """A model that could never load even alone is a 400, before any waiting."""
        if self.budget_bytes is None:
            return
        fp = self.footprint(served)
        if placement.never_fits(self.budget_bytes, fp, self.cap_bytes):
            raise InsufficientMemory(
                f"model {served.spec.alias} needs about {fp.need_bytes >> 20} MiB to load "
                f"(weights, runtime and a minimal request); the host budget is "
                f"{self.budget_bytes >> 20} MiB (--host-memory-mb)", param="model",
                needed_bytes=fp.need_bytes)

    def note_request(self, served: Served, keep_alive_s: float | None) -> None:
        """A request arrived: the model is used now, and its keep_alive (Ollama's) holds."""
        served.last_used_at = self.clock()
        if keep_alive_s is not None:
            served.keep_alive_s = keep_alive_s

    @contextlib.contextmanager
    def waiting(self, served: Served) -> Iterator[None]:
        """A request waits for the model's first hello: that is demand, load it."""
        served.waiters += 1
        self._wake.set()
        try:
            yield
        finally:
            served.waiters -= 1

    def state_of(self, served: Served) -> ModelState:
        """Loaded until its last worker's process has exited: only then is its memory back."""
        workers = [w for w in self.workers.values() if w.model == served.spec.alias]
        if any(w.sup.incarnation in self.dispatcher.links for w in workers):
            return ModelState.LOADED
        if any(w.sup.state in (WorkerState.STARTING, WorkerState.RESTARTING) and w.sup.spawn_spec
               for w in workers):
            return ModelState.LOADING
        return ModelState.UNLOADED

    def live(self, model: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.model == model and not w.stopping]

    def leased_bytes(self) -> int:
        return sum(w.lease_bytes or 0 for w in self.workers.values()
                   if not (w.sup.state is WorkerState.FAILED and w.sup.is_exited))

    # -- events from the dispatcher --------------------------------------------------

    def assign(self, hello: Hello) -> str | None:
        for w in self.workers.values():
            if w.sup.incarnation == hello.incarnation:
                return w.model
        served = self.resolve(hello.model_id)
        return served.spec.alias if served is not None else None

    def on_hello(self, hello: Hello) -> None:
        model = self.assign(hello)
        if model is None:
            return
        served = self.models[model]
        served.tokenizer_path = hello.tokenizer_path
        served.cost_model = CostModel.from_dict(hello.cost_model)
        owner = next((w for w in self.workers.values() if w.sup.incarnation == hello.incarnation), None)
        if owner is None:  # an external worker: a free slot of its model adopts it, or a new one
            owner = next((w for w in self.workers.values() if w.model == model
                          and w.sup.spawn_spec is None and not w.stopping
                          and w.sup.state in (WorkerState.STARTING, WorkerState.DOWN)), None)
            if owner is None:  # one whose peer is gone (launchd restarted it): replaced now
                owner = next((w for w in self.workers.values() if w.model == model
                              and w.sup.spawn_spec is None and not w.stopping
                              and self._unreachable(w)), None)
                if owner is not None:
                    owner.sup.on_replaced("its connection is gone and a new worker of its "
                                          "model said hello")
            if owner is None:
                owner = self._add_now(model, None, None)
                self._background(owner.sup.start())
            owner.sup.incarnation = hello.incarnation
        owner.sup.on_hello(hello)
        self._wake.set()

    def _unreachable(self, w: Worker) -> bool:
        link = self.dispatcher.links.get(w.sup.incarnation) if w.sup.incarnation is not None else None
        return link is not None and link.unreachable

    def on_worker_shutdown(self, incarnation: int, reason: str) -> None:
        for w in self.workers.values():
            if w.sup.incarnation == incarnation:
                w.sup.on_worker_shutdown(incarnation, reason)

    def on_change(self, model: str) -> None:
        self._wake.set()

    # -- reconcile -------------------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), RECONCILE_INTERVAL_S)
            self._wake.clear()
            try:
                self.reconcile()
            except Exception:  # a bug here must not stop loading and unloading for good
                log.exception("fleet reconcile failed")

    def reconcile(self) -> None:
        now = self.clock()
        self._learn()
        self._unload_idle(now)
        for served in self.models.values():
            if self.make_spawn is not None and self._wanted(served):
                self._place(served, now)
        self._grow_leases()  # what no waiting model took

    def busy(self, model: str) -> bool:
        served = self.models[model]
        return bool(served.waiters or self.dispatcher.num_queued(model)
                    or self.dispatcher.num_in_flight(model))

    def last_used(self, model: str) -> float:
        links = self.dispatcher.links_of(model)
        return max([self.models[model].last_used_at] + [link.last_used_at for link in links])

    def _wanted(self, served: Served) -> bool:
        return (served.pinned or self.busy(served.spec.alias)
                or (self.preload and len(self.catalog) == 1 and served.keep_alive_s < 0))

    def _learn(self) -> None:
        """A worker's own report replaces the estimate from the model's files."""
        for link in self.dispatcher.links.values():
            report, served = link.status, self.models.get(link.model_alias)
            if report is None or served is None or not report.limit_bytes:
                continue
            m = link.cost_model
            fixed = max(0, report.limit_bytes - m.budget_bytes)
            served.learned = Footprint(
                fixed, costmodel.request_cost_bytes(m, costmodel.MIN_REQUEST_TOKENS - 1, 1),
                costmodel.request_cost_bytes(m, max(1, m.context_length - 1), 1))

    def _unload_idle(self, now: float) -> None:
        for model, served in self.models.items():
            workers = [w for w in self.live(model) if w.sup.spawn_spec is not None]
            if not workers or served.pinned or self.busy(model):
                continue
            if any(w.sup.state is WorkerState.STARTING for w in workers):
                continue  # still loading: never stop a load half way
            if any(w.sup.state is WorkerState.FAILED for w in workers):
                # Failed waits for an operator's restart, which restarts the workers there
                # are: unloaded, the model would be refused for good with none to restart.
                continue
            if placement.expired(self.last_used(model), served.keep_alive_s, now):
                for w in workers:
                    self._retire(w, f"idle for {served.keep_alive_s:g}s (keep-alive)")

    def _residents(self) -> list[Resident]:
        out = []
        for w in self.workers.values():
            if w.lease_bytes is None or (w.sup.state is WorkerState.FAILED and w.sup.is_exited):
                continue
            loading = w.sup.state is not WorkerState.READY
            out.append(Resident(key=w.key, model=w.model, lease_bytes=w.lease_bytes,
                                busy=w.stopping or loading or self.busy(w.model),
                                pinned=self.models[w.model].pinned,
                                last_used_at=self.last_used(w.model)))
        return out

    def serving(self, model: str) -> list[Worker]:
        """The model's workers that serve or will: spawned ones, and external ones while
        connected (a silent external worker may never come back; a spawned one restarts)."""
        return [w for w in self.live(model)
                if w.sup.spawn_spec is not None or w.sup.state is WorkerState.READY]

    def _place(self, served: Served, now: float) -> None:
        model = served.spec.alias
        have = len(self.serving(model))
        if have >= self.replicas:
            return
        if self.budget_bytes is None:
            self._spawn(served, None)
            return
        plan = placement.plan_load(self.budget_bytes, self.footprint(served), self._residents(),
                                   cap_bytes=self._lease_cap(served), may_evict=have == 0)
        if plan.action is Action.LOAD:
            self._spawn(served, plan.lease_bytes)
        elif plan.action is Action.EVICT:
            for w in self.workers.values():  # evictable memory first: it costs nobody a load
                if w.sup.incarnation is not None:
                    self.dispatcher.send_to(w.sup.incarnation, Trim(incarnation=w.sup.incarnation))
            for key in plan.evict:
                self._retire(self.workers[key], f"making room for {model}")
        elif plan.action is Action.NEVER and have == 0:
            fp = self.footprint(served)
            pinned = sum(w.lease_bytes or 0 for w in self.workers.values() if self.models[w.model].pinned)
            beside = f", {pinned >> 20} MiB of it leased to pinned models" if pinned else ""
            log.warning("model %s can never load within the host budget (%d MiB needed%s)", model,
                        fp.need_bytes >> 20, beside)
            self.dispatcher.fail_queued(model, InsufficientMemory(
                f"model {model} needs about {fp.need_bytes >> 20} MiB to load; the host budget "
                f"is {self.budget_bytes >> 20} MiB{beside}", param="model", needed_bytes=fp.need_bytes))

    def _lease_cap(self, served: Served) -> int | None:
        """--memory-limit-mb, and for a pinned model (never stopped for another, its lease
        never shrinks) what leaves room for the largest other model to load beside it."""
        cap = self.cap_bytes
        others = [self.footprint(s).need_bytes for s in self.models.values() if s is not served]
        if served.pinned and others and self.budget_bytes is not None:
            room = self.budget_bytes - max(others)
            if room >= self.footprint(served).need_bytes:
                cap = room if cap is None else min(cap, room)
        return cap

    def _spawn(self, served: Served, lease_bytes: int | None) -> None:
        assert self.make_spawn is not None
        w = self._add_now(served.spec.alias, self.make_spawn(served.spec, lease_bytes), lease_bytes)
        log.info("loading %s (worker %d, lease %s)", served.spec.alias, w.key,
                 f"{lease_bytes >> 20} MiB" if lease_bytes is not None else "unbounded")
        self._background(w.sup.start())

    def _retire(self, w: Worker, why: str) -> None:
        """Stop a worker for good; its lease counts until its process has exited."""
        if w.stopping:
            return
        w.stopping = True
        if w.sup.incarnation is not None:
            link = self.dispatcher.links.get(w.sup.incarnation)
            if link is not None:
                link.retiring = True  # no new job goes to it from now on
        log.info("unloading %s (worker %d): %s", w.model, w.key, why)

        async def stop() -> None:
            try:
                await w.sup.stop(why)
            finally:
                self.workers.pop(w.key, None)
                self._grow_leases()
                self._wake.set()

        self._background(stop())

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        """A start or stop that outlives this step; kept until done (and awaited at stop)."""
        task = asyncio.ensure_future(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def _grow_leases(self) -> None:
        """Room came back: a worker that got less than it asked for gets more, and is told;
        not while a model waits to be placed (room freed for it, by an eviction, is its)."""
        if self.budget_bytes is None or any(self._wanted(s) and not self.serving(s.spec.alias)
                                            for s in self.models.values()):
            return
        free = self.budget_bytes - self.leased_bytes()
        for w in self.workers.values():
            if free <= 0 or w.lease_bytes is None or w.stopping or w.sup.incarnation is None:
                continue
            want = min(self.footprint(self.models[w.model]).want_bytes,
                       self.cap_bytes if self.cap_bytes is not None else 1 << 62)
            more = min(free, want - w.lease_bytes)
            if more > placement.MIB and self.dispatcher.send_to(
                    w.sup.incarnation, Limit(incarnation=w.sup.incarnation,
                                             limit_bytes=w.lease_bytes + more)):
                w.lease_bytes += more
                free -= more
                if w.sup.spawn_spec is not None and self.make_spawn is not None:
                    # A restart starts with the grown share, not the first one.
                    w.sup.spawn_spec = self.make_spawn(self.models[w.model].spec, w.lease_bytes)

    def _add_now(self, model: str, spawn: SpawnSpec | None, lease_bytes: int | None) -> Worker:
        sup = Supervisor(self.dispatcher, spawn, self.metrics, model=model,
                         stall_timeout_s=self.stall_timeout_s)
        sup.on_failed = self._on_failed
        w = Worker(next(self._keys), model, sup, lease_bytes)
        self.workers[w.key] = w
        return w

    async def _add(self, model: str, spawn: SpawnSpec | None, lease_bytes: int | None) -> Worker:
        w = self._add_now(model, spawn, lease_bytes)
        await w.sup.start()
        return w

    def _on_failed(self, sup: Supervisor, reason: str | None) -> None:
        """A model is unavailable only when every one of its workers has failed. A worker
        that found its share too small for a minimal request is not failed: the model needs
        a larger share, and waits for one (or is refused if even the budget is too small)."""
        w = next((w for w in self.workers.values() if w.sup is sup), None)
        exit_code = sup.last_exit.code if sup.last_exit is not None else None
        if reason is not None and w is not None and w.lease_bytes is not None \
                and exit_code == ExitCode.NO_MEMORY and self.budget_bytes is not None \
                and w.lease_bytes < self.budget_bytes:
            served = self.models[w.model]
            served.min_lease_bytes = w.lease_bytes + placement.MIB
            log.warning("%s needs more than its %d MiB share; it waits for a larger one",
                        w.model, w.lease_bytes >> 20)
            self._retire(w, "its share was too small")
            return
        workers = [w for w in self.live(sup.model)]
        if reason is None or all(w.sup.state is WorkerState.FAILED for w in workers):
            self.dispatcher.set_unavailable(sup.model, reason)
            if reason is not None and sup.last_exit is not None and exit_code is not None \
                    and exit_code in ExitCode.PERMANENT and self.on_permanent_failure is not None:
                self.on_permanent_failure(f"{sup.model}: {sup.last_exit.reason}", exit_code)

    # -- what the status views show --------------------------------------------------

    def preloads(self) -> bool:
        """Serving means a ready worker (as a single-model server): external workers, one
        model kept for ever, or pinned models. Otherwise models load on demand."""
        single = len(self.catalog) == 1 and next(iter(self.models.values())).keep_alive_s < 0
        return self.make_spawn is None or single or any(s.pinned for s in self.models.values())

    def describe_models(self) -> list[dict[str, Any]]:
        out = []
        for alias, served in self.models.items():
            links = self.dispatcher.links_of(alias)
            fp = self.footprint(served)
            used = sum(link.status.active_bytes + link.status.cache_bytes
                       for link in links if link.status is not None)
            out.append({
                "id": alias, "state": self.state_of(served).value, "pinned": served.pinned,
                "keep_alive_s": served.keep_alive_s, "workers": len(self.live(alias)),
                "queued": self.dispatcher.num_queued(alias),
                "running": self.dispatcher.num_in_flight(alias),
                "memory": {"weights_bytes": served.spec.weights_bytes,
                           "need_bytes": fp.need_bytes, "used_bytes": used,
                           "lease_bytes": sum(w.lease_bytes or 0 for w in self.live(alias)),
                           "estimated": served.learned is None}})
        return out

    def describe_host(self) -> dict[str, Any]:
        leased = self.leased_bytes()
        return {"budget_bytes": self.budget_bytes, "leased_bytes": leased,
                "free_bytes": None if self.budget_bytes is None else self.budget_bytes - leased,
                "workers": len(self.workers)}
