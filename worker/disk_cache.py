"""The prompt cache's disk tier: per-sequence KV caches that outlive the worker.

The RAM tier hands ``put`` the entries it evicts (or wants kept); a background thread
writes each with mlx-lm's own ``save_prompt_cache``, one file per token sequence under
``<root>/<fingerprint>/``. On a RAM miss the RAM tier asks ``longest_prefix``, charges
``entry_bytes`` to its ledger, then calls ``load``. A restarted worker rebuilds the index
from the files' headers (worker/disk_format.py), so it is warm for the conversations it
was serving. Least recently used files go first when ``max_bytes`` would be exceeded.

Trust: a file is loaded only when its name, header, model fingerprint, mlx-lm version,
token ids and checksum all agree. Anything else (a crash mid-write, a truncated or
flipped file, another model's or another program's file) is removed and counted, and the
caller is told "no entry" (None): never an exception, never a wrong cache.

Threads: ``put`` only queues; the writer (``worker/disk_writer.py``, shared with the block
store's disk tier) writes while the engine is quiet and drops its reference to an entry's
arrays as soon as they are on disk.

Several workers of one model may share a directory: writes are atomic and a file another
process removed is a miss (``missing``), but each sees the other's new files only after
a restart.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from worker import disk_format as fmt
from worker.disk_writer import MAX_DEFER_S, MAX_PENDING, QUIET_S, WRITER_CLOSE_TIMEOUT_S, DiskWriter, Job

log = logging.getLogger(__name__)

# A longer entry trimmed to a prefix is read whole; below this share of it the read costs
# more than prefilling the tokens it would save.
MIN_USED_SHARE = 0.125
DEFAULT_MAX_BYTES = 16 << 30
DEFAULT_DISK_SHARE = 0.25       # of the free space where the cache lives, when smaller
# Entries are indexed by hashes of their first 16, 32, 64, ... ids (doubling), so a lookup
# compares the prompt only with the entries that share its longest indexed head instead of
# with every file's ids: that cost 0.86 ms per admission, on every request's path, with
# ~290 entries on disk on this project's 2-core CPU. A reuse shorter than the first level
# is never offered (the prefix cache's MIN_REUSE_TOKENS is not below it).
HEAD_TOKENS = 16


@dataclass(frozen=True, slots=True)
class _Entry:
    key: str
    path: Path
    ids: np.ndarray             # the token ids the KV covers (int32)
    file_bytes: int
    data_bytes: int             # tensor bytes: what loading allocates
    is_trimmable: bool

    def usable_for(self, query: np.ndarray) -> int:
        """Leading tokens of ``query`` this entry's KV covers, trimming it where it must."""
        common = fmt.common_prefix(self.ids, query)
        if common == len(self.ids):
            return common
        if not self.is_trimmable or common < MIN_USED_SHARE * len(self.ids):
            return 0
        return common


class DiskTier:
    """Per-sequence KV caches in safetensors files under ``root/<fingerprint>/``."""

    def __init__(self, root: Path, fingerprint: str, max_bytes: int, *,
                 max_pending: int = MAX_PENDING, max_pending_bytes: int | None = None,
                 quiet_s: float = QUIET_S, max_defer_s: float = MAX_DEFER_S) -> None:
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        self.dir = Path(root) / fmt.dir_name(fingerprint)
        # 0700 both: the files hold users' prompts (parents=True would make the root 0755).
        Path(root).mkdir(parents=True, exist_ok=True, mode=0o700)
        self.dir.mkdir(exist_ok=True, mode=0o700)
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()   # least recently used first
        self._by_head: dict[bytes, set[str]] = {}   # a head's hash → the keys of entries that start so
        self._counts = dict.fromkeys(("hits", "misses", "writes", "too_large", "write_errors",
                                      "corrupt", "missing", "evictions"), 0)
        self._rebuild()
        self._writer = DiskWriter(self._write, max_pending=max_pending,
                                  max_pending_bytes=max_pending_bytes, quiet_s=quiet_s,
                                  max_defer_s=max_defer_s)

    # -- the seam the RAM tier calls -------------------------------------------------------

    def put(self, tokens: Sequence[int], cache: list[Any]) -> str | None:
        """Queue ``cache`` (covering exactly ``tokens``) for writing; never blocks on disk.
        Returns the entry's key while the writer holds its arrays (``pending_keys``), None
        when nothing is queued (already on disk, too large, queue full: counted).

        The writer reads the cache objects and their arrays later: the caller must not
        change them afterwards (sharing them read-only, as hits do, is fine).
        """
        if self._writer.closed or not tokens or self.max_bytes <= 0:
            return None
        ids = fmt.as_ids(tokens)
        key = fmt.token_key(ids)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return None
        if self._writer.is_pending(key):
            return key
        try:
            nbytes = fmt.check_and_eval(cache, len(ids))
        except ValueError as exc:  # the caller's bug costs this entry, never the worker
            log.warning("prompt cache: not writing an entry of %d tokens: %s", len(ids), exc)
            with self._lock:
                self._counts["write_errors"] += 1
            return None
        if nbytes > self.max_bytes:
            with self._lock:
                self._counts["too_large"] += 1
            return None
        payload = (ids, list(cache), fmt.is_trimmable(cache))
        return key if self._writer.submit(key, nbytes, payload) else None

    def engine_busy(self, busy: bool) -> None:
        """The worker's loop says whether the engine has work (cheap when nothing changed)."""
        self._writer.engine_busy(busy)

    def hurry(self) -> None:
        """Write what is queued now, busy or not: the memory its arrays hold is wanted."""
        self._writer.hurry()

    def pending_keys(self) -> frozenset[str]:
        """Keys whose arrays the writer still holds (queued or being written)."""
        return self._writer.pending_keys()

    def longest_prefix(self, tokens: Sequence[int]) -> tuple[int, str] | None:
        """(usable token count, key) of the entry that covers most of ``tokens``.

        An entry whose ids are a prefix of ``tokens`` covers all of its ids; a longer or
        diverging one covers the common prefix if it can be trimmed (and enough of it is
        used to be worth the read). Ties go to the smaller file, then the shorter entry, then the key.
        """
        query = fmt.as_ids(tokens)
        best: tuple[int, int, int, str] | None = None   # usable, -bytes, -tokens (read least), key
        seen: set[str] = set()
        # Deepest head first: an entry that shares a longer head covers more than any entry
        # that does not, so the first head with a usable entry holds the best one.
        for head in reversed(_heads(query)):
            with self._lock:
                entries = [self._entries[k] for k in self._by_head.get(head, ()) if k not in seen]
            for entry in entries:
                seen.add(entry.key)
                usable = entry.usable_for(query)
                rank = (usable, -entry.data_bytes, -len(entry.ids), entry.key)  # the key: a stable last tie-break
                if usable > 0 and (best is None or rank > best):
                    best = rank
            if best is not None:
                break
        if best is None:
            with self._lock:
                self._counts["misses"] += 1
            return None
        return best[0], best[3]

    def entry_bytes(self, key: str) -> int:
        """Bytes of arrays ``load(key, ...)`` will allocate (0 when the key is unknown)."""
        with self._lock:
            entry = self._entries.get(key)
        return entry.data_bytes if entry is not None else 0

    def load(self, key: str, tokens: int) -> list[Any] | None:
        """The per-layer caches of ``key`` trimmed to ``tokens``; None when the file is gone
        or cannot be trusted (then it is removed and counted)."""
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            return None
        if not 0 < tokens <= len(entry.ids) or (tokens < len(entry.ids) and not entry.is_trimmable):
            raise ValueError(f"cannot restore {tokens} tokens from an entry of {len(entry.ids)}"
                             f"{'' if entry.is_trimmable else ' that cannot be trimmed'}")
        try:
            cache = fmt.read(entry.path, fingerprint=self.fingerprint, ids=entry.ids)
        except FileNotFoundError:
            self._forget(entry, "missing")
            return None
        except OSError as exc:  # EIO, EACCES, a folder in its place: unreadable is as good as gone
            log.warning("prompt cache: cannot read %s: %s", entry.path.name, exc)
            self._forget(entry, "missing")
            return None
        except fmt.CorruptFile as exc:
            log.warning("prompt cache: removing untrusted %s: %s", entry.path.name, exc)
            self._forget(entry, "corrupt")
            return None
        fmt.trim(cache, len(entry.ids) - tokens)
        with self._lock:
            self._counts["hits"] += 1
            if key in self._entries:
                self._entries.move_to_end(key)
        fmt.touch(entry.path)  # the order survives a restart
        return cache

    def stats(self) -> dict[str, int]:
        with self._lock:
            counts = dict(self._counts)
            entries, used = len(self._entries), sum(e.file_bytes for e in self._entries.values())
        counts["write_errors"] += self._writer.num_errors
        return {"entries": entries, "bytes": used, "pending": len(self._writer.pending_keys()),
                "pending_bytes": self._writer.pending_bytes(), "dropped": self._writer.num_dropped,
                **counts}

    def close(self, timeout_s: float = WRITER_CLOSE_TIMEOUT_S) -> None:
        """Write what is queued, then stop the writer (bounded: a stuck disk is logged)."""
        self._writer.close(timeout_s)

    # -- the writer thread -----------------------------------------------------------------

    def _write(self, job: Job) -> None:
        ids, cache, is_trimmable = job.payload
        self._make_room(job.nbytes + fmt.header_bytes_estimate(len(ids)))
        path, file_bytes, data_bytes = fmt.write(self.dir, job.key, cache, ids=ids,
                                                 fingerprint=self.fingerprint,
                                                 is_trimmable=is_trimmable)
        job.payload = cache = None
        with self._lock:
            self._add(_Entry(job.key, path, ids, file_bytes, data_bytes, is_trimmable))
            self._counts["writes"] += 1
        self._make_room(0)

    def _make_room(self, needed_bytes: int) -> None:
        """Remove least recently used files until ``needed_bytes`` more fit."""
        while True:
            with self._lock:
                used = sum(e.file_bytes for e in self._entries.values())
                if used + needed_bytes <= self.max_bytes or not self._entries:
                    return
                _, victim = self._entries.popitem(last=False)
                self._unindex(victim)
                self._counts["evictions"] += 1
            fmt.remove(victim.path)

    # -- startup and removal ---------------------------------------------------------------

    def _rebuild(self) -> None:
        """Index what an earlier process left, oldest use first; remove what cannot be trusted."""
        found, num_bad = fmt.scan(self.dir, self.fingerprint)
        self._counts["corrupt"] += num_bad
        for info in found:
            self._add(_Entry(info.key, info.path, info.ids, info.file_bytes, info.data_bytes,
                             info.is_trimmable))
        self._make_room(0)
        if found or num_bad:
            log.info("prompt cache: %d entries (%d bytes) on disk in %s; %d untrusted files removed",
                     len(self._entries), sum(e.file_bytes for e in self._entries.values()),
                     self.dir, num_bad)

    def _forget(self, entry: _Entry, reason: str) -> None:
        with self._lock:
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
                self._unindex(entry)
            self._counts[reason] += 1
        if reason == "corrupt":
            fmt.remove(entry.path)


    # -- the index (callers hold the lock) ----------------------------------------------------

    def _add(self, entry: _Entry) -> None:
        old = self._entries.pop(entry.key, None)
        if old is not None:
            self._unindex(old)
        self._entries[entry.key] = entry
        for head in _heads(entry.ids):
            self._by_head.setdefault(head, set()).add(entry.key)

    def _unindex(self, entry: _Entry) -> None:
        for head in _heads(entry.ids):
            keys = self._by_head.get(head)
            if keys is not None:
                keys.discard(entry.key)
                if not keys:
                    del self._by_head[head]


def _heads(ids: np.ndarray) -> list[bytes]:
    """Hashes of ids[:16], ids[:32], ids[:64], ... (as far as ids go), shortest first."""
    out: list[bytes] = []
    h = hashlib.blake2b(digest_size=16)
    done, upto = 0, HEAD_TOKENS
    while upto <= len(ids):
        h.update(ids[done:upto].tobytes())
        out.append(h.copy().digest())
        done, upto = upto, upto * 2
    return out


def default_root(env: Mapping[str, str]) -> Path:
    """``<cache root>/prompt-cache``: beside the demo model and the calibration cache
    (``$XDG_CACHE_HOME/mlx-headroom``, else ``~/.cache/mlx-headroom``)."""
    from worker.demo import default_cache_root

    return default_cache_root(env) / "prompt-cache"


def default_max_bytes(root: Path) -> int:
    """16 GiB, or a quarter of the free space where the cache lives if that is less."""
    probe = Path(root)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = os.statvfs(probe).f_bavail * os.statvfs(probe).f_frsize
    except OSError:
        return 0
    return min(DEFAULT_MAX_BYTES, int(free * DEFAULT_DISK_SHARE))


def from_options(*, disk_bytes: int | None, fingerprint: str, env: Mapping[str, str],
                 root: Path | None = None, max_pending_bytes: int | None = None,
                 make: Callable[..., Any] | None = None) -> Any:
    """The disk tier a worker runs with: ``--prompt-cache-disk-bytes`` (None: the default,
    0: off) under ``root`` (None: ``default_root(env)``), made by ``make(root, fingerprint,
    max_bytes, max_pending_bytes=)`` (``DiskTier`` for whole entries, the block store's
    ``BlockDisk``). None when it is off or no cache directory can be made (a read-only
    home costs warm restarts, not the worker)."""
    if disk_bytes is not None and disk_bytes <= 0:
        return None
    try:
        where = Path(root) if root is not None else default_root(env)
        limit = disk_bytes if disk_bytes is not None else default_max_bytes(where)
        if limit <= 0:
            return None
        return (make or DiskTier)(where, fingerprint, limit, max_pending_bytes=max_pending_bytes)
    except (OSError, ValueError) as exc:
        log.warning("prompt cache: no disk tier (%s)", exc)
        return None
