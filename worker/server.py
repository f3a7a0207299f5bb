"""The worker's ZeroMQ loop around its core: frames in → ``WorkerCore`` → frames out.

Every decision (admission, steps, error triage, the OOM guard, what to publish) is the
core's (``worker/core.py``), which has no socket; this module moves frames, handles
signals, re-sends hello to a router that restarted, and shuts down.

The main thread owns the core and the main DEALER socket. The heartbeat thread owns
its own socket (ZeroMQ sockets are not thread-safe) and reports the step counter, so a
wedged engine loop is visible to the router as a counter that stops while work waits.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from common.curve import ClientKeys
from common.errors import ProtocolError
from common.protocol import (
    ExitCode, Heartbeat, Hello, Message, Shutdown, decode, encode, MAX_FRAME_BYTES,
)
from worker.core import CoreOptions, WorkerCore
from worker.engine import Engine
from worker.memory import MemoryState
from worker.prefix_cache import CacheTiers

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
IDLE_POLL_MS = 50
# While only grammars compile (nothing steps), how often the loop looks at them.
COMPILE_POLL_MS = 2
# Without a router heartbeat for this long, re-send hello (the router may have restarted).
HELLO_RETRY_S = 2.0
# On SIGTERM, let running requests finish for this long before failing them.
SHUTDOWN_GRACE_S = 10.0
# At exit, the disk tier's queued writes get about this long (the writer's queue and its
# thread are each waited on up to this, so twice at worst); what is left is not written (a
# restart then serves those prompts cold). With nothing queued, the exit takes milliseconds.
EXIT_WRITES_S = 1.0
# After the router is gone, give the loop this long to exit on its own.
ORPHAN_EXIT_S = 5.0
# llguidance's tokenizer is built once the engine has been idle this long after the worker
# started serving: the build holds the GIL for up to 0.8 s at a time (a 152k vocabulary,
# 2.7 s in all here), which beside running requests would stall the loop between steps.
GRAMMAR_PREPARE_IDLE_S = 1.0


@dataclass(frozen=True, slots=True)
class ServerOptions:
    router_addr: str
    incarnation: int
    oom_guard: str              # abort | raise | off (resolved)
    admission: bool
    max_running: int
    vocab_size: int
    wedge_after_steps: int | None = None
    grow_scale_on_signal: float | None = None   # test hook: SIGUSR1 grows the scale by this
    curve: ClientKeys | None = None     # CURVE keys for a tcp:// router


def make_socket(ctx: zmq.Context, addr: str, identity: bytes,
                curve: ClientKeys | None = None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    if curve is not None:
        curve.apply(sock)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    sock.setsockopt(zmq.SNDHWM, 10_000)
    sock.setsockopt(zmq.RCVHWM, 10_000)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
    sock.connect(addr)
    return sock


class HeartbeatThread(threading.Thread):
    """Sends the step counter every HEARTBEAT_INTERVAL_S from its own socket."""

    def __init__(self, ctx: zmq.Context, server: WorkerServer) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self._ctx = ctx
        self._server = server
        self.stopped = threading.Event()

    def run(self) -> None:
        opts = self._server.opts
        sock = make_socket(self._ctx, opts.router_addr, f"w{opts.incarnation}-hb".encode(), opts.curve)
        try:
            while not self.stopped.wait(HEARTBEAT_INTERVAL_S):
                engine = self._server.engine
                beat = Heartbeat(incarnation=opts.incarnation, step=engine.num_steps,
                                 has_work=engine.has_work)
                try:
                    sock.send(encode(beat), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # router away; the next beat tries again
        finally:
            sock.close(0)


class WorkerServer:
    """Receive frames for the core, run its steps, send what it publishes."""

    def __init__(self, opts: ServerOptions, engine: Engine, memory: MemoryState, hello: Hello,
                 clock: Callable[[], float] = time.monotonic, cache: CacheTiers | None = None) -> None:
        self.opts = opts
        self.hello = hello
        self.core = WorkerCore(CoreOptions(incarnation=opts.incarnation, oom_guard=opts.oom_guard,
                                           admission=opts.admission, max_running=opts.max_running,
                                           vocab_size=opts.vocab_size), engine, memory, clock, cache)
        self.ctx = zmq.Context()
        self.sock = make_socket(self.ctx, opts.router_addr, f"w{opts.incarnation}".encode(), opts.curve)
        self.heartbeat = HeartbeatThread(self.ctx, self)
        self._router_seen_at = 0.0
        self._hello_sent_at = 0.0
        self._grow_scale = False
        self._idle_since: float | None = None  # the engine has had no work since (None: it has)
        self._grammars_prepared = engine.grammars is None

    @property
    def engine(self) -> Engine:
        return self.core.engine

    @property
    def stop_reason(self) -> str | None:
        return self.core.stop_reason

    @stop_reason.setter
    def stop_reason(self, why: str | None) -> None:
        self.core.stop_reason = why

    # -- lifecycle -------------------------------------------------------------------

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        if self.opts.grow_scale_on_signal:
            signal.signal(signal.SIGUSR1, self._on_grow_signal)
        self.say_hello()
        self.heartbeat.start()
        log.info("worker %d (incarnation %d) serving", os.getpid(), self.opts.incarnation)
        while self.stop_reason is None:
            self.loop_once()
        return self.shutdown()

    def loop_once(self) -> None:
        """Input, step, publish."""
        core = self.core
        started = time.perf_counter()
        busy = core.engine.has_work
        self.receive(timeout_ms=0 if busy else COMPILE_POLL_MS if core.is_compiling else IDLE_POLL_MS)
        if not busy:
            started = time.perf_counter()  # an idle poll's wait is not the loop's work
        if self._grow_scale and self.opts.grow_scale_on_signal:
            self._grow_scale = False
            core.grow_scale(self.opts.grow_scale_on_signal)
        out = core.step(started)
        sent_at = time.perf_counter()
        self.send_all(out)
        if core.stepped:
            core.timing.busy_s += time.perf_counter() - sent_at
        core.published()
        self._hello_again()
        self._prepare_grammars_when_idle(busy or core.engine.has_work)
        if self.opts.wedge_after_steps is not None and core.timing.steps >= self.opts.wedge_after_steps:
            self._wedge()

    def _prepare_grammars_when_idle(self, busy: bool) -> None:
        """Once, when the engine has been idle GRAMMAR_PREPARE_IDLE_S: the first grammar
        then finds llguidance's tokenizer built (one that comes sooner builds it itself)."""
        if self._grammars_prepared:
            return
        now = time.monotonic()
        if busy or self._idle_since is None:
            self._idle_since = None if busy else now
        elif now - self._idle_since >= GRAMMAR_PREPARE_IDLE_S and self.engine.grammars is not None:
            self.engine.grammars.prepare()
            self._grammars_prepared = True

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only set a flag: the loop notices it at the next step boundary.
        self.stop_reason = f"signal {signal.Signals(signum).name}"

    def _on_grow_signal(self, signum: int, frame: Any) -> None:
        self._grow_scale = True

    def on_parent_gone(self) -> None:
        """Called from the stdin watcher thread when the spawning router's pipe closes."""
        self.stop_reason = "router gone"
        threading.Timer(ORPHAN_EXIT_S, os._exit, args=(ExitCode.OK,)).start()

    def shutdown(self) -> int:
        core = self.core
        log.info("[shutdown] worker %d: %s", os.getpid(), self.stop_reason)
        at = [time.monotonic()]
        grace = 0 if core.broken or self.stop_reason == "router gone" else SHUTDOWN_GRACE_S
        deadline = at[0] + grace
        while core.engine.has_work and time.monotonic() < deadline:
            started = time.perf_counter()
            self.receive(timeout_ms=0)
            self.send_all(core.step(started))
        core.stop_all()
        self.send(Shutdown(incarnation=self.opts.incarnation, reason=self.stop_reason or ""))
        at.append(time.monotonic())
        self.heartbeat.stopped.set()
        if core.cache is not None:  # queued writes get a bounded share of the exit's time
            core.cache.close(EXIT_WRITES_S)
        at.append(time.monotonic())
        self.heartbeat.join(timeout=1.0)  # its socket must close before the context ends
        self.sock.close(0)
        self.ctx.term()
        at.append(time.monotonic())
        log.info("[shutdown] done in %.3f s (running requests %.3f s, prompt cache %.3f s, sockets %.3f s)",
                 at[-1] - at[0], *(b - a for a, b in zip(at, at[1:])))
        return core.exit_code

    def _wedge(self) -> None:
        log.warning("test flag: wedging the engine loop after %d serving steps", self.core.timing.steps)
        while True:  # a deliberately hung loop; only a signal ends it
            time.sleep(1)

    # -- input -----------------------------------------------------------------------

    def receive(self, timeout_ms: int) -> None:
        if timeout_ms and not self.sock.poll(timeout_ms, zmq.POLLIN):
            return
        # Asking the socket first: a recv that raises zmq.Again on every busy step costs an
        # exception per token (it showed in py-spy's samples of the loop on the H200).
        while self.sock.get(zmq.EVENTS) & zmq.POLLIN:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.core.received_at = time.perf_counter()
            try:
                msg = decode(frame)
            except ProtocolError as exc:
                self.core.num_bad_frames += 1
                log.warning("dropped a bad frame (%d so far): %s", self.core.num_bad_frames, exc.message)
                continue
            if msg.incarnation != self.opts.incarnation:
                continue  # meant for an earlier incarnation of this worker
            self.handle(msg)

    def handle(self, msg: Message) -> None:
        if isinstance(msg, Shutdown):
            self.stop_reason = "asked by router" + (f": {msg.reason}" if msg.reason else "")
        elif isinstance(msg, Heartbeat):
            self._router_seen_at = time.monotonic()
        else:
            self.send_all(self.core.handle(msg))

    # -- output ----------------------------------------------------------------------

    def _hello_again(self) -> None:
        now = time.monotonic()
        if now - self._router_seen_at > HELLO_RETRY_S and now - self._hello_sent_at > HELLO_RETRY_S:
            self.say_hello()  # a router that restarted does not know us yet

    def say_hello(self) -> None:
        self._hello_sent_at = time.monotonic()
        self.send(self.hello)
        self.send_all(self.core.status(force=True))

    def send_all(self, messages: list[Message]) -> None:
        for msg in messages:
            self.send(msg)

    def send(self, msg: Message) -> None:
        try:
            self.sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("router not reachable; dropped a %s message", msg.type)
