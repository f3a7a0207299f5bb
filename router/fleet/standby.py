"""A standby worker process, kept by a supervisor so that a restart skips the imports.

The supervisor spawns ``python -m worker --standby ARGS`` once its worker is ready (never
beside a worker still starting, which it would slow on a small machine); the standby
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
from collections.abc import Sequence

log = logging.getLogger(__name__)

WORKER_MODULE = ("-m", "worker")
STANDBY_FLAG = "--standby"       # worker/__main__.py's
DISCARD_TIMEOUT_S = 5.0          # TERM → KILL: it holds nothing, and exits at once


def worker_args(argv: Sequence[str]) -> list[str] | None:
    """The arguments after ``python -m worker``, or None for a command a standby cannot
    stand in for (another program, a test double)."""
    if len(argv) < 3 or tuple(argv[1:3]) != WORKER_MODULE:
        return None
    return list(argv[3:])


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
        """Tell it to run as ``argv``'s worker; from now on its process is that worker's."""
        args = worker_args(argv)
        assert args is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(args).encode() + b"\n")
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
