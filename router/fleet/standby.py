"""A standby worker process, kept by a supervisor so that a restart skips the imports.

The supervisor spawns ``python -m worker --standby ARGS`` once its worker has been ready for
``STANDBY_AFTER_S`` (never beside a worker still starting or compiling for its first
requests, which it would slow on a small machine); the standby
imports what a worker needs short of touching a device (``worker/standby.py``) and waits
on its stdin. When the worker has exited and is to be replaced, the supervisor writes the
new worker's arguments there and the standby becomes that worker: same pipes, same pid.
It holds no weights and no device memory until then, so one process owns the model at a
time, as ever. A standby that is not used is killed with its supervisor.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections.abc import Sequence

log = logging.getLogger(__name__)

# -P: the worker's imports never come from the folder the router was started in (a
# common.py there stopped every worker with "'common' is not a package")
WORKER_MODULE = ("-P", "-m", "worker")
STANDBY_FLAG = "--standby"       # worker/__main__.py's
DISCARD_TIMEOUT_S = 5.0          # TERM → KILL: it holds nothing, and exits at once
# A standby is spawned once its worker has been ready this long: its imports (a second of
# CPU on the demo model, more on a Mac) then never compete with the first requests of a
# worker just started, which compile kernels; a worker that dies sooner is spawned fresh.
STANDBY_AFTER_S = 10.0


def worker_args(argv: Sequence[str]) -> list[str] | None:
    """The arguments after ``python -m worker``, or None for a command a standby cannot
    stand in for (another program, a test double)."""
    rest = list(argv[1:])
    if rest[:1] == ["-P"]:
        rest = rest[1:]
    if tuple(rest[:2]) != WORKER_MODULE[-2:]:
        return None
    return rest[2:]


class Standby:
    """One process waiting to become a worker."""

    def __init__(self, proc: asyncio.subprocess.Process, python: str, env: dict[str, str]) -> None:
        self.proc = proc
        self.python = python
        self.env = env

    @classmethod
    async def spawn(cls, argv: Sequence[str], env: dict[str, str]) -> Standby | None:
        args = worker_args(argv)
        if args is None:
            return None
        proc = await asyncio.create_subprocess_exec(
            argv[0], *WORKER_MODULE, STANDBY_FLAG, *args, env=env,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, start_new_session=True)
        log.info("standby worker pid %d spawned (imports now, the model when told)", proc.pid)
        return cls(proc, argv[0], dict(env))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def can_become(self, argv: Sequence[str], env: dict[str, str]) -> bool:
        """Still there, and the same interpreter and environment the command asks for."""
        return (self.proc.returncode is None and self.proc.stdin is not None
                and worker_args(argv) is not None and argv[0] == self.python and env == self.env)

    def become(self, argv: Sequence[str]) -> asyncio.subprocess.Process:
        """Tell it to run as ``argv``'s worker; from now on its process is that worker's.
        The line carries when it was told (wall clock): a standby still importing reads it
        only once done, and its start is counted from here, imports left included."""
        args = worker_args(argv)
        assert args is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"args": args, "told_at": time.time()}).encode() + b"\n")
        return self.proc

    async def discard(self) -> None:
        """Stop it and wait for its exit (it holds no model: nothing to finish)."""
        proc = self.proc
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), DISCARD_TIMEOUT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if proc.stdin is not None:
            proc.stdin.close()


class StandbySlot:
    """The one standby a supervisor keeps: spawned in the background when asked, taken by
    the next start, killed when the supervisor stops."""

    def __init__(self) -> None:
        self._standby: Standby | None = None
        self._spawning: asyncio.Task[None] | None = None
        self._closed = False
        self._close_event = asyncio.Event()

    @property
    def pid(self) -> int | None:
        return self._standby.pid if self._standby is not None else None

    def fill(self, argv: Sequence[str], env: dict[str, str], after_s: float = STANDBY_AFTER_S) -> None:
        """Spawn a standby for ``argv``'s worker in ``after_s`` seconds, unless one is there
        or coming."""
        if self._closed or self._standby is not None or worker_args(argv) is None or (
                self._spawning is not None and not self._spawning.done()):
            return
        self._spawning = asyncio.create_task(self._spawn(list(argv), dict(env), after_s), name="standby-spawn")

    async def take(self, argv: Sequence[str], env: dict[str, str]) -> asyncio.subprocess.Process | None:
        """The standby's process, told to run as ``argv``'s worker; None when there is no
        standby that can (an unusable one is discarded): spawn a new process then."""
        standby, self._standby = self._standby, None
        if standby is None:
            return None
        if standby.can_become(argv, env):
            return standby.become(argv)
        await standby.discard()
        return None

    async def close(self) -> None:
        self._closed = True
        self._close_event.set()
        if self._spawning is not None:
            with contextlib.suppress(Exception):
                await self._spawning  # a spawn under way sees _closed and discards its standby
        standby, self._standby = self._standby, None
        if standby is not None:
            log.info("[shutdown] stopping standby worker %d", standby.pid)
            await standby.discard()

    async def _spawn(self, argv: list[str], env: dict[str, str], after_s: float) -> None:
        try:  # the supervisor's stop ends the wait at once
            await asyncio.wait_for(self._close_event.wait(), max(after_s, 0.0))
            return
        except TimeoutError:
            pass
        if self._closed or self._standby is not None:
            return
        try:
            standby = await Standby.spawn(argv, env)
        except OSError as exc:  # the next start spawns a new process, as it always could
            log.warning("could not spawn a standby worker: %s", exc)
            return
        if standby is not None and (self._closed or self._standby is not None):
            await standby.discard()
            return
        self._standby = standby
