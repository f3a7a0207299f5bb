"""Tests for worker/prefix_cache.py: lookup, bounds, classes and the disk seam, on fake caches.

A ``Layer`` stands for one layer of mlx-lm's per-row cache (``KVCache`` trims by moving an
offset; ``ArraysCache`` cannot trim); no MLX.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from worker.prefix_cache import MIN_REUSE_TOKENS, PrefixCache

PER_TOKEN = 1000
LAYERS = 2


class Layer:
    def __init__(self, tokens: int, trimmable: bool = True) -> None:
        self.offset = tokens
        self.trimmable = trimmable
        self.nbytes = tokens * PER_TOKEN // LAYERS

    def is_trimmable(self) -> bool:
        return self.trimmable

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n


def layers(tokens: int, trimmable: bool = True) -> list[Any]:
    return [Layer(tokens, trimmable) for _ in range(LAYERS)]


def seq(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def make(max_bytes: int = 10**9, max_entries: int = 32, **kw: Any) -> tuple[PrefixCache, list[int]]:
    cleared: list[int] = []
    cache = PrefixCache(max_bytes=max_bytes, max_entries=max_entries,
                        clear=lambda: cleared.append(1), **kw)
    return cache, cleared


def put(cache: PrefixCache, tokens: list[int], trimmable: bool = True, keep: bool = False) -> bool:
    return cache.store(tokens, layers(len(tokens), trimmable), keep=keep)


def test_a_shorter_prefix_is_reused_and_only_the_rest_is_left() -> None:
    cache, _ = make()
    put(cache, seq(100))
    hit = cache.lookup(seq(150))
    assert hit is not None and hit.tokens == 100 and hit.kind == "prefix"
    assert [c.offset for c in hit.views] == [100, 100]


def test_an_exact_match_leaves_the_last_token_to_feed() -> None:
    cache, _ = make()
    put(cache, seq(100))
    hit = cache.lookup(seq(100))
    assert hit is not None and hit.tokens == 99 and hit.kind == "exact"
    assert [c.offset for c in hit.views] == [99, 99]
    assert [c.offset for c in cache.entries[0].cache] == [100, 100], "a view never trims the entry"


def test_a_longer_entry_is_trimmed_to_the_shared_prefix() -> None:
    cache, _ = make()
    put(cache, seq(200))
    prompt = seq(120) + [7, 8, 9]
    hit = cache.lookup(prompt)
    assert hit is not None and hit.tokens == 120 and hit.kind == "trimmed"
    assert [c.offset for c in hit.views] == [120, 120]


def test_caches_that_cannot_trim_get_exact_prefixes_only() -> None:
    cache, _ = make()
    put(cache, seq(200), trimmable=False)
    assert cache.lookup(seq(120) + [7]) is None          # would need a trim
    assert cache.lookup(seq(200)) is None                # exact: nothing left to feed without a trim
    hit = cache.lookup(seq(250))
    assert hit is not None and hit.tokens == 200


def test_the_longest_reuse_wins_and_tiny_ones_are_not_worth_it() -> None:
    cache, _ = make()
    put(cache, seq(50), trimmable=False)
    put(cache, seq(80, start=100) + [1] * 20, trimmable=False)
    hit = cache.lookup(seq(80) + [1] * 20 + [5])
    assert hit is not None and hit.tokens == 100
    cache, _ = make()
    put(cache, seq(MIN_REUSE_TOKENS + 50))
    assert cache.lookup(seq(MIN_REUSE_TOKENS - 1) + [3] * 40) is None


def test_a_longer_trimmable_entry_supersedes_its_prefixes() -> None:
    cache, _ = make()
    put(cache, seq(100))
    put(cache, seq(300))
    assert [len(e) for e in cache.entries] == [300]
    assert cache.evictions == {"superseded": 1}
    assert not cache.wants(100, seq(100), 100 * PER_TOKEN), "already served by the longer one"


def test_lru_eviction_by_real_bytes_within_the_bounds() -> None:
    cache, cleared = make(max_bytes=250 * PER_TOKEN)
    put(cache, seq(100, start=1000))
    put(cache, seq(100, start=2000))
    hit = cache.lookup(seq(101, start=1000))               # the first is now the most recent
    assert hit is not None
    cache.release(hit)
    put(cache, seq(100, start=3000))
    assert sorted(int(e.ids[0]) for e in cache.entries) == [1000, 3000]
    assert cache.evictions == {"capacity": 1}
    assert cache.ledger().resident_bytes == 200 * PER_TOKEN


def test_the_entry_count_bounds_too() -> None:
    cache, _ = make(max_entries=2)
    for start in (1000, 2000, 3000):
        put(cache, seq(20, start=start))
    assert [int(e.ids[0]) for e in cache.entries] == [2000, 3000]


def test_a_store_that_would_not_fit_is_skipped_not_forced() -> None:
    cache, _ = make(max_bytes=150 * PER_TOKEN)
    put(cache, seq(100, start=1000))
    hit = cache.lookup(seq(120, start=1000))               # promised: cannot go
    assert not put(cache, seq(100, start=2000))            # 200 > 150 even with the rest gone
    assert not put(cache, seq(200, start=3000))            # bigger than the whole bound
    assert cache.num_skipped == 2 and len(cache.entries) == 1 and hit is not None
    cache.room = lambda nbytes: False                      # the gate has no room now
    assert not cache.wants(40, seq(40, start=5000), 40 * PER_TOKEN)


def test_promised_entries_are_never_evicted_and_released_ones_are() -> None:
    cache, cleared = make()
    put(cache, seq(100, start=1000))
    put(cache, seq(100, start=2000))
    hit = cache.lookup(seq(120, start=1000))
    assert hit is not None
    assert cache.ledger().promised_bytes == 100 * PER_TOKEN
    assert cache.ledger().evictable_bytes == 100 * PER_TOKEN
    assert cache.evict(10**9, "admission") == 100 * PER_TOKEN and cleared == [1]
    assert [int(e.ids[0]) for e in cache.entries] == [1000]
    cache.release(hit)
    assert hit.views == [] and cache.ledger().promised_bytes == 0
    assert cache.evict(1, "pressure") == 100 * PER_TOKEN and not cache.entries
    assert cache.evictions == {"admission": 1, "pressure": 1}


def test_eviction_drops_every_reference_to_the_arrays() -> None:
    cache, _ = make()
    put(cache, seq(100))
    entry = cache.entries[0]
    cache.evict(1, "chunk")
    assert entry.cache == [] and not cache.entries


def test_counts_and_report() -> None:
    cache, _ = make()
    cache.record(None)
    put(cache, seq(100))
    cache.record(cache.lookup(seq(130)))
    report = cache.report()
    assert report["hits"] == 1 and report["misses"] == 1 and report["cached_tokens"] == 100
    assert report["tiers"]["ram"] == {"entries": 1, "bytes": 100 * PER_TOKEN}
    assert report["tiers"]["disk"] is None and report["hits_by_kind"] == {"prefix": 1}


class FakeDisk:
    """The disk tier's interface (worker/disk_cache.py) over a dict."""

    def __init__(self, *, slow: bool = False) -> None:
        self.files: dict[str, list[int]] = {}
        self.corrupt: set[str] = set()
        self.loads: list[str] = []
        self.slow = slow                # writes stay queued (their arrays held) until written()
        self.pending: set[str] = set()

    def put(self, tokens: Sequence[int], cache: list[Any]) -> str | None:
        key = f"k{len(self.files)}"
        self.files[key] = list(tokens)
        if not self.slow:
            return None
        self.pending.add(key)
        return key

    def pending_keys(self) -> frozenset[str]:
        return frozenset(self.pending)

    def engine_busy(self, busy: bool) -> None:
        self.busy = busy

    def hurry(self) -> None:
        self.hurried = getattr(self, "hurried", 0) + 1

    def written(self) -> None:
        self.pending.clear()

    def longest_prefix(self, tokens: Sequence[int]) -> tuple[int, str] | None:
        best = [(len(t), k) for k, t in self.files.items() if list(tokens[:len(t)]) == t]
        return max(best) if best else None

    def entry_bytes(self, key: str) -> int:
        return len(self.files[key]) * PER_TOKEN

    def load(self, key: str, tokens: int) -> list[Any] | None:
        self.loads.append(key)
        if key in self.corrupt:
            del self.files[key]
            return None
        return layers(tokens)

    def stats(self) -> dict[str, int]:
        return {"entries": len(self.files)}

    def close(self) -> None:
        pass


def test_capacity_evictions_and_conversation_ends_go_to_disk_memory_evictions_do_not() -> None:
    disk = FakeDisk()
    cache, _ = make(max_entries=1, disk=disk)
    put(cache, seq(100, start=1000))
    put(cache, seq(100, start=2000), keep=True)            # the first is evicted for room: kept
    assert sorted(t[0] for t in disk.files.values()) == [1000, 2000]
    cache.evict(1, "admission")                            # memory needed now: no write
    assert len(disk.files) == 2


def test_a_longer_disk_prefix_is_restored_with_its_room_asked_first() -> None:
    disk = FakeDisk()
    cache, _ = make(disk=disk)
    disk.files["a"] = seq(300)
    put(cache, seq(100))
    asked: list[int] = []
    cache.room = lambda nbytes: asked.append(nbytes) is None
    hit = cache.lookup(seq(400))
    assert hit is not None and hit.kind == "disk" and hit.tokens == 300
    assert asked == [300 * PER_TOKEN] and disk.loads == ["a"]
    assert any(len(e) == 300 for e in cache.entries)


def test_no_room_or_a_corrupt_file_means_the_ram_hit_or_a_cold_start() -> None:
    disk = FakeDisk()
    cache, _ = make(disk=disk)
    disk.files["a"] = seq(300)
    put(cache, seq(100))
    cache.room = lambda nbytes: False
    hit = cache.lookup(seq(400))
    assert hit is not None and hit.kind == "prefix" and disk.loads == []
    cache.release(hit)
    cache.room = lambda nbytes: True
    disk.corrupt.add("a")
    hit = cache.lookup(seq(400))
    assert hit is not None and hit.tokens == 100 and "a" not in disk.files


def test_a_disk_read_the_request_could_not_run_beside_is_not_made() -> None:
    # The gate's can_restore for this request says no: the RAM hit (or a cold start) instead,
    # never a read it would have to give back again to run.
    disk = FakeDisk()
    cache, _ = make(disk=disk)
    disk.files["a"] = seq(300)
    put(cache, seq(100))
    asked: list[int] = []
    hit = cache.lookup(seq(400), restore_room=lambda nbytes, tokens=0: asked.append(nbytes) is not None)
    assert hit is not None and hit.kind == "prefix" and hit.tokens == 100
    assert asked == [300 * PER_TOKEN] and disk.loads == []
    cache.release(hit)
    hit = cache.lookup(seq(400), restore_room=lambda nbytes, tokens=0: True)
    assert hit is not None and hit.kind == "disk" and disk.loads == ["a"]


def test_entries_queued_for_the_disk_writer_are_held_and_not_evictable_until_written() -> None:
    disk = FakeDisk(slow=True)
    cache, cleared = make(max_entries=1, disk=disk)
    put(cache, seq(100, start=1000))
    put(cache, seq(100, start=2000), keep=True)    # the first leaves RAM for the writer's queue
    ledger = cache.ledger()
    assert (ledger.resident_bytes, ledger.pending_bytes, ledger.writing_bytes) == (100 * PER_TOKEN,) * 3
    assert ledger.held_bytes == 200 * PER_TOKEN and ledger.evictable_bytes == 0
    assert cache.evict(1, "admission") == 0 and len(cache.entries) == 1, "dropping it frees nothing yet"
    assert disk.hurried == 1, "the memory is wanted: the writer goes now, idle engine or not"
    report = cache.report()
    assert report["pending_bytes"] == report["writing_bytes"] == 100 * PER_TOKEN
    disk.written()                                 # the writer let go of both
    ledger = cache.ledger()
    assert (ledger.pending_bytes, ledger.writing_bytes, ledger.evictable_bytes) == (0, 0, 100 * PER_TOKEN)
    assert cache.evict(1, "admission") == 100 * PER_TOKEN and not cache.entries and cleared


def test_a_bound_that_is_a_budget_share_follows_the_budget() -> None:
    cache, _ = make(max_bytes=300 * PER_TOKEN, budget_share=0.5)
    put(cache, seq(100, start=1000))
    put(cache, seq(100, start=2000))
    cache.follow_budget(300 * PER_TOKEN)  # the router halved this worker's share
    assert cache.max_bytes == 150 * PER_TOKEN
    assert [int(e.ids[0]) for e in cache.entries] == [2000] and cache.evictions == {"limit": 1}
    fixed, _ = make(max_bytes=300 * PER_TOKEN)  # --prompt-cache-bytes: it stays
    fixed.follow_budget(10)
    assert fixed.max_bytes == 300 * PER_TOKEN
