"""The worker's ZeroMQ loop: input → step → publish, plus the heartbeat thread and OOM guard.

The main thread owns the engine and the main DEALER socket. The heartbeat thread owns
its own socket (ZeroMQ sockets are not thread-safe) and reports the step counter, so a
wedged engine loop is visible to the router as a counter that stops while work waits.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from common import costmodel
from common.curve import ClientKeys
from common.errors import ProtocolError
from common.protocol import (
    Cancel, ExitCode, FinishReason, Generate, Heartbeat, Hello, Reject, RejectReason,
    Shutdown, Status, Tokens, decode, encode, MAX_FRAME_BYTES,
)
from worker.engine import Engine, Output
from worker.pacer import ChunkPacer
from worker.memory import MemoryState, pressure_action

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
STATUS_INTERVAL_S = 0.25
IDLE_POLL_MS = 50
# A step's prefill work is sized to take about this long: short enough that decode keeps
# flowing beside a long prompt and that no healthy step nears the router's stall timeout.
STEP_BUDGET_S = 0.5
# When a step's peak exceeds its prediction, grow the model by the overshoot and this margin.
CALIBRATION_GROWTH = 1.05
# A caught memory error grows the model by this much (the step never finished: no measure).
CAUGHT_ERROR_GROWTH = 1.25
# This many caught errors within the window and the worker exits to be restarted clean.
CAUGHT_ERRORS_TO_EXIT = 3
CAUGHT_ERROR_WINDOW_S = 60.0
# Without a router heartbeat for this long, re-send hello (the router may have restarted).
HELLO_RETRY_S = 2.0
# On SIGTERM, let running requests finish for this long before failing them.
SHUTDOWN_GRACE_S = 10.0
# After the router is gone, give the loop this long to exit on its own.
ORPHAN_EXIT_S = 5.0


@dataclass(frozen=True, slots=True)
class ServerOptions:
    router_addr: str
    incarnation: int
    oom_guard: str              # abort | raise | off (resolved)
    admission: bool
    max_running: int
    vocab_size: int
    wedge_after_steps: int | None = None
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
    """Receive and handle messages, step the engine, publish outputs and status."""

    def __init__(self, opts: ServerOptions, engine: Engine, memory: MemoryState, hello: Hello) -> None:
        self.opts = opts
        self.engine = engine
        self.memory = memory
        self.hello = hello
        self.ctx = zmq.Context()
        self.sock = make_socket(self.ctx, opts.router_addr, f"w{opts.incarnation}".encode(), opts.curve)
        self.heartbeat = HeartbeatThread(self.ctx, self)
        self.stop_reason: str | None = None
        self.num_bad_frames = 0
        self._status_sent_at = 0.0
        self._changed = False
        self._router_seen_at = 0.0
        self._hello_sent_at = 0.0
        self._worst_step_s = 0.0
        self._last_totals: list[int] = []
        self.under_pressure = False
        self._caught_errors: list[float] = []
        self.exit_code = ExitCode.OK
        self.pacer = ChunkPacer(STEP_BUDGET_S, memory.model.prefill_step_tokens)
        self.chunk_tokens = memory.model.prefill_step_tokens

    # -- lifecycle -------------------------------------------------------------------

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.say_hello()
        self.heartbeat.start()
        log.info("worker %d (incarnation %d) serving", os.getpid(), self.opts.incarnation)
        while self.stop_reason is None:
            self.loop_once()
        return self.shutdown()

    def loop_once(self) -> None:
        self.receive(timeout_ms=0 if self.engine.has_work else IDLE_POLL_MS)
        outputs = self.relieve_pressure()
        outputs += self.step()
        self.publish(outputs)
        if self.opts.wedge_after_steps is not None and self.engine.num_steps >= self.opts.wedge_after_steps:
            self._wedge()

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only set a flag: the loop notices it at the next step boundary.
        self.stop_reason = f"signal {signal.Signals(signum).name}"

    def on_parent_gone(self) -> None:
        """Called from the stdin watcher thread when the spawning router's pipe closes."""
        self.stop_reason = "router gone"
        threading.Timer(ORPHAN_EXIT_S, os._exit, args=(ExitCode.OK,)).start()

    def shutdown(self) -> int:
        log.info("[shutdown] worker %d: %s", os.getpid(), self.stop_reason)
        deadline = time.monotonic() + (SHUTDOWN_GRACE_S if self.stop_reason != "router gone" else 0)
        while self.engine.has_work and time.monotonic() < deadline:
            self.receive(timeout_ms=0)
            self.publish(self.step())
        failed = self.engine.cancel_all()
        if failed:
            self.send_outputs([Output(rid, [], FinishReason.ERROR) for rid in failed])
        self.send(Shutdown(incarnation=self.opts.incarnation, reason=self.stop_reason or ""))
        self.heartbeat.stopped.set()
        self.sock.close(0)
        self.ctx.term()
        return self.exit_code

    def _wedge(self) -> None:
        log.warning("test flag: wedging the engine loop after %d steps", self.engine.num_steps)
        while True:  # a deliberately hung loop; only a signal ends it
            time.sleep(1)

    # -- input -----------------------------------------------------------------------

    def receive(self, timeout_ms: int) -> None:
        if timeout_ms and not self.sock.poll(timeout_ms, zmq.POLLIN):
            return
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(frame)
            except ProtocolError as exc:
                self.num_bad_frames += 1
                log.warning("dropped a bad frame (%d so far): %s", self.num_bad_frames, exc.message)
                continue
            if msg.incarnation != self.opts.incarnation:
                continue  # meant for an earlier incarnation of this worker
            self.handle(msg)

    def handle(self, msg: Any) -> None:
        if isinstance(msg, Generate):
            self.admit(msg)
        elif isinstance(msg, Cancel):
            if self.engine.cancel(msg.request_id):
                self._changed = True
                log.debug("cancelled %s", msg.request_id)
        elif isinstance(msg, Shutdown):
            self.stop_reason = "asked by router" + (f": {msg.reason}" if msg.reason else "")
        elif isinstance(msg, Heartbeat):
            self._router_seen_at = time.monotonic()

    def admit(self, msg: Generate) -> None:
        """The worker is authoritative: it takes only what it has room for."""
        reject = self._check(msg)
        if reject is not None:
            self.send(reject)
            return
        self.engine.add(msg.request_id, msg.prompt_ids, max_tokens=msg.max_tokens,
                        temperature=msg.temperature, top_p=msg.top_p, seed=msg.seed,
                        ignore_eos=msg.ignore_eos)
        self._changed = True
        log.debug("admitted %s: %d prompt tokens, max_tokens %d",
                  msg.request_id, len(msg.prompt_ids), msg.max_tokens)

    def _check(self, msg: Generate) -> Reject | None:
        def reject(reason: RejectReason, text: str, needed: int = 0) -> Reject:
            return Reject(incarnation=self.opts.incarnation, request_id=msg.request_id,
                          reason=reason, message=text, needed_bytes=needed,
                          max_request_tokens=costmodel.max_request_tokens(self.memory.model))

        n, vocab = len(msg.prompt_ids), self.opts.vocab_size
        if n == 0 or msg.max_tokens <= 0 or msg.request_id in self.engine.running:
            return reject(RejectReason.BAD_REQUEST, "empty prompt, bad max_tokens or duplicate id")
        if min(msg.prompt_ids) < 0 or max(msg.prompt_ids) >= vocab:
            return reject(RejectReason.BAD_REQUEST, f"token ids must be in [0, {vocab})")
        if n + msg.max_tokens > self.memory.model.context_length:
            return reject(RejectReason.NEVER_FITS, "prompt + max_tokens exceed the context")
        if len(self.engine.running) >= self.opts.max_running:
            return reject(RejectReason.NOT_NOW, "running cap reached")
        if self.under_pressure:
            return reject(RejectReason.NOT_NOW, "memory taken by another process")
        if not self.opts.admission:
            return None
        m = self.memory.model
        if costmodel.never_fits(m, n, msg.max_tokens):
            return reject(RejectReason.NEVER_FITS, "does not fit even on an idle worker",
                          costmodel.request_cost_bytes(m, n, msg.max_tokens))
        fits, worst = self._fits(n, msg.max_tokens)
        if not fits and self.memory.last is not None and self.memory.last.cache_bytes > 0:
            # The buffer cache is reclaimable, not lost: clear it before saying "no room".
            self.memory.probe.clear_cache()
            fits, worst = self._fits(n, msg.max_tokens)
        if not fits:
            log.debug("not now: %s needs a batch worst case of %d bytes", msg.request_id, worst)
            return reject(RejectReason.NOT_NOW, "no room now", worst)
        self.memory.reserved_bytes = worst
        return None

    def _fits(self, prompt_tokens: int, max_tokens: int) -> tuple[bool, int]:
        return costmodel.fits_now(self.memory.model, self.engine.totals(), prompt_tokens, max_tokens,
                                  self.engine.num_prefilling(), self._free_bytes())

    def _free_bytes(self) -> int:
        """Live headroom minus what is promised to running rows but not yet allocated."""
        self.memory.refresh()
        r = self.memory.last
        assert r is not None
        allocated = max(0, r.active_bytes - self.memory.weights_bytes - self.memory.baseline_bytes)
        promised = max(0, self.memory.reserved_bytes - allocated)
        return self.memory.headroom_bytes() - promised

    # -- step ------------------------------------------------------------------------

    def relieve_pressure(self) -> list[Output]:
        """Memory shrank under running work: stop admitting, shrink the chunk, then evict."""
        mem = self.memory
        if not self.opts.admission or not self.engine.has_work:
            self.under_pressure = False
            return []
        mem.refresh()
        r = mem.last
        assert r is not None
        allocated = max(0, r.active_bytes - mem.weights_bytes - mem.baseline_bytes)
        action = pressure_action(mem.model, headroom_bytes=mem.headroom_bytes(),
                                 reserved_bytes=mem.reserved_bytes, allocated_bytes=allocated,
                                 running_totals=self.engine.totals(), chunk_tokens=self.chunk_tokens)
        if not action.admit and r.cache_bytes:
            mem.probe.clear_cache()  # reclaimable: try that before anything drastic
            return []
        if action.admit != (not self.under_pressure):
            log.warning("memory pressure %s: headroom %d B, reserved %d B, allocated %d B",
                        "ended" if action.admit else "began", mem.headroom_bytes(),
                        mem.reserved_bytes, allocated)
        self.under_pressure = not action.admit
        if self.under_pressure:
            self.engine.set_prefill_step(action.chunk_tokens)
            self.chunk_tokens = action.chunk_tokens
        evicted = list(self.engine.running)[len(self.engine.running) - action.evict:] if action.evict else []
        for request_id in evicted:
            log.warning("evicting %s: memory taken by another process", request_id)
            self.engine.cancel(request_id)
        if evicted:
            self._rebase_reservation()
            self._changed = True
        return [Output(rid, [], FinishReason.EVICTED) for rid in evicted]

    def step(self) -> list[Output]:
        if not self.engine.has_work:
            return []
        self.memory.probe.reset_peak()
        self._size_chunk()
        predicted = self._predicted_step_bytes()
        prefilled = self.engine.num_prefilled_tokens()
        started = time.monotonic()
        try:
            outputs = self.engine.step()
            self._calibrate(predicted)
            self._guard()
        except RuntimeError as exc:  # what MLX >= 0.32 raises for a Metal OOM
            return self._recover(exc)
        elapsed = time.monotonic() - started
        self._worst_step_s = max(self._worst_step_s, elapsed)
        self.pacer.observe(self.engine.num_prefilled_tokens() - prefilled, elapsed)
        if any(o.finish_reason is not None for o in outputs):
            self._changed = True
            self._rebase_reservation()
        return outputs

    def _size_chunk(self) -> None:
        """The next prefill chunk: within the step-time budget and, with admission, memory."""
        rows = self.engine.prefill_rows()
        if rows == 0 or self.under_pressure:
            return
        chunk = self.pacer.chunk(rows, self.engine.longest_prefill_left())
        if self.opts.admission:
            free = max(0, self.memory.model.budget_bytes - self.memory.reserved_bytes)
            context = max(self.engine.totals(), default=chunk)
            chunk = min(chunk, costmodel.safe_prefill_chunk(self.memory.model, free, context, rows))
        self.engine.set_prefill_step(chunk)
        self.chunk_tokens = chunk

    def _predicted_step_bytes(self) -> int:
        """The cost model's bound for this step's peak above weights and baseline.

        Rows that finished last step are still being copied out of the batch cache in this
        one (mlx-lm filters lazily), so the previous step's batch is charged too.
        """
        m = self.memory.model
        totals, previous = self.engine.totals(), self._last_totals
        self._last_totals = totals
        if not totals:
            return 0
        rows = self.engine.prefill_rows()
        now = costmodel.batch_cost_bytes(m, len(totals), max(totals),
                                         self.chunk_tokens if rows else 0, rows, max(totals))
        before = costmodel.batch_cost_bytes(m, len(previous), max(previous), 0, 0, 0) if previous else 0
        return max(now, before)

    def _calibrate(self, predicted: int) -> None:
        """Keep the cost model honest: a step above its prediction grows the model."""
        if predicted <= 0:
            return
        mem = self.memory
        measured = mem.probe.step_peak() - mem.weights_bytes - mem.baseline_bytes
        ratio = measured / predicted
        mem.worst_measured_over_predicted = max(mem.worst_measured_over_predicted, ratio)
        if ratio > 1.0:
            old = mem.model.scale
            mem.model = dataclasses.replace(mem.model, scale=old * ratio * CALIBRATION_GROWTH)
            self._changed = True
            log.warning("step peak %d B above the predicted %d B (x%.2f): cost model scale "
                        "%.3f -> %.3f", measured, predicted, ratio, old, mem.model.scale)
        elif log.isEnabledFor(logging.DEBUG):
            log.debug("step %d: peak %d B, predicted %d B (x%.2f)", self.engine.num_steps,
                      measured, predicted, ratio)

    def _guard(self) -> None:
        """--oom-guard: make a peak above the limit as fatal as Metal makes it."""
        if self.opts.oom_guard == "off":
            return
        peak = self.memory.probe.step_peak()
        limit = self.memory.probe.limit_bytes
        if peak <= limit:
            return
        reason = f"OOM guard: step peak {peak} bytes above the limit {limit} bytes"
        if self.opts.oom_guard == "abort":
            print(f"mlx-worker: {reason}; aborting as Metal would", file=sys.stderr, flush=True)
            os.abort()
        # As MLX >= 0.32 does on Metal: a RuntimeError at the next sync point.
        raise RuntimeError(f"[METAL] Command buffer execution failed: {reason}")

    def _recover(self, exc: BaseException) -> list[Output]:
        """A caught memory error: fail the running requests, drop their caches, clear the
        MLX cache, grow the cost model, report it; exit for a restart if it keeps happening
        (the step's outputs could not be trusted, and neither can state that keeps failing)."""
        log.error("engine step failed (%s); failing %d running requests", exc, len(self.engine.running))
        failed = self.engine.cancel_all()
        self.memory.probe.clear_cache()
        self.memory.reserved_bytes = 0
        mem = self.memory
        if self.opts.admission:  # admitted work overshot: the model was too optimistic
            mem.model = dataclasses.replace(mem.model, scale=mem.model.scale * CAUGHT_ERROR_GROWTH)
            log.warning("cost model scale grown to %.3f after a caught memory error", mem.model.scale)
        now = time.monotonic()
        if self.opts.admission:  # without admission, overshooting is what was asked for
            self._caught_errors = [t for t in self._caught_errors if now - t < CAUGHT_ERROR_WINDOW_S] + [now]
        if len(self._caught_errors) >= CAUGHT_ERRORS_TO_EXIT:
            self.stop_reason = (f"{len(self._caught_errors)} caught memory errors in "
                                f"{CAUGHT_ERROR_WINDOW_S:.0f}s: state no longer trusted")
            self.exit_code = ExitCode.UNTRUSTED_STATE
        self._changed = True
        return [Output(rid, [], FinishReason.ERROR) for rid in failed]

    def _rebase_reservation(self) -> None:
        totals = self.engine.totals()
        m = self.memory.model
        self.memory.reserved_bytes = (
            costmodel.batch_cost_bytes(m, len(totals), max(totals), 0, 0, 0) if totals else 0)

    # -- publish ---------------------------------------------------------------------

    def publish(self, outputs: list[Output]) -> None:
        if outputs:
            self.send_outputs(outputs)
        self.publish_status()
        now = time.monotonic()
        if now - self._router_seen_at > HELLO_RETRY_S and now - self._hello_sent_at > HELLO_RETRY_S:
            self.say_hello()  # a router that restarted does not know us yet

    def say_hello(self) -> None:
        self._hello_sent_at = time.monotonic()
        self.send(self.hello)
        self.publish_status(force=True)

    def send_outputs(self, outputs: list[Output]) -> None:
        rows = [[o.request_id, o.token_ids, o.finish_reason] for o in outputs]
        self.send(Tokens(incarnation=self.opts.incarnation, step=self.engine.num_steps, outputs=rows))

    def publish_status(self, force: bool = False) -> None:
        now = time.monotonic()
        if not (force or self._changed or now - self._status_sent_at >= STATUS_INTERVAL_S):
            return
        self._changed = False
        self._status_sent_at = now
        report = self.memory.report(running=len(self.engine.running), max_running=self.opts.max_running)
        report["step"] = self.engine.num_steps
        report["bad_frames"] = self.num_bad_frames
        report["worst_step_s"] = round(self._worst_step_s, 4)
        report["safe_prefill_chunk"] = self.chunk_tokens
        self.send(Status(incarnation=self.opts.incarnation, report=report))

    def send(self, msg: Any) -> None:
        try:
            self.sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("router not reachable; dropped a %s message", msg.type)
