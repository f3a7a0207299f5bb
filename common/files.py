"""Files an operator names that hold a secret or decide who gets in: they must be ours alone."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from common.errors import ConfigError

__all__ = ["require_private"]


def require_private(path: Path, what: str, *, st: os.stat_result | None = None,
                    others_may_read: bool = False) -> None:
    """Refuse ``path`` unless it is ours and neither group nor others may read or write it
    (``others_may_read``: only not write it, as a folder of public keys). ``st``: its stat,
    if already taken. The ConfigError names ``what`` and the chmod that fixes it."""
    st = path.stat() if st is None else st
    mode = stat.S_IMODE(st.st_mode)
    if others_may_read:
        if mode & 0o022:
            raise ConfigError(f"{what} {path} is writable by group or others "
                              f"(mode {mode:04o}); run: chmod go-w {path}")
    elif mode & 0o077:
        raise ConfigError(f"{what} {path} is readable by group or others "
                          f"(mode {mode:04o}); run: chmod 600 {path}")
    if st.st_uid != os.getuid():  # another user could have written it, or still read it
        raise ConfigError(f"{what} {path} belongs to another user")
