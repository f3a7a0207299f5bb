"""Tests for router/fleet/supervisor.py's decision half: ``Supervisor.decide`` and ``describe_exit``.

Only the pure parts: no process is spawned and no task is started. Since Python 3.10,
asyncio primitives bind to a loop lazily, so the Supervisor can be built outside a loop.
"""

from __future__ import annotations

import asyncio
import signal
from types import SimpleNamespace
from typing import Any

import pytest

from common.protocol import ExitCode, Hello
from router.fleet.supervisor import (
    BACKOFF_FIRST_S, BACKOFF_MAX_S, CRASH_LOOP_DEATHS, CRASH_LOOP_WINDOW_S, HEALTHY_RESET_S,
    STARTUP_DEATHS, Supervisor, WorkerState, describe_exit,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeStateMetric:
    def __init__(self) -> None:
        self.states: list[str] = []

    def state(self, value: str) -> None:
        self.states.append(value)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


class FakeDispatcher:
    """Just the attributes the Supervisor wires itself to (either wiring style)."""

    def __init__(self) -> None:
        self.on_hello: Any = None
        self.on_shutdown: Any = None
        self.hello_listeners: list[Any] = []


@pytest.fixture
def sup(clock: FakeClock) -> Supervisor:
    dispatcher = FakeDispatcher()
    metrics = SimpleNamespace(worker_state=FakeStateMetric())
    return Supervisor(dispatcher=dispatcher, spawn=None, metrics=metrics,  # type: ignore[arg-type]
                      clock=clock)


def hello(incarnation: int = 1) -> Hello:
    return Hello(incarnation=incarnation, pid=4242, package_version="0", model_id="demo",
                 fingerprint="f", context_length=4096, tokenizer_path="/t", eos_token_ids=[0],
                 admission=True)


def ready_then_die(sup: Supervisor, clock: FakeClock, at: float, *, up_for: float = 1.0,
                   returncode: int = -6, blamed: bool = False) -> tuple[WorkerState, float]:
    """The worker says hello at ``at - up_for`` and dies at ``at``."""
    clock.now = at - up_for
    sup.on_hello(hello())
    clock.now = at
    return sup.decide(returncode, was_ready=True, blamed_on_quarantine=blamed, now=at)


def test_starts_in_starting(sup: Supervisor) -> None:
    assert sup.state is WorkerState.STARTING


def test_hello_of_another_worker_is_not_ours(sup: Supervisor) -> None:
    sup.incarnation = 3
    sup.on_hello(hello(4))
    assert sup.state is WorkerState.STARTING


def test_hello_makes_ready(sup: Supervisor, clock: FakeClock) -> None:
    sup.on_hello(hello(7))
    assert sup.state is WorkerState.READY
    assert (sup.incarnation, sup.pid, sup.ready_at) == (7, 4242, clock.now)
    assert sup.metrics.worker_state.states[-1] == "ready"


@pytest.mark.parametrize("code", sorted(ExitCode.PERMANENT))
@pytest.mark.parametrize("was_ready", [False, True])
def test_permanent_exit_codes_fail_at_once(sup: Supervisor, code: int, was_ready: bool) -> None:
    assert sup.decide(code, was_ready=was_ready, blamed_on_quarantine=False, now=1.0) == \
        (WorkerState.FAILED, 0.0)


@pytest.mark.parametrize("code", [ExitCode.OK, 1, ExitCode.UNTRUSTED_STATE, 77,
                                  -signal.SIGABRT, -signal.SIGKILL, -signal.SIGSEGV])
def test_other_exits_restart_at_once_after_serving(sup: Supervisor, code: int) -> None:
    state, delay = sup.decide(code, was_ready=True, blamed_on_quarantine=False, now=1.0)
    assert state is WorkerState.RESTARTING and delay == 0.0


def test_a_worker_that_never_got_ready_is_restarted_after_the_first_backoff(sup: Supervisor) -> None:
    assert sup.decide(-9, was_ready=False, blamed_on_quarantine=False, now=1.0) == \
        (WorkerState.RESTARTING, BACKOFF_FIRST_S)


def test_startup_deaths_fail(sup: Supervisor) -> None:
    assert STARTUP_DEATHS == 3
    decisions = [sup.decide(1, was_ready=False, blamed_on_quarantine=False, now=float(t))
                 for t in range(STARTUP_DEATHS)]
    assert decisions == [(WorkerState.RESTARTING, 0.5), (WorkerState.RESTARTING, 1.0),
                         (WorkerState.FAILED, 0.0)]


def test_startup_deaths_fail_however_far_apart(sup: Supervisor) -> None:
    states = [sup.decide(1, was_ready=False, blamed_on_quarantine=False, now=t * 3600.0)[0]
              for t in range(STARTUP_DEATHS)]
    assert states[-1] is WorkerState.FAILED


def test_hello_resets_startup_deaths(sup: Supervisor, clock: FakeClock) -> None:
    for _ in range(STARTUP_DEATHS - 1):
        sup.decide(1, was_ready=False, blamed_on_quarantine=False, now=clock.now)
    sup.on_hello(hello())
    for _ in range(STARTUP_DEATHS - 1):
        state, _ = sup.decide(1, was_ready=False, blamed_on_quarantine=False, now=clock.now)
        assert state is WorkerState.RESTARTING


def test_crash_loop_after_ready_fails(sup: Supervisor, clock: FakeClock) -> None:
    assert (CRASH_LOOP_DEATHS, CRASH_LOOP_WINDOW_S) == (5, 60.0)
    states = [ready_then_die(sup, clock, 1000.0 + 10 * i)[0] for i in range(CRASH_LOOP_DEATHS)]
    assert states == [WorkerState.RESTARTING] * (CRASH_LOOP_DEATHS - 1) + [WorkerState.FAILED]


def test_deaths_spread_over_more_than_the_window_do_not_fail(sup: Supervisor,
                                                              clock: FakeClock) -> None:
    for i in range(3 * CRASH_LOOP_DEATHS):
        state, _ = ready_then_die(sup, clock, 1000.0 + (CRASH_LOOP_WINDOW_S / 4 + 0.1) * i)
        assert state is WorkerState.RESTARTING, f"death {i + 1}"


def test_backoff_doubles_and_caps(sup: Supervisor, clock: FakeClock) -> None:
    # Deaths more than a window apart (no crash loop), each soon after ready (no reset).
    delays = [ready_then_die(sup, clock, 1000.0 + (CRASH_LOOP_WINDOW_S + 1) * i)[1]
              for i in range(10)]
    assert delays == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert max(delays) == BACKOFF_MAX_S


def test_backoff_resets_after_a_healthy_run(sup: Supervisor, clock: FakeClock) -> None:
    for i in range(4):
        ready_then_die(sup, clock, 1000.0 + 100 * i)
    _, delay = ready_then_die(sup, clock, 2000.0, up_for=HEALTHY_RESET_S)
    assert delay == 0.0


def test_quarantine_blamed_deaths_do_not_count(sup: Supervisor, clock: FakeClock) -> None:
    for i in range(2 * CRASH_LOOP_DEATHS):
        assert ready_then_die(sup, clock, 1000.0 + i, blamed=True) == \
            (WorkerState.RESTARTING, BACKOFF_FIRST_S)
    for i in range(CRASH_LOOP_DEATHS - 1):
        state, _ = ready_then_die(sup, clock, 1020.0 + i)
        assert state is WorkerState.RESTARTING
    assert ready_then_die(sup, clock, 1030.0)[0] is WorkerState.FAILED


def test_decide_does_not_change_state(sup: Supervisor) -> None:
    sup.decide(ExitCode.CONFIG_ERROR, was_ready=False, blamed_on_quarantine=False, now=0.0)
    assert sup.state is WorkerState.STARTING


def test_restart_now_forgets_history(sup: Supervisor, clock: FakeClock) -> None:
    for _ in range(STARTUP_DEATHS - 1):
        sup.decide(1, was_ready=False, blamed_on_quarantine=False, now=clock.now)
    sup.restart_now()
    assert sup.decide(1, was_ready=False, blamed_on_quarantine=False, now=clock.now) == \
        (WorkerState.RESTARTING, BACKOFF_FIRST_S)


# -- describe_exit -------------------------------------------------------------------


def test_describe_abort() -> None:
    code, sig, why = describe_exit(-signal.SIGABRT)
    assert (code, sig) == (None, "SIGABRT")
    assert "SIGABRT" in why and "out-of-memory" in why


def test_describe_kill() -> None:
    assert describe_exit(-signal.SIGKILL) == (None, "SIGKILL", "killed by SIGKILL")


@pytest.mark.parametrize(("returncode", "words"), [
    (ExitCode.OK, "exited"),
    (ExitCode.CONFIG_ERROR, "configuration"),
    (ExitCode.LOAD_ERROR, "load"),
    (ExitCode.NO_MEMORY, "memory"),
    (ExitCode.UNTRUSTED_STATE, "untrusted"),
    (ExitCode.PROTOCOL_MISMATCH, "protocol"),
    (77, "77"),
])
def test_describe_codes(returncode: int, words: str) -> None:
    code, sig, why = describe_exit(returncode)
    assert (code, sig) == (returncode, None)
    assert words in why


def test_describe_every_signal_number() -> None:
    """Real-time signals (e.g. 40 on Linux) have no ``signal.Signals`` member."""
    for number in range(1, signal.NSIG):
        code, sig, why = describe_exit(-number)
        assert code is None and sig and why, number


def test_an_operators_restart_is_neither_backed_off_nor_a_death(sup: Supervisor, clock: FakeClock) -> None:
    """Restarting by hand (SIGHUP, POST /admin/workers/restart) again and again is not a
    crash loop, and the new worker starts at once."""
    for _ in range(CRASH_LOOP_DEATHS + 2):
        clock.now += 1.0
        assert sup.decide(0, was_ready=True, blamed_on_quarantine=False, now=clock.now,
                          requested=True) == (WorkerState.RESTARTING, 0.0)
    # A real death after them still starts the backoff from its first step.
    assert sup.decide(-9, was_ready=True, blamed_on_quarantine=False,
                      now=clock.now) == (WorkerState.RESTARTING, 0.0)
    assert sup.decide(-9, was_ready=True, blamed_on_quarantine=False,
                      now=clock.now) == (WorkerState.RESTARTING, BACKOFF_FIRST_S)


class SpawnWorkers:
    """The dispatcher as a spawning supervisor calls it, recording what it is told."""

    def __init__(self) -> None:
        self.links: dict[int, Any] = {}
        self.unavailable: list[str | None] = []

    def worker_lost(self, *args: Any, **kwargs: Any) -> bool:
        return False

    def send_to(self, *args: Any) -> bool:
        return False

    def set_unavailable(self, model: str, reason: str | None) -> None:
        self.unavailable.append(reason)


async def failed_after_start(sup: Supervisor) -> None:
    """Start ``sup`` and wait (bounded) until it gives up on its worker."""
    from router.fleet.supervisor import WorkerState

    await sup.start()
    for _ in range(500):
        if sup.state is WorkerState.FAILED:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the worker is {sup.state}, not failed")


async def test_a_worker_that_cannot_be_started_backs_off_and_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """An OSError from creating the process (EAGAIN, EMFILE, an interpreter gone) once ended
    the spawn loop unlogged, the worker "starting" for ever: now each is a start-up death,
    backed off, and the third fails the worker with its cause in the log's tail."""
    from router.fleet import supervisor as sv
    from router.fleet.supervisor import SpawnSpec
    from router.ops.status import Metrics

    monkeypatch.setattr(sv, "BACKOFF_FIRST_S", 0.01)
    workers = SpawnWorkers()
    sup = Supervisor(workers, SpawnSpec(["/nonexistent/python", "-m", "worker"], {}), Metrics())  # type: ignore[arg-type]
    try:
        await failed_after_start(sup)
        assert sup.last_exit is not None and sup.last_exit.reason == "could not be started"
        assert any("could not start the worker" in line for line in sup.last_exit.stderr_tail)
        assert workers.unavailable and workers.unavailable[-1]
    finally:
        await sup.stop()


async def test_a_worker_that_never_says_hello_is_killed_at_its_start_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stuck start (a load hung on its storage, a stopped process) once left the worker
    "starting" for ever, holding its lease: past the deadline it is killed, a start-up
    death, and the third fails the worker."""
    import sys

    from router.fleet import supervisor as sv
    from router.fleet.supervisor import SpawnSpec
    from router.ops.status import Metrics

    monkeypatch.setattr(sv, "START_TIMEOUT_S", 0.3)
    monkeypatch.setattr(sv, "MONITOR_INTERVAL_S", 0.02)
    monkeypatch.setattr(sv, "BACKOFF_FIRST_S", 0.01)
    silent = SpawnSpec([sys.executable, "-c", "import time; time.sleep(60)"], {})
    sup = Supervisor(SpawnWorkers(), silent, Metrics())  # type: ignore[arg-type]
    try:
        await failed_after_start(sup)
        assert sup.last_exit is not None and sup.last_exit.signal == "SIGKILL"
        assert any("no hello" in line for line in sup.last_exit.stderr_tail)
    finally:
        await sup.stop()
