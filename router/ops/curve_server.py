"""The router's side of a CURVE worker link: encryption, and only authorized workers in.

The router's socket is a CURVE server; a ZAP handler admits a connecting worker only if
its public key is one of ``--curve-authorized-keys`` (or the router's own, which a worker
the router spawns uses). A peer with no key, the wrong server key or an unknown key fails
the handshake inside libzmq: not one of its frames reaches the dispatcher. Failed
handshakes are counted (``headroom_refused_handshakes_total``) from the socket's monitor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Protocol

import zmq
import zmq.asyncio
from prometheus_client import Counter
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils.monitor import parse_monitor_message

from common.curve import ServerKeys

log = logging.getLogger(__name__)

REFUSALS = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "unknown_key",
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no_detail"}
# A refused peer retries every few seconds: log the first refusal, then one a minute.
LOG_EVERY_S = 60.0


class CurveMetrics(Protocol):
    """What the CURVE server counts (router/ops/status.py's Metrics has it)."""

    refused_handshakes: Counter


class _AllowList:
    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


class CurveServer:
    """Secure one ROUTER socket: keys, the ZAP allow-list, and the refusal counter."""

    def __init__(self, keys: ServerKeys, metrics: CurveMetrics) -> None:
        self.keys = keys.own
        self.authorized = keys.authorized | {keys.own.public}
        self.metrics = metrics
        self.num_refused = 0
        self._auth: AsyncioAuthenticator | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._logged_at = -LOG_EVERY_S

    def secure(self, ctx: zmq.Context, sock: zmq.Socket) -> None:
        """Call before ``bind``, from the event loop."""
        # The ZAP handler and the monitor must live in the socket's own libzmq context
        # (both are inproc endpoints); an asyncio shadow of it lets them run on the loop.
        actx = zmq.asyncio.Context.shadow(ctx.underlying)
        self._auth = AsyncioAuthenticator(actx)
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=_AllowList(self.authorized))
        sock.curve_server = True
        sock.curve_publickey = self.keys.public
        sock.curve_secretkey = self.keys.secret
        addr = f"inproc://headroom-curve-monitor-{id(self)}"
        sock.monitor(addr, sum(REFUSALS))
        self._monitor = actx.socket(zmq.PAIR)
        self._monitor.connect(addr)
        self._task = asyncio.create_task(self._watch(), name="curve-monitor")

    async def _watch(self) -> None:
        assert self._monitor is not None
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            reason = REFUSALS.get(event["event"])
            if reason is None:
                continue
            self.num_refused += 1
            self.metrics.refused_handshakes.labels(reason=reason).inc()
            now = time.monotonic()
            if now - self._logged_at >= LOG_EVERY_S:
                self._logged_at = now
                log.warning("refused a worker connection (%s): it lacks the right CURVE keys "
                            "(%d refused so far)", reason, self.num_refused)

    async def stop(self, sock: zmq.Socket) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._monitor is not None:
            self._monitor.close(0)
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
        if self._auth is not None:
            self._auth.stop()
