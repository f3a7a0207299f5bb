"""router/fleet/fleet.py carrying out placement: loads, trims, evictions, leases, idle unload.

No process is spawned: ``Supervisor.start`` and ``stop`` are replaced, hellos and exits are
played by hand, and the dispatcher's socket sends are recorded.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from common.costmodel import CostModel
from common.protocol import ExitCode, Hello, Limit, MemoryReport, Status, Trim
from router.fleet.channel import Channel
from router.fleet.dispatch import Dispatcher
from router.fleet.fleet import Fleet, ModelState
from router.fleet.models import ModelSpec
from router.fleet.supervisor import ExitRecord, SpawnSpec, Supervisor, WorkerState
from router.job import Job, Sampling
from router.ops.status import Metrics

MIB = 1 << 20
# 10 MiB of weights, 64 KiB of KV a token, 4096 tokens: need ~91 MiB, want ~330 MiB.
SPECS = [ModelSpec(alias=a, source=f"/m/{a}", weights_bytes=10 * MIB, kv_bytes_per_token=65536,
                   context_length=4096) for a in ("a", "b")]


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def world(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[Fleet, Dispatcher, list[Any], Clock]]:
    stopped: list[Supervisor] = []

    async def start(self: Supervisor) -> None:
        self.incarnation = 1000 + len(fleet.workers)

    async def stop(self: Supervisor, reason: str = "") -> None:
        stopped.append(self)
        if self.incarnation is not None:
            self.dispatcher.worker_lost(self.incarnation, reason)

    monkeypatch.setattr(Supervisor, "start", start)
    monkeypatch.setattr(Supervisor, "stop", stop)
    clock = Clock()
    metrics = Metrics()
    dispatcher = Dispatcher(Channel("inproc://fleet-test", metrics), 64, metrics, clock=clock)
    sent: list[Any] = []
    dispatcher._send = lambda link, msg: sent.append(msg)  # type: ignore[method-assign]
    fleet = Fleet(SPECS, dispatcher, Metrics(), make_spawn=lambda spec, lease: SpawnSpec([spec.source, f"--lease={lease}"], {}),
                  budget_bytes=200 * MIB, cap_bytes=None, keep_alive_s=5.0, clock=clock)
    yield fleet, dispatcher, sent, clock
    dispatcher.channel.close()


async def settle(fleet: Fleet) -> None:
    for _ in range(5):
        await asyncio.sleep(0)
        await asyncio.gather(*list(fleet._pending))


async def hello_from(fleet: Fleet, dispatcher: Dispatcher, model: str, context_length: int = 4096) -> int:
    """The newest worker of ``model`` (started) says hello and reports."""
    await settle(fleet)
    w = [w for w in fleet.workers.values() if w.model == model][-1]
    incarnation = w.sup.incarnation
    assert incarnation is not None
    dispatcher._handle(f"w{incarnation}".encode(), Hello(
        incarnation=incarnation, pid=incarnation, package_version="t", model_id=f"/m/{model}",
        fingerprint="f", context_length=context_length, tokenizer_path=f"/m/{model}", eos_token_ids=[0],
        admission=True, cost_model=CostModel(kv_bytes_per_token=65536, num_layers=4,
                                             prefill_a_bytes=1.0, prefill_c_bytes=1.0,
                                             budget_bytes=(w.lease_bytes or 0) - 30 * MIB,
                                             context_length=context_length,
                                             prefill_step_tokens=256).to_dict()))
    dispatcher._handle(b"w", Status(incarnation=incarnation, report=MemoryReport(
        max_running_requests=4, limit_bytes=w.lease_bytes or 0)))
    return incarnation


def job(model: str, rid: str) -> Job:
    return Job(request_id=rid, prompt_ids=[1, 2], sampling=Sampling(max_tokens=2), deadline=1e9,
               enqueued_at=0.0, model=model)


async def test_a_queued_request_loads_its_model_once_with_a_share_of_the_budget(world: Any) -> None:
    fleet, dispatcher, sent, clock = world
    for i in range(3):
        dispatcher.submit(job("a", f"r{i}"))
    fleet.reconcile()
    fleet.reconcile()
    (w,) = fleet.workers.values()
    assert w.model == "a" and w.lease_bytes == 200 * MIB  # all that is free: it wants more
    assert fleet.state_of(fleet.models["a"]) is ModelState.LOADING
    await hello_from(fleet, dispatcher, "a")
    assert fleet.state_of(fleet.models["a"]) is ModelState.LOADED
    assert dispatcher.num_in_flight("a") == 3


async def test_room_is_made_by_trimming_then_stopping_the_idle_model(world: Any) -> None:
    fleet, dispatcher, sent, clock = world
    dispatcher.submit(first := job("a", "r1"))
    fleet.reconcile()
    incarnation = await hello_from(fleet, dispatcher, "a")
    dispatcher.submit(job("b", "r2"))
    fleet.reconcile()
    assert not any(isinstance(m, Trim) for m in sent), "a is busy: nothing is asked of it"
    assert [w.model for w in fleet.workers.values()] == ["a"]
    dispatcher.cancel(first)  # a is idle now
    fleet.reconcile()
    assert any(isinstance(m, Trim) and m.incarnation == incarnation for m in sent)
    await settle(fleet)
    fleet.reconcile()
    assert [w.model for w in fleet.workers.values()] == ["b"]
    assert fleet.leased_bytes() <= 200 * MIB


async def test_a_pinned_model_is_never_stopped_for_another_and_leaves_it_room(world: Any) -> None:
    """Pinned, a is never stopped; its lease leaves room for the largest other model (the
    whole budget once went to it, and b waited for ever)."""
    fleet, dispatcher, sent, clock = world
    fleet.models["a"].pinned = True
    fleet.reconcile()
    await hello_from(fleet, dispatcher, "a")
    dispatcher.submit(job("b", "r1"))
    fleet.reconcile()
    await settle(fleet)
    assert [(w.model, w.stopping) for w in fleet.workers.values()] == [("a", False), ("b", False)]
    assert fleet.leased_bytes() <= fleet.budget_bytes


async def test_a_model_that_can_never_load_beside_the_pinned_ones_is_refused_not_left_waiting(
        world: Any) -> None:
    from common.errors import InsufficientMemory

    fleet, dispatcher, sent, clock = world
    fleet.budget_bytes = 150 * MIB  # a needs ~91: no room for b's ~91 beside it, pinned or not
    fleet.models["a"].pinned = True
    fleet.reconcile()
    await hello_from(fleet, dispatcher, "a")
    dispatcher.submit(waiting := job("b", "r1"))
    fleet.reconcile()
    await settle(fleet)
    error = waiting.events.get_nowait()
    assert isinstance(error, InsufficientMemory) and "pinned" in error.message
    assert [w.model for w in fleet.workers.values()] == ["a"]


async def test_idle_past_keep_alive_unloads_and_room_grows_the_others_lease(world: Any) -> None:
    fleet, dispatcher, sent, clock = world
    fleet.budget_bytes = 440 * MIB  # a wants ~330: b gets the ~110 left, less than it wants
    fleet.models["b"].keep_alive_s = -1.0
    for model in ("a", "b"):
        dispatcher.submit(j := job(model, f"r-{model}"))
        fleet.reconcile()
        await hello_from(fleet, dispatcher, model)
        dispatcher.cancel(j)
    leases = {w.model: w.lease_bytes for w in fleet.workers.values()}
    assert leases["b"] is not None and leases["b"] < 120 * MIB
    clock.now += 6.0  # a idles past its 5 s keep-alive; b is kept for ever
    fleet.reconcile()
    await settle(fleet)
    (b,) = fleet.workers.values()
    assert b.model == "b" and b.lease_bytes is not None and b.lease_bytes > leases["b"]
    assert any(isinstance(m, Limit) and m.limit_bytes == b.lease_bytes for m in sent)
    # and a restart of b starts with the grown share, not its first one
    assert b.sup.spawn_spec is not None and b.sup.spawn_spec.argv[-1] == f"--lease={b.lease_bytes}"
    assert fleet.state_of(fleet.models["a"]) is ModelState.UNLOADED


async def test_a_share_too_small_is_a_larger_need_not_a_failure(world: Any) -> None:
    fleet, dispatcher, sent, clock = world
    fleet.budget_bytes = 400 * MIB
    dispatcher.submit(job("a", "r1"))
    fleet.reconcile()
    (w,) = fleet.workers.values()
    w.sup.last_exit = ExitRecord(ExitCode.NO_MEMORY, None, "not enough memory", 0.0)
    w.sup._set(WorkerState.FAILED, "not enough memory")
    await settle(fleet)
    assert "a" not in dispatcher.unavailable and not fleet.workers
    assert fleet.footprint(fleet.models["a"]).need_bytes > (w.lease_bytes or 0)


@pytest.mark.parametrize(("exit_record", "reported"), [
    # The hook a foreground router exits by: a model whose only worker cannot load.
    (ExitRecord(ExitCode.LOAD_ERROR, None, "the model failed to load", 0.0),
     [("a: the model failed to load", ExitCode.LOAD_ERROR)]),
    # Deaths by signal may not repeat (another process took the memory): never an exit.
    (ExitRecord(None, "SIGABRT", "aborted (SIGABRT)", 0.0), []),
])
async def test_only_a_permanent_failure_of_every_worker_is_reported(
        world: Any, exit_record: ExitRecord, reported: list[tuple[str, int]]) -> None:
    fleet, dispatcher, sent, clock = world
    calls: list[tuple[str, int]] = []
    fleet.on_permanent_failure = lambda why, code: calls.append((why, code))
    dispatcher.submit(job("a", "r1"))
    fleet.reconcile()
    (w,) = fleet.workers.values()
    w.sup.last_exit = exit_record
    w.sup._set(WorkerState.FAILED, f"worker keeps failing: {exit_record.reason}")
    assert calls == reported and "a" in dispatcher.unavailable


async def test_a_failed_model_stays_failed_past_its_keep_alive_for_the_operators_restart(world: Any) -> None:
    """Once unloaded by its keep-alive, a failed model had no worker left to restart: every
    request was refused "an operator must restart it", and the restart did nothing."""
    fleet, dispatcher, sent, clock = world
    dispatcher.submit(job("a", "r1"))
    fleet.reconcile()
    (w,) = fleet.workers.values()
    w.sup.last_exit = ExitRecord(None, "SIGKILL", "killed (SIGKILL)", 0.0)
    w.sup._set(WorkerState.FAILED, "worker keeps failing: killed (SIGKILL)")
    assert "a" in dispatcher.unavailable
    clock.now += 60.0  # long past its 5 s keep-alive
    fleet.reconcile()
    await settle(fleet)
    assert list(fleet.workers.values()) == [w] and not w.stopping
    fleet.restart_all()  # under a host budget: placed again (below)
    await settle(fleet)
    assert "a" not in dispatcher.unavailable
    dispatcher.submit(job("a", "r2"))
    fleet.reconcile()
    assert [x.model for x in fleet.workers.values() if x is not w] == ["a"]


async def test_an_operators_restart_places_a_failed_model_again_within_the_budget(world: Any) -> None:
    """A failed worker's lease stops counting, and another model takes the room: restarted
    with its old share, the two leases added up to twice the host budget."""
    fleet, dispatcher, sent, clock = world
    dispatcher.submit(job("a", "r1"))
    fleet.reconcile()
    await settle(fleet)  # its start ran: its own incarnation
    (a,) = fleet.workers.values()
    a.sup.last_exit = ExitRecord(None, "SIGKILL", "killed (SIGKILL)", 0.0)
    a.sup._set(WorkerState.FAILED, "worker keeps failing: killed (SIGKILL)")
    dispatcher.submit(job("b", "r2"))
    fleet.reconcile()
    await hello_from(fleet, dispatcher, "b")
    assert fleet.leased_bytes() <= fleet.budget_bytes
    restarted: list[Any] = []
    a.sup.restart_now = lambda: restarted.append(a)  # type: ignore[method-assign]
    fleet.restart_all()
    await settle(fleet)
    assert restarted == [] and a.key not in fleet.workers and "a" not in dispatcher.unavailable
    dispatcher.submit(job("a", "r3"))
    for _ in range(3):
        fleet.reconcile()
        await settle(fleet)
    assert sum(w.lease_bytes or 0 for w in fleet.workers.values()) <= fleet.budget_bytes


async def test_room_freed_for_a_model_goes_to_it_not_to_a_busy_other(world: Any) -> None:
    """a (idle) is stopped to make room for b while c is busy and wants more: the room once
    went to c's lease first, and b was not loaded (a stopped for nothing)."""
    fleet, dispatcher, sent, clock = world
    specs = [ModelSpec(alias=a, source=f"/m/{a}", weights_bytes=10 * MIB, kv_bytes_per_token=65536,
                       context_length=ctx) for a, ctx in (("a", 4096), ("b", 4096), ("c", 16384))]
    fleet = Fleet(specs, dispatcher, Metrics(), make_spawn=lambda spec, lease: SpawnSpec([spec.source], {}),
                  budget_bytes=500 * MIB, cap_bytes=None, keep_alive_s=1000.0, clock=clock)
    dispatcher.submit(first := job("a", "ra"))
    fleet.reconcile()
    await hello_from(fleet, dispatcher, "a")
    dispatcher.cancel(first)  # a is idle
    dispatcher.submit(job("c", "rc"))  # c is busy, its share less than it wants
    fleet.reconcile()
    await hello_from(fleet, dispatcher, "c", context_length=16384)
    dispatcher.submit(job("b", "rb"))
    for _ in range(3):
        fleet.reconcile()
        await settle(fleet)
    assert sorted(w.model for w in fleet.workers.values()) == ["b", "c"]
    assert fleet.leased_bytes() <= fleet.budget_bytes
