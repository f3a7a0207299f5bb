"""Markers and helpers shared by every test: free_port(), wait_until()."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.05,
               on_fail: Callable[[], str] | None = None) -> T:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = on_fail() if on_fail else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{detail}")
        time.sleep(interval)


def process_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie awaiting its parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] == "Z"
    except FileNotFoundError:
        return True
