"""The ZeroMQ socket to workers: frames in and out, bad frames counted.

The router binds one ROUTER socket; every worker connects with DEALER sockets (a main one
and a heartbeat one), so one socket serves any number of workers. Decoded messages go to
one callback with the sender's identity, given by whoever starts the channel; what they
mean is the dispatcher's business.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

import zmq
from prometheus_client import Counter

from common.errors import ConfigError, ProtocolError
from common.protocol import MAX_FRAME_BYTES, PROTOCOL_VERSION, Message, decode, encode, peek_hello

log = logging.getLogger(__name__)

# Most frames handled per wakeup before yielding to the HTTP side.
MAX_DRAIN = 256


class ChannelMetrics(Protocol):
    """What the channel counts (router/ops/status.py's Metrics has it)."""

    bad_frames: Counter


class SocketGuard(Protocol):
    """Secures the socket before it binds, and stops with it (CURVE: router/ops/curve_server.py)."""

    def secure(self, ctx: zmq.Context, sock: zmq.Socket) -> None: ...

    async def stop(self, sock: zmq.Socket) -> None: ...


class Channel:
    """The router's socket. ``on_message(identity, msg)``, given to ``start``, gets every
    well-formed frame."""

    def __init__(self, addr: str, metrics: ChannelMetrics, curve: SocketGuard | None = None) -> None:
        self.addr = addr
        self.metrics = metrics
        self.on_message: Callable[[bytes, Message], None] = lambda identity, msg: None
        self.curve = curve
        self.num_bad_frames = 0
        self.refused: dict[str, Any] | None = None  # the last worker refused for its version
        self._failing: set[bytes] = set()  # workers whose last send failed (warned once)
        # A plain (synchronous) socket read from the event loop's reader callback: no
        # Future per message or per wakeup on the token path, and a failed send raises
        # here instead of in a Future nobody awaits.
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._sock.setsockopt(zmq.SNDHWM, 10_000)
        self._sock.setsockopt(zmq.RCVHWM, 10_000)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_scheduled = False

    async def start(self, on_message: Callable[[bytes, Message], None]) -> None:
        self.on_message = on_message
        if self.curve is not None:
            self.curve.secure(self._ctx, self._sock)
        elif self.addr.startswith("tcp://"):  # config refuses it too; never bind it open
            raise ConfigError(f"refusing to bind {self.addr} without CURVE keys")
        self._sock.bind(self.addr)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.FD, self._on_readable)
        self._on_readable()  # anything that arrived before the reader was registered

    async def stop(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._sock.FD)
        if self.curve is not None:
            await self.curve.stop(self._sock)
        self.close()

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()

    def send(self, identity: bytes, msg: Message) -> bool:
        """Send one message to one worker; False (logged) when it cannot be delivered."""
        try:
            self._sock.send_multipart([identity, encode(msg)], zmq.NOBLOCK)
            self._failing.discard(identity)
            return True
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY) or queue full
            # Once per worker until a send gets through again: a worker that exited is sent
            # a heartbeat every 250 ms until the supervisor has seen it go.
            level = logging.DEBUG if identity in self._failing else logging.WARNING
            self._failing.add(identity)
            log.log(level, "send %s to worker %s failed: %s", msg.type,
                    identity.decode(errors="replace"), exc)
            return False
        finally:
            self._check_readable()

    # -- input -----------------------------------------------------------------------

    def _on_readable(self) -> None:
        """Drain what is waiting, a bounded batch at a time so the loop is never starved.

        ZeroMQ's FD is edge-triggered: it signals once for a batch and again only after
        the socket was read dry (or its EVENTS were read), so a drain that stops early
        schedules itself again, and a send checks EVENTS (``_check_readable``).
        """
        self._drain_scheduled = False
        for _ in range(MAX_DRAIN):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                log.error("router socket error: %s", exc)
                return
            self._on_frames(frames)
        self._schedule_drain()

    def _check_readable(self) -> None:
        try:
            readable = bool(self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)
        except zmq.ZMQError:
            return
        if readable:
            self._schedule_drain()

    def _schedule_drain(self) -> None:
        if self._loop is not None and not self._drain_scheduled:
            self._drain_scheduled = True
            self._loop.call_soon(self._on_readable)

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.count_bad("wrong number of frames")
            return
        identity, payload = frames
        try:
            msg = decode(payload)
        except ProtocolError as exc:
            self.count_bad(exc.message)
            self._note_mismatch(payload)
            return
        try:
            self.on_message(identity, msg)
        except Exception:  # a bug in one handler must not end the receive loop
            log.exception("error handling a %s message", msg.type)

    def _note_mismatch(self, frame: bytes) -> None:
        """A worker speaking another protocol version is refused, and shown in /health."""
        hello = peek_hello(frame)
        if hello is None or hello.get("v") == PROTOCOL_VERSION:
            return
        if self.refused != hello:
            log.error("refused a worker (pid %s, version %s) speaking protocol %s; this router "
                      "speaks %d: upgrade one of them", hello.get("pid"),
                      hello.get("package_version"), hello.get("v"), PROTOCOL_VERSION)
        self.refused = hello

    def count_bad(self, why: str) -> None:
        self.num_bad_frames += 1
        self.metrics.bad_frames.inc()
        log.warning("dropped a bad frame from a worker (%d so far): %s", self.num_bad_frames, why)
