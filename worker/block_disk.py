"""The block store's disk tier: block files under ``<root>/<fingerprint>/blocks/``.

The block store (``worker/block_store.py``) owns the index and every decision: which
blocks to write, which files to remove to stay within ``max_bytes``, what a restart finds.
This module does the file work: ``put`` queues a block for the writer (the background
writer of ``worker/disk_writer.py``, which writes while the engine is quiet), ``written``
hands back the writes finished since the last call (from the writer's thread), ``read``
loads one block, and ``scan`` is what an earlier process left, checked.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from worker import block_format as bfmt
from worker import disk_format as fmt
from worker.block_format import BlockFile, LayerKV
from worker.disk_writer import MAX_DEFER_S, MAX_PENDING, QUIET_S, WRITER_CLOSE_TIMEOUT_S, DiskWriter, Job

log = logging.getLogger(__name__)

# A block write queues one job per block: a conversation's new blocks come at once.
BLOCK_MAX_PENDING = 8 * MAX_PENDING


class BlockDisk:
    def __init__(self, root: Path, fingerprint: str, max_bytes: int, *,
                 max_pending: int = BLOCK_MAX_PENDING, max_pending_bytes: int | None = None,
                 quiet_s: float = QUIET_S, max_defer_s: float = MAX_DEFER_S) -> None:
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        self.dir = Path(root) / fmt.dir_name(fingerprint) / "blocks"
        # 0700 all: the files hold users' prompts (parents=True would make them 0755).
        Path(root).mkdir(parents=True, exist_ok=True, mode=0o700)
        for d in (Path(root) / fmt.dir_name(fingerprint), self.dir):
            d.mkdir(exist_ok=True, mode=0o700)
        self._remove_whole_entries()
        self._lock = threading.Lock()
        self._done: list[tuple[str, BlockFile | None]] = []
        self._writer = DiskWriter(self._write, name="prompt-cache-blocks", max_pending=max_pending,
                                  max_pending_bytes=max_pending_bytes, quiet_s=quiet_s,
                                  max_defer_s=max_defer_s)

    def _remove_whole_entries(self) -> None:
        """Whole-sequence files an earlier version wrote for this model: nothing reads them
        any more (this model's caches are kept as blocks), so they would hold the disk for
        ever."""
        stale = [p for p in self.dir.parent.glob("*.safetensors") if p.is_file()]
        for path in stale:
            fmt.remove(path)
        if stale:
            log.info("prompt cache: removed %d whole-sequence files of an earlier version from %s "
                     "(this model's cache is kept in blocks now)", len(stale), self.dir.parent)

    def scan(self) -> tuple[list[BlockFile], int]:
        """What an earlier process left (least recently used first), and the number of
        untrusted files removed."""
        return bfmt.scan(self.dir, self.fingerprint)

    def put(self, key: str, parent: str, ids: np.ndarray, kv: Sequence[LayerKV]) -> bool:
        """Queue a block (evaluated arrays, never changed afterwards) for writing. False
        when the writer's queue or pending bytes are full (counted as dropped)."""
        return self._writer.submit(key, bfmt.kv_nbytes(kv), (parent, ids, list(kv)))

    def written(self) -> list[tuple[str, BlockFile | None]]:
        """Writes finished since the last call: (key, its file, or None when it failed)."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def read(self, info: BlockFile, num_layers: int) -> tuple[list[LayerKV] | None, str | None]:
        """(the block's arrays, None), or (None, "missing" | "corrupt") when its file is gone
        or cannot be read or trusted (a damaged file is removed here; the caller forgets it)."""
        try:
            return bfmt.read(info, fingerprint=self.fingerprint, num_layers=num_layers), None
        except FileNotFoundError:
            return None, "missing"
        except OSError as exc:  # EIO, EACCES, a folder in its place: unreadable is as good as gone
            log.warning("prompt cache: cannot read block %s: %s", info.path.name, exc)
            return None, "missing"
        except fmt.CorruptFile as exc:
            log.warning("prompt cache: removing untrusted block %s: %s", info.path.name, exc)
            bfmt.remove(info)
            return None, "corrupt"

    def remove(self, info: BlockFile) -> None:
        bfmt.remove(info)

    def touch(self, info: BlockFile) -> None:
        bfmt.touch(info)

    def pending_keys(self) -> frozenset[str]:
        return self._writer.pending_keys()

    def pending_bytes(self) -> int:
        return self._writer.pending_bytes()

    @property
    def num_dropped(self) -> int:
        return self._writer.num_dropped

    def engine_busy(self, busy: bool) -> None:
        self._writer.engine_busy(busy)

    def hurry(self) -> None:
        self._writer.hurry()

    def close(self, timeout_s: float = WRITER_CLOSE_TIMEOUT_S) -> None:
        self._writer.close(timeout_s)

    def _write(self, job: Job) -> None:
        parent, ids, kv = job.payload
        info: BlockFile | None = None
        try:
            info = bfmt.write(self.dir, job.key, parent, ids, kv, fingerprint=self.fingerprint)
        finally:
            job.payload = kv = None
            with self._lock:
                self._done.append((job.key, info))
