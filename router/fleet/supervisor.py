"""Why was the worker restarted? The supervisor: spawn, watch, restart, give up.

State machine (values are DESIGN's strings):

    starting ──hello──► ready ──exit / silent / wedged──► restarting ──backoff──► starting
        │                 │                                   │
        └─ permanent exit or crash loop ────────────────────► failed (until an operator acts)

External workers are not ours to start or stop: silent → ``down``; a new hello → ``ready``.
Detection and decision are separate: exits come from the child's ``wait()`` (asyncio's
child watcher, not a poll) and silence from heartbeat expiry; ``decide()`` alone chooses
among restart, backoff and failed. A spawned worker that is ready gets a standby
(``standby.py``): the next start skips the imports.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from prometheus_client import Counter, Enum

from common.protocol import ExitCode, Heartbeat, Hello, Message, Shutdown
from router.fleet.link import STALL_TIMEOUT_S, WorkerLink
from router.fleet.standby import STANDBY_AFTER_S, StandbySlot

log = logging.getLogger(__name__)

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
HEALTHY_RESET_S = 60.0          # a worker up this long resets the backoff
CRASH_LOOP_DEATHS = 5           # deaths after ready within CRASH_LOOP_WINDOW_S → failed
CRASH_LOOP_WINDOW_S = 60.0
STARTUP_DEATHS = 3              # consecutive deaths before ever getting ready → failed
MONITOR_INTERVAL_S = 0.25
STOP_TIMEOUT_S = 10.0           # TERM → KILL escalation when stopping our worker
# A worker asked to restart (or that said it is stopping) finishes its running requests
# first (its own grace, 10 s) and then exits: past this it is killed.
LEAVE_TIMEOUT_S = 15.0
# A worker that said it is stopping (its Shutdown sent: its running requests are done or
# dropped) has only its exit left, which takes well under a second: past this it is killed.
EXIT_TIMEOUT_S = 3.0
# The return code recorded for a worker process that could not be created (the shell's
# "could not execute").
SPAWN_FAILED = 126
# A spawned worker that has not said hello this long after its start is stuck (a load hung
# on its storage, a stopped process): killed, a start-up death. Generous: a fresh GPU's
# first start compiles kernels for minutes; never less than 4x the last start took.
START_TIMEOUT_S = 900.0
STDERR_TAIL_LINES = 30


class WorkerState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    DOWN = "down"
    FAILED = "failed"


@dataclass(slots=True)
class ExitRecord:
    code: int | None
    signal: str | None
    reason: str
    at: float                   # wall clock, for people
    stderr_tail: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "signal": self.signal, "reason": self.reason,
                "at": self.at, "stderr_tail": self.stderr_tail[-10:]}


@dataclass(frozen=True, slots=True)
class SpawnSpec:
    argv: list[str]              # the worker command, minus --incarnation
    env: dict[str, str]
    standby_delay_s: float = STANDBY_AFTER_S  # ready this long, then its standby (--standby-delay)


def describe_exit(returncode: int) -> tuple[int | None, str | None, str]:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:  # real-time signals have no enum member
            name = f"SIG{-returncode}"
        why = "aborted (SIGABRT), as on a Metal out-of-memory" if name == "SIGABRT" else f"killed by {name}"
        return None, name, why
    reasons = {ExitCode.OK: "exited", ExitCode.CONFIG_ERROR: "configuration error",
               ExitCode.LOAD_ERROR: "the model failed to load",
               ExitCode.NO_MEMORY: "not enough memory for even a minimal request",
               ExitCode.UNTRUSTED_STATE: "memory error left untrusted state",
               ExitCode.PROTOCOL_MISMATCH: "protocol version mismatch",
               ExitCode.ENGINE_ERROR: "engine error (a bug, not memory)",
               SPAWN_FAILED: "could not be started"}
    return returncode, None, reasons.get(returncode, f"exited with code {returncode}")


class SupervisorMetrics(Protocol):
    """What a supervisor counts (router/ops/status.py's Metrics has it)."""

    worker_exits: Counter
    worker_restarts: Counter
    worker_state: Enum


class Workers(Protocol):
    """What a supervisor calls on the dispatcher: the links it watches, and the news it
    brings (a worker lost, a control message, a model no worker will serve)."""

    links: dict[int, WorkerLink]

    def worker_lost(self, incarnation: int, why: str, *, died: bool = True) -> bool: ...

    def send_to(self, incarnation: int, msg: Message) -> bool: ...

    def set_unavailable(self, model: str, reason: str | None) -> None: ...


class Supervisor:
    """One worker's life as the router sees it (one per worker: spawned, or external)."""

    def __init__(self, dispatcher: Workers, spawn: SpawnSpec | None, metrics: SupervisorMetrics,
                 clock: Callable[[], float] = time.monotonic, *, model: str = "",
                 incarnation: int | None = None, stall_timeout_s: float = STALL_TIMEOUT_S) -> None:
        self.dispatcher = dispatcher
        self.spawn_spec = spawn
        self.metrics = metrics
        self.clock = clock
        self.model = model              # the catalog alias this worker serves
        self.stall_timeout_s = stall_timeout_s
        self.state = WorkerState.STARTING
        self.reason = "waiting for the worker to start" if spawn else "waiting for a worker to connect"
        self.pid: int | None = None
        # An external worker is adopted by its first hello, or given one by whoever saw it.
        self.incarnation: int | None = incarnation
        self.on_failed: Callable[[Supervisor, str | None], None] = _mark_model_unavailable
        self.num_restarts = 0
        self.last_exit: ExitRecord | None = None
        self.ready_at: float | None = None
        self.last_start_s: float | None = None
        self.last_backoff_s: float | None = None
        self._spawned_at: float | None = None
        self._deaths_after_ready: collections.deque[float] = collections.deque()
        self._deaths_before_ready = 0
        self._consecutive = 0
        self._proc: asyncio.subprocess.Process | None = None
        # When our worker was asked to stop or said it is stopping: from then on its silence
        # is its exit under way, not a hang (no heartbeats to it, no silence verdict), and
        # only a process still there LEAVE_TIMEOUT_S later is killed.
        self._leaving_at: float | None = None
        self._leave_timeout_s = LEAVE_TIMEOUT_S
        self._requested = False        # the coming exit is an operator's restart
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._wake = asyncio.Event()
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []
        self.standby = StandbySlot()

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._monitor_loop(), name="supervisor-monitor"))
        if self.spawn_spec is not None:
            self._tasks.append(asyncio.create_task(self._spawn_loop(), name="supervisor-spawn"))

    async def stop(self, reason: str = "router shutting down") -> None:
        """Stop the worker we spawned (never an external one), TERM then KILL, and wait
        until its process has exited: only then is its memory really back."""
        self._stopping = True
        proc = self._proc
        if proc is not None and proc.returncode is None:
            log.info("[shutdown] stopping worker %d: %s", proc.pid, reason)
            self._terminate(proc, reason)
            try:
                await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                log.warning("[shutdown] worker %d did not stop; killing it", proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.standby.close()
        if self.spawn_spec is not None and self.incarnation is not None:
            self.dispatcher.worker_lost(self.incarnation, reason, died=False)

    @property
    def is_exited(self) -> bool:
        return self._proc is None or self._proc.returncode is not None

    def request_shutdown(self, reason: str) -> None:
        """Ask the worker to finish up and exit."""
        if self.incarnation is not None:
            self.dispatcher.send_to(self.incarnation, Shutdown(incarnation=self.incarnation,
                                                               reason=reason))

    def _terminate(self, proc: asyncio.subprocess.Process, reason: str) -> None:
        """Ask our worker to stop (a Shutdown, and SIGTERM for a loop that is not reading);
        the monitor kills it only if it is still there LEAVE_TIMEOUT_S later."""
        self._leave(LEAVE_TIMEOUT_S)
        self.request_shutdown(reason)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)

    def restart_now(self) -> None:
        """Operator action (SIGHUP, POST /admin/workers/restart): forget the crash history."""
        log.info("operator asked for a worker restart (state %s)", self.state)
        self._deaths_after_ready.clear()
        self._deaths_before_ready = 0
        self._consecutive = 0
        if self.state is WorkerState.FAILED:
            self._set(WorkerState.RESTARTING, "restart requested by an operator")
        if self._proc is not None and self._proc.returncode is None:
            self._requested = True
            self._terminate(self._proc, "restart requested by an operator")
        self._wake.set()

    # -- events ----------------------------------------------------------------------

    def on_hello(self, hello: Hello) -> None:
        if self.incarnation is not None and hello.incarnation != self.incarnation \
                and (self.spawn_spec is not None or self.state is not WorkerState.DOWN):
            return  # another worker's (each supervisor hears every hello)
        self.incarnation = hello.incarnation
        self.pid = hello.pid
        self.ready_at = self.clock()
        if self._spawned_at is not None:
            # mlx import + model load + calibration: what a restart costs before routing.
            self.last_start_s = round(self.ready_at - self._spawned_at, 3)
        self._deaths_before_ready = 0
        self._set(WorkerState.READY, "serving")
        if self.spawn_spec is not None and not self._stopping:
            self.standby.fill(self.spawn_spec.argv, self.spawn_spec.env, self.spawn_spec.standby_delay_s)

    def on_replaced(self, why: str) -> None:
        """An external worker whose peer is gone, replaced by a new one of its model (a
        service manager restarted it): down now rather than after its silence."""
        if self.incarnation is not None and self.state is not WorkerState.DOWN:
            self._lost(self.incarnation, why, WorkerState.DOWN)

    def on_worker_shutdown(self, incarnation: int, reason: str) -> None:
        log.info("worker %d says it is shutting down: %s", incarnation, reason)
        if incarnation != self.incarnation:
            return
        if self.spawn_spec is None:
            self._lost(incarnation, f"worker shut down: {reason}", WorkerState.DOWN)
        elif self._leaving_at is None:
            self._leave(EXIT_TIMEOUT_S)  # its exit follows: wait for it, do not judge silence

    # -- spawned workers -------------------------------------------------------------

    async def _spawn_loop(self) -> None:
        assert self.spawn_spec is not None
        while not self._stopping:
            if self.state is WorkerState.FAILED:
                self._wake.clear()
                await self._wake.wait()
                continue
            returncode = await self._run_once(self.spawn_spec)
            if self._stopping:
                return
            delay = self._after_exit(returncode)
            if delay is not None:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)

    async def _run_once(self, spec: SpawnSpec) -> int:
        self.incarnation = secrets.randbits(62)
        self._stderr_tail.clear()
        self._leaving_at = None
        self._set(WorkerState.STARTING, "loading the model")
        argv = [*spec.argv, "--incarnation", str(self.incarnation)]
        proc = await self.standby.take(argv, spec.env)
        how = "its standby, told to go"
        if proc is None:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv, env=spec.env, stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
                    start_new_session=True)
            except OSError as exc:
                # EAGAIN, EMFILE, an interpreter gone: a start that died, backed off and
                # counted as one (it once ended this loop: the worker "starting" for ever).
                log.error("could not start a worker: %s", exc)
                self._stderr_tail.append(f"could not start the worker: {exc}")
                return SPAWN_FAILED
            how = "a new process"
        self._proc, self.pid = proc, proc.pid
        self._spawned_at = self.clock()
        log.info("spawned worker pid %d (incarnation %d): %s", proc.pid, self.incarnation, how)
        relay = asyncio.create_task(self._relay_stderr(proc))
        returncode = await proc.wait()
        await asyncio.wait([relay], timeout=1.0)
        relay.cancel()
        if proc.stdin is not None:
            proc.stdin.close()
        self._proc = None
        return returncode

    async def _relay_stderr(self, proc: asyncio.subprocess.Process) -> None:
        """Forward the worker's log to ours and keep its tail for /health."""
        assert proc.stderr is not None
        while line := await proc.stderr.readline():
            text = line.decode(errors="replace").rstrip()
            self._stderr_tail.append(text)
            sys.stderr.write(text + "\n")

    def _after_exit(self, returncode: int) -> float | None:
        code, sig, why = describe_exit(returncode)
        self.last_exit = ExitRecord(code, sig, why, time.time(), list(self._stderr_tail))
        # An exit an operator asked for, or a clean one, is not a death of what it ran.
        blamed = self.dispatcher.worker_lost(self.incarnation or -1, why,
                                             died=not (self._requested or returncode == 0))
        self.metrics.worker_exits.labels(cause=sig or str(code)).inc()
        state, delay = self.decide(returncode, was_ready=self.state is WorkerState.READY,
                                   blamed_on_quarantine=blamed, now=self.clock(),
                                   requested=self._requested)
        self._requested = False
        log.warning("worker %s %s; %s", self.pid, why,
                    f"restarting in {delay:.1f}s" if state is WorkerState.RESTARTING else "giving up")
        if state is WorkerState.FAILED:
            self._set(WorkerState.FAILED, f"worker keeps failing: {why}")
            return None
        self.num_restarts += 1
        self.last_backoff_s = delay
        self.metrics.worker_restarts.inc()
        self._set(WorkerState.RESTARTING, why)
        return delay

    def decide(self, returncode: int, *, was_ready: bool, blamed_on_quarantine: bool,
               now: float, requested: bool = False) -> tuple[WorkerState, float]:
        """Restart (with which backoff) or give up. The one place that decides."""
        if returncode > 0 and returncode in ExitCode.PERMANENT:
            return WorkerState.FAILED, 0.0
        if requested:  # an operator's restart is not a death: no backoff, not a crash loop
            return WorkerState.RESTARTING, 0.0
        if self.ready_at is not None and was_ready and now - self.ready_at >= HEALTHY_RESET_S:
            self._consecutive = 0
        if was_ready:
            if not blamed_on_quarantine:
                self._deaths_after_ready.append(now)
            while self._deaths_after_ready and now - self._deaths_after_ready[0] > CRASH_LOOP_WINDOW_S:
                self._deaths_after_ready.popleft()
            if len(self._deaths_after_ready) >= CRASH_LOOP_DEATHS:
                return WorkerState.FAILED, 0.0
        else:
            self._deaths_before_ready += 1
            if self._deaths_before_ready >= STARTUP_DEATHS:
                return WorkerState.FAILED, 0.0
        if blamed_on_quarantine:  # the prompt is to blame, not the worker: no longer backoff
            return WorkerState.RESTARTING, BACKOFF_FIRST_S
        self._consecutive += 1
        # A worker that served and died is replaced at once the first time (its clients are
        # waiting; a second death in a row starts the backoff); one that never got ready
        # waits from the first (the same start would likely fail the same way).
        steps = self._consecutive - (2 if was_ready else 1)
        delay = 0.0 if steps < 0 else min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** steps)
        return WorkerState.RESTARTING, delay

    def _kill(self, why: str) -> None:
        proc = self._proc
        if proc is not None and proc.returncode is None:
            log.warning("killing worker %d: %s", proc.pid, why)
            self._stderr_tail.append(f"[router] SIGKILL: {why}")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

    # -- liveness --------------------------------------------------------------------

    async def _monitor_loop(self) -> None:
        while True:
            await asyncio.sleep(MONITOR_INTERVAL_S)
            if self._leaving_at is not None:
                self._hurry_exit(self._leaving_at)
                continue
            incarnation = self.incarnation
            link = self.dispatcher.links.get(incarnation) if incarnation is not None else None
            if link is None:
                self._check_start()
                continue
            self.dispatcher.send_to(link.incarnation, Heartbeat(incarnation=link.incarnation))
            why = link.liveness.verdict(self.clock(), link.status, self.stall_timeout_s)
            if why is not None:
                self._unresponsive(link.incarnation, why)

    def _check_start(self) -> None:
        """A spawned worker still starting past its deadline is killed (its exit is then
        counted as a start-up death: backed off, and failed at the third)."""
        if self.spawn_spec is None or self.state is not WorkerState.STARTING or self._spawned_at is None \
                or self.is_exited:
            return
        deadline_s = max(START_TIMEOUT_S, 4 * (self.last_start_s or 0.0))
        waited_s = self.clock() - self._spawned_at
        if waited_s > deadline_s:
            self._kill(f"no hello {waited_s:.0f}s after its start (limit {deadline_s:.0f}s)")

    def _leave(self, timeout_s: float) -> None:
        """Our worker is leaving: no new job goes to it, and it has ``timeout_s`` to exit."""
        self._leaving_at, self._leave_timeout_s = self.clock(), timeout_s
        link = self.dispatcher.links.get(self.incarnation) if self.incarnation is not None else None
        if link is not None:
            link.retiring = True

    def _hurry_exit(self, since: float) -> None:
        """A leaving worker is given its time to exit by itself (asked by us: its grace for
        running requests and the exit; having said it is stopping: the exit), then killed."""
        waited_s = self.clock() - since
        if not self.is_exited and waited_s > self._leave_timeout_s:
            self._kill(f"still running {waited_s:.1f}s after it was asked to stop")

    def _unresponsive(self, incarnation: int, why: str) -> None:
        if self.spawn_spec is not None:
            self._kill(why)  # the exit then takes the normal restart path
        else:
            self._lost(incarnation, why, WorkerState.DOWN)

    def _lost(self, incarnation: int, why: str, state: WorkerState) -> None:
        self.last_exit = ExitRecord(None, None, why, time.time())
        self.dispatcher.worker_lost(incarnation, why)
        self._set(state, why)

    def _set(self, state: WorkerState, reason: str) -> None:
        if state is not self.state:
            log.info("worker state %s → %s: %s", self.state, state, reason)
        was_failed = self.state is WorkerState.FAILED
        self.state, self.reason = state, reason
        if state is WorkerState.FAILED:
            self.on_failed(self, f"the worker has failed: {reason}; an operator must restart "
                                 "it (SIGHUP or POST /admin/workers/restart)")
        elif was_failed:
            self.on_failed(self, None)
        self.metrics.worker_state.state(state.value)

    def describe(self) -> dict[str, Any]:
        return {"model": self.model, "state": self.state.value, "reason": self.reason, "pid": self.pid,
                "incarnation": self.incarnation, "restarts": self.num_restarts,
                "mode": "spawn" if self.spawn_spec else "external",
                "last_start_s": self.last_start_s,
                "standby_pid": self.standby.pid,
                "last_backoff_s": self.last_backoff_s,
                "last_exit": self.last_exit.to_dict() if self.last_exit else None}


def _mark_model_unavailable(sup: Supervisor, reason: str | None) -> None:
    """The default for one worker per model: its failure makes the model unavailable."""
    sup.dispatcher.set_unavailable(sup.model, reason)
