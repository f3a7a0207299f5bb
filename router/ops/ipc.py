"""Where workers find the router: an ipc:// path in a 0700 runtime dir, guarded by a lock.

macOS limits a Unix socket path to 103 bytes, so the path is kept short and checked.
The lock makes a second router on the same address fail loudly instead of stealing it.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from common.errors import ConfigError

def runtime_dir(env: Mapping[str, str]) -> Path:
    """$XDG_RUNTIME_DIR/mlx-headroom, else /tmp/mlx-headroom-<uid>; created 0700."""
    base = env.get("XDG_RUNTIME_DIR")
    path = Path(base) / "mlx-headroom" if base else Path(tempfile.gettempdir()) / f"mlx-headroom-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError as exc:  # a file in its place, a read-only parent: a setup error, not a crash
        raise ConfigError(f"runtime dir {path}: {exc.strerror or exc} (set XDG_RUNTIME_DIR)") from None
    if st.st_uid != os.getuid():
        raise ConfigError(f"runtime dir {path} belongs to another user")
    if st.st_mode & 0o077:
        path.chmod(0o700)
    return path


def default_worker_addr(port: int, env: Mapping[str, str]) -> str:
    return f"ipc://{runtime_dir(env) / f'router-{port}.sock'}"


def lock_addr(addr: str) -> IO[str] | None:
    """Hold an exclusive lock beside an ipc socket for the router's lifetime.

    The socket's directory is created 0700 if missing: only this user may connect.
    """
    if not addr.startswith("ipc://"):
        return None
    lock_path = addr[len("ipc://"):] + ".lock"
    try:
        Path(addr[len("ipc://"):]).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fh = open(lock_path, "w")
    except OSError as exc:
        raise ConfigError(f"--worker-addr {addr}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.close()
        raise ConfigError(f"another mlx-router already serves workers at {addr}") from None
    fh.write(str(os.getpid()))
    fh.flush()
    return fh
