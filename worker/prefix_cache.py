"""Reused prompt KV: the prefix cache's RAM tier, and the seam to its disk tier.

An entry is one sequence's per-layer caches (mlx-lm's ``KVCache`` and kin, extracted from
the batch for one row) and the token ids they hold. A new prompt looks for the entry that
saves it the most prefill:

- *exact* or *prefix*: the entry's tokens are the prompt, or a prefix of it;
- *trimmed*: a longer entry that shares a prefix with the prompt, trimmed back to it (only
  where every layer's cache can trim: ``is_trimmable``; others get exact and prefix hits).

At least the prompt's last token is always left to prefill (its logits start the
generation), so an exact hit is trimmed by one token, and on a cache that cannot trim an
exact hit is taken as the longest shorter prefix instead.

Memory classes (the gate's ledger, ``worker/gate.py``): an entry no request holds is
*evictable*; one handed to a request that has not joined the batch yet is *promised*
(pinned: never evicted). A hit shares the entry's arrays (a view with its own offset, no
copy); the copy is made when the row joins the batch, and charged to that step.

Eviction is whole entries, least recently used first, by real buffer size (the arrays'
``nbytes``): every reference is dropped, then MLX's buffer cache is cleared, so the bytes
really go back. Bounded by ``max_bytes`` and ``max_entries``; a store that would not fit
(the bound, or the gate's free memory) is skipped, never forced.

The disk tier (``DiskTier``, ``worker/disk_cache.py``) is optional: entries evicted to keep
within the bounds, and end-of-generation entries (the state of a conversation, worth
keeping across a restart), are handed to it; an entry evicted because memory is needed now
is not (its write would hold the memory it must give back). The writer holds an entry's
arrays until they are written: the ledger counts them (``writing_bytes`` for entries still
in RAM, which eviction skips until written; ``pending_bytes`` for those already dropped),
so the gate never takes them for free memory. On a RAM miss, a longer disk prefix is
restored when the gate has room for it, charged before the read.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from worker.gate import CacheLedger, is_memory_error

log = logging.getLogger(__name__)

# A shorter reuse saves less prefill than its copy and bookkeeping cost.
MIN_REUSE_TOKENS = 16
# Share of the memory budget the RAM tier may hold by default (it is evicted before any
# request waits for memory, so a large share costs nothing but the entries' re-prefill).
DEFAULT_BUDGET_SHARE = 0.5


class DiskTier(Protocol):
    """The disk tier's interface (implemented in worker/disk_cache.py). ``put`` returns the
    key while its writer holds the arrays (until the key leaves ``pending_keys``)."""

    max_bytes: int
    dir: Path

    def put(self, tokens: Sequence[int], cache: list[Any]) -> str | None: ...
    def pending_keys(self) -> frozenset[str]: ...
    def engine_busy(self, busy: bool) -> None: ...
    def hurry(self) -> None: ...
    def longest_prefix(self, tokens: Sequence[int]) -> tuple[int, str] | None: ...
    def entry_bytes(self, key: str) -> int: ...
    def load(self, key: str, tokens: int) -> list[Any] | None: ...
    def stats(self) -> dict[str, int]: ...
    def close(self, timeout_s: float = ...) -> None: ...


class EvictReason:
    CAPACITY = "capacity"       # --prompt-cache-bytes / --prompt-cache-entries
    SUPERSEDED = "superseded"   # a longer trimmable entry now serves its prefix
    ADMISSION = "admission"     # room for a request that would otherwise wait
    CHUNK = "chunk"             # room for a prefill chunk that would otherwise shrink
    PRESSURE = "pressure"       # memory taken by another process, before any request is stopped


@dataclass(eq=False, slots=True)
class Entry:
    ids: np.ndarray             # int64 token ids the caches hold
    cache: list[Any]            # per-layer caches of one row
    nbytes: int
    trimmable: bool
    used_at: int = 0
    holders: int = 0            # requests holding it (promised): never evicted while > 0
    disk_key: str | None = None  # queued for the disk writer: not evictable until written
    head: bytes = b""           # its first MIN_REUSE_TOKENS ids: any reuse shares them

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(eq=False, slots=True)
class Hit:
    """A reuse handed to one request: ``tokens`` of its prompt come from ``views``."""

    entry: Entry
    tokens: int
    kind: str                   # exact | prefix | trimmed | disk
    views: list[Any] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes

    @property
    def assembled_bytes(self) -> int:
        return 0  # the entry is copied straight into the batch: the row's own KV


@dataclass(slots=True)
class HitCounts:
    """Lookups whose requests were admitted: hits by kind, misses, tokens served."""

    hits: int = 0
    misses: int = 0
    cached_tokens: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    faults: int = 0                 # lookups and stores that raised (a bug): ``CacheTiers.fault``

    def record(self, hit: Any) -> None:
        if hit is None:
            self.misses += 1
            return
        self.hits += 1
        self.cached_tokens += hit.tokens
        self.by_kind[hit.kind] = self.by_kind.get(hit.kind, 0) + 1

    def report(self) -> dict[str, Any]:
        return {"hits": self.hits, "misses": self.misses, "cached_tokens": self.cached_tokens,
                "hits_by_kind": dict(self.by_kind), "faults": self.faults}


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _head(ids: np.ndarray) -> bytes:
    """The first MIN_REUSE_TOKENS ids as bytes (all of them when fewer): two sequences whose
    heads differ share fewer tokens than any reuse needs."""
    return np.asarray(ids[:MIN_REUSE_TOKENS], dtype=np.int64).tobytes()


def cache_nbytes(cache: list[Any]) -> int:
    return int(sum(c.nbytes for c in cache))


def is_trimmable(cache: list[Any]) -> bool:
    return bool(cache) and all(c.is_trimmable() for c in cache)


def view(cache: list[Any], trim: int) -> list[Any]:
    """Per-layer caches that share the entry's arrays, trimmed by ``trim`` tokens (a trim
    moves an offset; the arrays are never written: the batch merge copies them)."""
    out = [_view_one(c) for c in cache]
    if trim:
        for c in out:
            c.trim(trim)
    return out


def _view_one(c: Any) -> Any:
    inner = getattr(c, "caches", None)
    if isinstance(inner, (list, tuple)):  # CacheList: its members need their own views
        v = copy.copy(c)
        v.caches = type(inner)(_view_one(x) for x in inner)
        return v
    return copy.copy(c)


def _clear_mlx_cache() -> None:
    import mlx.core as mx

    mx.clear_cache()


class Reuse(Protocol):
    """A prefix-cache hit as the engine and the gate see it (``Hit`` here, the block store's
    ``Hit``): its first ``tokens`` come from ``views``; joining the batch costs ``nbytes``."""

    tokens: int
    kind: str
    views: list[Any]

    @property
    def nbytes(self) -> int: ...

    @property
    def assembled_bytes(self) -> int:
        """What its join holds beside the row's own copy of the prefix (which the batch's
        worst case already charges): what admission must promise for the join."""


class CacheTiers:
    """The prefix cache as the engine, the core and the gate use it, and what both kinds do
    alike (whole entries here, blocks in worker/block_store.py): tell the disk tier about
    the engine, count lookups, follow the budget, close."""

    # Does ``store`` take a row's extraction unevaluated (and evaluate it as it copies)?
    copies_by_layer = False

    def __init__(self, *, max_bytes: int, max_entries: int, disk: Any,
                 clear: Callable[[], None], budget_share: float | None) -> None:
        self.max_bytes = max_bytes
        # Set when max_bytes is a share of the budget (no --prompt-cache-bytes): it then
        # follows the budget when the router moves this worker's limit.
        self.budget_share = budget_share
        self.max_entries = max_entries
        self.disk = disk
        self._clear = clear
        # Asked before a store or a disk restore: may this many bytes more be held now?
        self.room: Callable[[int], bool] = lambda nbytes: True
        self._clock = 0
        self.counts = HitCounts()
        self.num_stores = 0
        self.num_skipped = 0
        self.evictions: dict[str, int] = {}

    def fault(self, what: str, exc: Exception) -> None:
        """A call into the cache raised (a bug): the cache only saves work, so that reuse
        or copy is lost and nothing else (the caller goes on without it). A memory error is
        re-raised: it is the step's, for the gate's recovery."""
        if is_memory_error(exc):
            raise exc
        log.error("prompt cache %s failed; going on without it", what, exc_info=exc)
        self.counts.faults += 1

    def ledger(self) -> CacheLedger:
        raise NotImplementedError

    def evict(self, nbytes: int, reason: str) -> int:
        raise NotImplementedError

    def lookup(self, prompt: Sequence[int], restore_room: Callable[..., bool] | None = None) -> Reuse | None:
        raise NotImplementedError

    def release(self, hit: Any) -> None:
        raise NotImplementedError

    def wants(self, num_tokens: int, prompt: Sequence[int], estimate_bytes: int) -> bool:
        raise NotImplementedError

    def store(self, tokens: Sequence[int], cache: list[Any], *, keep: bool = False) -> bool:
        raise NotImplementedError

    def report(self) -> dict[str, Any]:
        raise NotImplementedError

    def engine_busy(self, busy: bool) -> None:
        """The worker's loop says whether the engine has work: the disk tier writes when not."""
        if self.disk is not None:
            self.disk.engine_busy(busy)

    def hurry(self) -> None:
        """The gate wants memory the disk writer's queue holds: write it now."""
        if self.disk is not None:
            self.disk.hurry()

    def record(self, hit: Any) -> None:
        """Count a lookup whose request was admitted (one the gate sent back is asked again)."""
        self.counts.record(hit)

    def follow_budget(self, budget_bytes: int) -> None:
        """The budget moved: a bound that is a share of it moves too, evicting what is over."""
        if self.budget_share is None:
            return
        self.max_bytes = int(budget_bytes * self.budget_share)
        over = self.ledger().resident_bytes - self.max_bytes
        if over > 0:
            self.evict(over, "limit")

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the disk tier's writer, writing what is queued within ``timeout_s``."""
        if self.disk is not None:
            self.disk.close() if timeout_s is None else self.disk.close(timeout_s)


class PrefixCache(CacheTiers):
    """The RAM tier: LRU entries by token ids, bounded in bytes and entries."""

    def __init__(self, *, max_bytes: int, max_entries: int, disk: DiskTier | None = None,
                 clear: Callable[[], None] = _clear_mlx_cache, budget_share: float | None = None) -> None:
        super().__init__(max_bytes=max_bytes, max_entries=max_entries, disk=disk, clear=clear,
                         budget_share=budget_share)
        self.entries: list[Entry] = []
        # Entries gone from RAM whose disk write is queued: key -> bytes it keeps alive.
        self._spilled: dict[str, int] = {}

    # -- the gate's view -------------------------------------------------------------

    def ledger(self) -> CacheLedger:
        writing = self._writing()
        resident = sum(e.nbytes for e in self.entries)
        promised = sum(e.nbytes for e in self.entries if e.holders)
        unwritten = sum(e.nbytes for e in self.entries if not e.holders and e.disk_key in writing)
        pending = sum(nbytes for key, nbytes in self._spilled.items() if key in writing)
        return CacheLedger(resident_bytes=resident, promised_bytes=promised,
                           writing_bytes=unwritten, pending_bytes=pending)

    def _writing(self) -> frozenset[str]:
        """Keys the disk writer still holds; forgets the ones it has let go of."""
        if self.disk is None or not (self._spilled or any(e.disk_key for e in self.entries)):
            return frozenset()
        writing = self.disk.pending_keys()
        self._spilled = {k: n for k, n in self._spilled.items() if k in writing}
        for e in self.entries:
            if e.disk_key is not None and e.disk_key not in writing:
                e.disk_key = None
        return writing

    def evict(self, nbytes: int, reason: str) -> int:
        """Evict entries no request holds, least recently used first, until ``nbytes`` are
        freed or none is left; returns the bytes freed. Entries the disk writer still holds
        are skipped: dropping them would free nothing until they are written."""
        freed = 0
        writing = self._writing()
        for entry in sorted((e for e in self.entries if not e.holders and e.disk_key not in writing),
                            key=lambda e: e.used_at):
            if freed >= nbytes:
                break
            freed += self._drop(entry, reason)
        if freed:
            self._clear()
            log.debug("evicted %d B of cached prompts (%s)", freed, reason)
        if freed < nbytes and writing and self.disk is not None:
            self.disk.hurry()  # the writer waits for an idle engine; this memory is wanted now
        return freed

    # -- lookup ----------------------------------------------------------------------

    def lookup(self, prompt: Sequence[int],
               restore_room: Callable[[int, int], bool] | None = None) -> Hit | None:
        """The reuse that saves ``prompt`` the most prefill, taken (pinned) for it, or None.
        The caller releases it (``release``) when its row joins the batch or is dropped.
        ``restore_room(nbytes, tokens=)``: may a disk read of this many bytes, a prefix of this
        many tokens, be made for this request (the gate's ``can_restore``: only if the request
        still fits beside it)? Else ``room``."""
        ids = np.asarray(prompt, dtype=np.int64)
        hit = self._best_ram(ids)
        if self.disk is not None:
            hit = self._from_disk(ids, hit, restore_room)
        if hit is None:
            return None
        self._clock += 1
        hit.entry.used_at = self._clock
        hit.entry.holders += 1
        return hit

    def release(self, hit: Hit) -> None:
        """The hit's row joined the batch (its copy is made) or was dropped: the entry is
        evictable again, and the hit's views let go of its arrays."""
        if hit.entry.holders > 0:
            hit.entry.holders -= 1
        hit.views = []

    def _best_ram(self, ids: np.ndarray) -> Hit | None:
        best: tuple[int, int, Entry] | None = None
        limit = len(ids) - 1  # the last token is always fed
        head = _head(ids)
        for entry in self.entries:
            if entry.head != head:  # shares fewer than MIN_REUSE_TOKENS: no use (a cheap test)
                continue
            common = common_prefix(entry.ids, ids)
            if common == len(entry) and len(entry) <= limit:
                use = len(entry)
            elif entry.trimmable:
                use = min(common, limit)
            else:
                continue
            trim = len(entry) - use
            if use >= MIN_REUSE_TOKENS and (best is None or (use, -trim) > (best[0], -best[1])):
                best = (use, trim, entry)
        if best is None:
            return None
        use, trim, entry = best
        kind = "trimmed" if use < min(len(entry), len(ids)) else "prefix"
        if len(entry) == len(ids) and common_prefix(entry.ids, ids) == len(ids):
            kind = "exact"
        return Hit(entry, use, kind, view(entry.cache, trim))

    def _from_disk(self, ids: np.ndarray, ram: Hit | None,
                   room: Callable[[int, int], bool] | None) -> Hit | None:
        """A longer prefix on disk than in RAM: restore it if the gate has room for it."""
        assert self.disk is not None
        found = self.disk.longest_prefix(ids[:-1].tolist())
        if found is None or found[0] < max(MIN_REUSE_TOKENS, ram.tokens + 1 if ram else 0):
            return ram
        tokens, key = found
        nbytes = self.disk.entry_bytes(key)
        if not self._may_hold(nbytes, functools.partial(room, tokens=tokens) if room else None):
            return ram
        cache = self.disk.load(key, tokens)
        if cache is None:
            return ram
        entry = self._insert(ids[:tokens].copy(), cache)
        if entry is None:
            return ram
        return Hit(entry, tokens, "disk", view(cache, 0))

    # -- store -----------------------------------------------------------------------

    def wants(self, num_tokens: int, prompt: Sequence[int], estimate_bytes: int) -> bool:
        """Should ``prompt[:num_tokens]`` be stored? Asked before the extraction's copy, which
        is charged here (the gate's room): a copy that would not fit is never made."""
        if num_tokens < MIN_REUSE_TOKENS or not self._may_hold(estimate_bytes):
            self.num_skipped += num_tokens >= MIN_REUSE_TOKENS
            return False
        ids = np.asarray(prompt[:num_tokens], dtype=np.int64)
        head = _head(ids)
        for entry in self.entries:
            if entry.head == head and len(entry) >= num_tokens and common_prefix(entry.ids, ids) == num_tokens \
                    and (len(entry) == num_tokens or entry.trimmable):
                self._clock += 1
                entry.used_at = self._clock
                return False  # already served by a stored entry
        return True

    def store(self, tokens: Sequence[int], cache: list[Any], *, keep: bool = False) -> bool:
        """Keep one row's caches (arrays already evaluated) for ``tokens``. ``keep``: worth
        writing to disk now (a conversation's latest state). False when skipped."""
        entry = self._insert(np.asarray(tokens, dtype=np.int64), cache)
        if entry is None:
            return False
        if keep and self.disk is not None:
            entry.disk_key = self.disk.put(entry.ids.tolist(), entry.cache)
        return True

    def _insert(self, ids: np.ndarray, cache: list[Any]) -> Entry | None:
        """Index caches already in memory (their room was asked before they were made)."""
        nbytes = cache_nbytes(cache)
        if not self._fit_bounds(nbytes):
            self.num_skipped += 1
            return None
        self._clock += 1
        entry = Entry(ids, cache, nbytes, is_trimmable(cache), used_at=self._clock, head=_head(ids))
        if entry.trimmable:  # its shorter prefixes are served by trimming it
            for old in [e for e in self.entries if not e.holders and len(e) < len(entry)
                        and common_prefix(e.ids, ids) == len(e)]:
                self._drop(old, EvictReason.SUPERSEDED)
        self.entries.append(entry)
        self.num_stores += 1
        return entry

    def _fit_bounds(self, nbytes: int) -> bool:
        """Make room within the bounds by evicting LRU entries, only if that is enough."""
        free = [e for e in sorted(self.entries, key=lambda e: e.used_at) if not e.holders]
        resident = sum(e.nbytes for e in self.entries)
        if nbytes > self.max_bytes or self.max_entries == 0:
            return False
        over_count = len(self.entries) + 1 - self.max_entries
        dropped, freed = 0, 0
        for e in free:
            if dropped >= over_count and resident - freed + nbytes <= self.max_bytes:
                break
            dropped, freed = dropped + 1, freed + e.nbytes
        if dropped < over_count or resident - freed + nbytes > self.max_bytes:
            return False
        for e in free[:dropped]:
            if self.disk is not None and e.disk_key is None:
                e.disk_key = self.disk.put(e.ids.tolist(), e.cache)
            self._drop(e, EvictReason.CAPACITY)
        return True

    def _may_hold(self, nbytes: int, room: Callable[[int], bool] | None = None) -> bool:
        return nbytes <= self.max_bytes and self.max_entries > 0 and (room or self.room)(nbytes)

    def _drop(self, entry: Entry, reason: str) -> int:
        self.entries.remove(entry)
        entry.cache = []  # the last reference to its arrays, but the disk writer's
        if entry.disk_key is not None:
            self._spilled[entry.disk_key] = entry.nbytes
        self.evictions[reason] = self.evictions.get(reason, 0) + 1
        return entry.nbytes

    # -- report ----------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        ledger = self.ledger()
        ram = {"entries": len(self.entries), "bytes": ledger.resident_bytes}
        return {
            "enabled": True, **self.counts.report(), "stores": self.num_stores,
            "skipped_stores": self.num_skipped, "entries": len(self.entries),
            "ram_bytes": ledger.resident_bytes, "max_bytes": self.max_bytes,
            "max_entries": self.max_entries, "evictable_bytes": ledger.evictable_bytes,
            "promised_bytes": ledger.promised_bytes, "writing_bytes": ledger.writing_bytes,
            "pending_bytes": ledger.pending_bytes, "evictions": dict(self.evictions),
            "tiers": {"ram": ram, "disk": self.disk.stats() if self.disk is not None else None},
        }
