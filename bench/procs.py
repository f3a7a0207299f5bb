"""Server subprocesses under test: start, wait until healthy, stop (TERM, then KILL).

Each server runs in its own session so one killpg reaches everything it spawned (the
router's worker included), and its output goes to a log file whose tail is shown when
it fails to start. Every wait here is bounded.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
STOP_TIMEOUT_S = 15.0
HEALTH_POLL_S = 0.1


class StartError(RuntimeError):
    """A server did not become healthy; the message carries its log tail."""


def pid_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie awaiting its parent counts as gone; Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


def free_port() -> int:
    """A port the kernel just handed out on loopback (tiny race; fine for a benchmark)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_env(run_dir: Path) -> dict[str, str]:
    """The bench's environment minus Headroom config overrides, with private XDG dirs.

    XDG_CACHE_HOME is inherited on purpose: the demo model is built and cached there, and
    every system must load the very same folder. Config and runtime dirs are private so a
    user's config.toml or a stale socket cannot change what is measured.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_ROUTER_", "MLX_WORKER_"))}
    env.update(XDG_CONFIG_HOME=str(run_dir / "config"), XDG_RUNTIME_DIR=str(run_dir),
               PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


class ServerProcess:
    """One HTTP server under test, in its own session, logging to a file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path,
                 health_url: str) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.cwd = ROOT  # another checkout's folder runs that checkout's code (`python -m`)
        self.log_path = log_path
        self.health_url = health_url
        self.popen: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> None:
        log.info("starting %s: %s", self.name, " ".join(self.argv))
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(self.argv, env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                                      stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True)

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def _is_healthy(self) -> bool:
        """200: healthy. A Headroom router whose worker gave up says its state is "failed"
        (``"status"`` in its 503): that cannot change, so it raises rather than wait out the timeout."""
        try:
            with urllib.request.urlopen(self.health_url, timeout=2.0) as resp:
                return int(resp.status) == 200
        except urllib.error.HTTPError as exc:
            try:
                body = json.loads(exc.read() or b"{}")
                state = body.get("status", body.get("state"))  # Headroom's /health says "status"
            except (ValueError, AttributeError, OSError):
                state = None
            if state == "failed":
                raise StartError(f"{self.name} says its worker failed; log tail:\n{self.log_tail()}")
            return False
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_healthy(self, timeout_s: float) -> float:
        """Block until GET health answers 200; returns seconds waited. Raises StartError."""
        assert self.popen is not None
        started = time.monotonic()
        while True:
            if self.popen.poll() is not None:
                raise StartError(f"{self.name} exited with {self.popen.returncode} before it was "
                                 f"healthy; log tail:\n{self.log_tail()}")
            if self._is_healthy():
                waited = time.monotonic() - started
                log.info("%s healthy after %.1f s", self.name, waited)
                return waited
            if time.monotonic() - started > timeout_s:
                raise StartError(f"{self.name} not healthy at {self.health_url} after {timeout_s:.0f} s;"
                                 f" log tail:\n{self.log_tail()}")
            time.sleep(HEALTH_POLL_S)

    def stop(self) -> int | None:
        """TERM the whole session, wait, then KILL it. Safe to call more than once."""
        popen = self.popen
        if popen is not None and popen.poll() is None:
            _signal_group(popen.pid, signal.SIGTERM)
            try:
                popen.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("%s ignored SIGTERM for %.0f s; killing it", self.name, STOP_TIMEOUT_S)
                _signal_group(popen.pid, signal.SIGKILL)
                popen.wait(STOP_TIMEOUT_S)
        if popen is not None:
            # The group may outlive its leader (e.g. a worker still exiting); make sure.
            _signal_group(popen.pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None
        return popen.returncode if popen is not None else None


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # already gone
