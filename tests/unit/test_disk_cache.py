"""Tests for worker/disk_cache.py and worker/disk_format.py: the prompt cache's disk tier.

Real mlx-lm caches throughout: a tiny llama (two full-attention layers and one sliding
window layer, so KVCache and RotatingKVCache both travel) prefilled on a few tokens, and
bare KVCache objects with small arrays. Writes are awaited through stats() or close(),
never with sleeps.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, RotatingKVCache, save_prompt_cache

from tests.conftest import wait_until
from worker import disk_cache, disk_format, prefix_cache
from worker.disk_cache import DiskTier

FP = "0123456789abcdef"
WAIT_S = 30.0


@pytest.fixture(scope="module")
def model() -> Any:
    mx.random.seed(3)
    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=3,
                           intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=64, sliding_window=64,
                           layer_types=["full_attention", "sliding_attention", "full_attention"])
    m = llama.Model(args)
    mx.eval(m.parameters())
    return m


def prefill(model: Any, tokens: list[int]) -> list[Any]:
    cache = model.make_cache()
    mx.eval(model(mx.array([tokens]), cache=cache))
    mx.eval([c.state for c in cache])
    return cache


def kv(num_tokens: int, seed: int = 0) -> list[Any]:
    """Two KVCache layers holding num_tokens tokens of small random keys and values."""
    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(2):
        c = KVCache()
        c.update_and_fetch(mx.array(rng.standard_normal((1, 2, num_tokens, 4), dtype=np.float32)),
                           mx.array(rng.standard_normal((1, 2, num_tokens, 4), dtype=np.float32)))
        layers.append(c)
    mx.eval([c.state for c in layers])
    return layers


def written(tier: DiskTier, n: int) -> None:
    wait_until(lambda: tier.stats()["writes"] + tier.stats()["write_errors"] >= n, WAIT_S,
               f"{n} disk writes")
    assert tier.stats()["write_errors"] == 0


def files(tier: DiskTier) -> list[Path]:
    return sorted(p for p in tier.dir.iterdir() if not p.name.startswith("."))


@pytest.fixture(autouse=True)
def short_heads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Most tests here store entries of a few tokens: the index's heads start at one token
    for them (1, 2, 4, ...); the tests marked ``real_heads`` keep the default of 16."""
    if "real_heads" not in request.keywords:
        monkeypatch.setattr(disk_cache, "HEAD_TOKENS", 1)


@pytest.fixture
def tier(tmp_path: Path) -> Any:
    t = DiskTier(tmp_path, FP, 1 << 30)
    yield t
    t.close()


def test_round_trip_keeps_arrays_offsets_and_classes(tier: DiskTier, model: Any) -> None:
    tokens = list(range(1, 21))
    cache = prefill(model, tokens)
    tier.put(tokens, cache)
    written(tier, 1)
    usable, key = tier.longest_prefix(tokens) or (0, "")
    assert usable == 20
    kv_bytes = sum(c.nbytes for c in cache)
    assert kv_bytes <= tier.entry_bytes(key) <= kv_bytes + 64  # plus the offsets, 4 bytes each
    loaded = tier.load(key, 20)
    assert loaded is not None
    assert [type(c) for c in loaded] == [KVCache, RotatingKVCache, KVCache]
    for a, b in zip(cache, loaded):
        assert b.offset == a.offset == 20
        assert mx.array_equal(a.keys, b.keys) and mx.array_equal(a.values, b.values)
    # The restored cache continues exactly as the original does.
    nxt = mx.array([[7, 9]])
    assert mx.array_equal(model(nxt, cache=cache), model(nxt, cache=loaded))
    assert tier.stats()["hits"] == 1 and tier.stats()["entries"] == 1


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_half_precision_round_trip(tier: DiskTier, dtype: Any) -> None:
    layer = KVCache()
    layer.update_and_fetch(mx.random.normal((1, 2, 9, 8)).astype(dtype),
                           mx.random.normal((1, 2, 9, 8)).astype(dtype))
    tier.put(list(range(9)), [layer])
    written(tier, 1)
    loaded = tier.load(tier.longest_prefix(list(range(10)))[1], 9)  # type: ignore[index]
    assert loaded is not None and loaded[0].keys.dtype == dtype
    assert mx.array_equal(loaded[0].keys, layer.keys) and mx.array_equal(loaded[0].values, layer.values)


def test_prefix_lookup_prefers_the_longest_coverage(tier: DiskTier) -> None:
    short, long = list(range(1, 11)), list(range(1, 31))
    tier.put(short, kv(10))
    tier.put(long, kv(30, seed=1))
    written(tier, 2)
    key_short = disk_format.token_key(disk_format.as_ids(short))
    key_long = disk_format.token_key(disk_format.as_ids(long))
    assert tier.longest_prefix(long + [99, 98]) == (30, key_long)      # a stored prefix
    assert tier.longest_prefix(short + [99]) == (10, key_short)        # the shorter one is exact
    assert tier.longest_prefix(list(range(1, 21)) + [99]) == (20, key_long)  # trimmed longer one
    assert tier.longest_prefix([50, 1, 2]) is None                     # nothing shared
    assert tier.stats()["misses"] == 1


def test_a_longer_entry_is_not_offered_for_a_small_share(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, FP, 1 << 30)
    tier.put(list(range(1, 101)), kv(100))
    tier.close()
    assert tier.longest_prefix([1, 2, 3, 99]) is None  # 3 of 100 tokens: prefill them instead


def test_load_trims_to_the_tokens_asked(tier: DiskTier, model: Any) -> None:
    tokens = list(range(1, 25))
    cache = prefill(model, tokens)
    tier.put(tokens, cache)
    written(tier, 1)
    usable, key = tier.longest_prefix(tokens[:15] + [60, 61]) or (0, "")
    assert usable == 15
    loaded = tier.load(key, usable)
    assert loaded is not None and all(c.offset == 15 for c in loaded)
    # Trimmed, it continues as a cache built on the 15 tokens alone.
    fresh = prefill(model, tokens[:15])
    nxt = mx.array([[60, 61]])
    assert mx.allclose(model(nxt, cache=fresh), model(nxt, cache=loaded), atol=1e-5)


def test_a_cache_that_cannot_be_trimmed_serves_only_whole(tier: DiskTier) -> None:
    layer = RotatingKVCache(max_size=8)
    layer.update_and_fetch(mx.ones((1, 2, 12, 4)), mx.ones((1, 2, 12, 4)))  # wrapped: offset 12
    tokens = list(range(1, 13))
    tier.put(tokens, [layer])
    written(tier, 1)
    assert tier.longest_prefix(tokens[:10] + [40]) is None
    usable, key = tier.longest_prefix(tokens + [40]) or (0, "")
    assert usable == 12
    with pytest.raises(ValueError):
        tier.load(key, 10)
    loaded = tier.load(key, 12)
    assert loaded is not None and loaded[0].offset == 12


def test_lru_eviction_by_bytes(tmp_path: Path) -> None:
    size = sum(c.nbytes for c in kv(10))
    tier = DiskTier(tmp_path, FP, int(size * 2.5))  # room for two entries
    a, b, c = ([i] + list(range(1, 10)) for i in (100, 200, 300))
    tier.put(a, kv(10))
    tier.put(b, kv(10))
    written(tier, 2)
    hit = tier.longest_prefix(a)
    assert hit is not None and tier.load(hit[1], 10) is not None  # a is now the most recent
    tier.put(c, kv(10))
    written(tier, 3)
    assert tier.longest_prefix(b) is None  # b was least recently used
    assert tier.longest_prefix(a) is not None and tier.longest_prefix(c) is not None
    stats = tier.stats()
    assert stats["evictions"] == 1 and stats["entries"] == 2
    assert stats["bytes"] <= tier.max_bytes and len(files(tier)) == 2
    tier.close()


def test_restart_finds_the_entries(tmp_path: Path, model: Any) -> None:
    tokens = list(range(3, 40))
    first = DiskTier(tmp_path, FP, 1 << 30)
    first.put(tokens, prefill(model, tokens))
    first.put([5, 6, 7], kv(3))
    first.close()
    second = DiskTier(tmp_path, FP, 1 << 30)
    assert second.stats()["entries"] == 2 and second.stats()["corrupt"] == 0
    usable, key = second.longest_prefix(tokens + [1]) or (0, "")
    assert usable == len(tokens)
    loaded = second.load(key, usable)
    assert loaded is not None and loaded[0].offset == len(tokens)
    second.close()


def test_a_smaller_bound_at_restart_evicts_the_oldest(tmp_path: Path) -> None:
    first = DiskTier(tmp_path, FP, 1 << 30)
    first.put([1, 2, 3], kv(3))
    first.close()
    old = files(first)[0]
    os.utime(old, ns=(1, 1))  # used long ago
    first = DiskTier(tmp_path, FP, 1 << 30)
    first.put([4, 5, 6], kv(3))
    first.close()
    second = DiskTier(tmp_path, FP, old.stat().st_size + 10)
    assert second.stats()["entries"] == 1 and second.stats()["evictions"] == 1
    assert not old.exists() and second.longest_prefix([4, 5, 6]) is not None
    second.close()


def _one_file(tmp_path: Path) -> Path:
    tier = DiskTier(tmp_path, FP, 1 << 30)
    tier.put(list(range(1, 11)), kv(10))
    tier.close()
    return files(tier)[0]


def test_a_flipped_byte_is_caught_on_load(tmp_path: Path) -> None:
    path = _one_file(tmp_path)
    tier = DiskTier(tmp_path, FP, 1 << 30)  # the header is intact: indexed
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    hit = tier.longest_prefix(list(range(1, 11)))
    assert hit is not None
    assert tier.load(hit[1], 10) is None
    assert not path.exists()
    assert tier.stats()["corrupt"] == 1 and tier.stats()["entries"] == 0
    assert tier.longest_prefix(list(range(1, 11))) is None
    tier.close()


def test_a_file_removed_by_another_process_is_a_miss(tmp_path: Path) -> None:
    path = _one_file(tmp_path)
    tier = DiskTier(tmp_path, FP, 1 << 30)
    hit = tier.longest_prefix(list(range(1, 11)))
    path.unlink()  # another worker of this model evicted it
    assert hit is not None and tier.load(hit[1], 10) is None
    stats = tier.stats()
    assert stats["missing"] == 1 and stats["corrupt"] == 0 and stats["entries"] == 0
    tier.close()


def test_a_file_removed_between_its_checksum_and_its_load_is_a_miss(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLX says "Failed to open file" (a RuntimeError, as an allocation failure is) for a
    file gone under it: a miss, counted, never a fault."""
    path = _one_file(tmp_path)
    tier = DiskTier(tmp_path, FP, 1 << 30)
    hit = tier.longest_prefix(list(range(1, 11)))
    checked = disk_format.check_checksum

    def then_removed(p: Path, crc: str) -> None:
        checked(p, crc)
        p.unlink()  # the writer made room, or a replica sharing the folder did

    monkeypatch.setattr(disk_format, "check_checksum", then_removed)
    assert hit is not None and tier.load(hit[1], 10) is None
    stats = tier.stats()
    assert stats["missing"] == 1 and stats["corrupt"] == 0 and stats["entries"] == 0
    tier.close()


def test_a_file_that_cannot_be_read_is_a_miss(tmp_path: Path) -> None:
    path = _one_file(tmp_path)
    tier = DiskTier(tmp_path, FP, 1 << 30)
    hit = tier.longest_prefix(list(range(1, 11)))
    path.unlink()
    path.mkdir()  # open() fails with EISDIR: an error other than "no such file", as EIO would
    assert hit is not None and tier.load(hit[1], 10) is None
    assert tier.stats()["missing"] == 1 and tier.longest_prefix(list(range(1, 11))) is None
    tier.close()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "foreign_name", "wrong_fingerprint",
                                    "not_ours", "abandoned_tmp"])
def test_untrusted_files_are_removed_and_counted_at_startup(tmp_path: Path, damage: str) -> None:
    path = _one_file(tmp_path)
    directory = path.parent
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "garbage":
        path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    elif damage == "foreign_name":
        path.rename(directory / "notes.txt")
    elif damage == "wrong_fingerprint":
        other = DiskTier(tmp_path, "fedcba9876543210", 1 << 30)
        other.put([1, 2, 3], kv(3))
        other.close()
        theirs = files(other)[0]
        path.unlink()
        theirs.rename(directory / theirs.name)
    elif damage == "not_ours":  # a well-formed mlx-lm cache file without our metadata
        save_prompt_cache(str(path), kv(10))
    elif damage == "abandoned_tmp":
        (directory / f"{disk_format.TMP_PREFIX}999999999-abc.safetensors").write_bytes(b"half")
    tier = DiskTier(tmp_path, FP, 1 << 30)
    assert tier.stats()["corrupt"] == 1
    left = [p.name for p in directory.iterdir()]
    assert left == ([path.name] if damage == "abandoned_tmp" else [])
    tier.close()


def test_a_full_queue_drops_and_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entered, release = threading.Event(), threading.Event()
    real_write = disk_format.write

    def slow_write(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        assert release.wait(WAIT_S), "the test never released the writer"
        return real_write(*args, **kwargs)

    monkeypatch.setattr(disk_format, "write", slow_write)
    tier = DiskTier(tmp_path, FP, 1 << 30, max_pending=1)
    tier.put([1, 2], kv(2))
    assert entered.wait(WAIT_S)      # the writer holds the first entry
    tier.put([3, 4], kv(2))          # queued
    tier.put([5, 6], kv(2))          # no room: dropped
    tier.put([3, 4], kv(2))          # already queued: nothing to do
    stats = tier.stats()
    assert stats["dropped"] == 1 and stats["pending"] == 2
    release.set()
    tier.close()
    stats = tier.stats()
    assert stats["writes"] == 2 and stats["entries"] == 2 and stats["pending_bytes"] == 0


def test_close_writes_everything_queued(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, FP, 1 << 30)
    for i in range(5):
        tier.put([i + 1, 50, 51], kv(3, seed=i))
    tier.close()
    tier.put([60, 61], kv(2))  # after close: ignored
    assert tier.stats()["writes"] == 5 and len(files(tier)) == 5


def test_the_writer_waits_for_a_quiet_engine(tmp_path: Path) -> None:
    # A write reads the arrays back from the device: while the engine steps it waits, so
    # the next request's first token does not (on the H200, 19-23 ms of TTFT otherwise).
    tier = DiskTier(tmp_path, FP, 1 << 30, quiet_s=0.05, max_defer_s=3600.0)
    tier.engine_busy(True)
    key = tier.put([1, 2, 3], kv(3))
    assert key is not None
    # While busy nothing is written, however long it stays busy (before the deadline).
    held = threading.Event()
    assert not held.wait(0.3)
    assert tier.stats()["writes"] == 0 and tier.pending_keys() == {key}
    tier.engine_busy(False)
    written(tier, 1)
    assert tier.pending_keys() == frozenset()
    # Busy again: a new entry waits, until the gate wants its memory (hurry).
    tier.engine_busy(True)
    tier.put([4, 5, 6], kv(3, seed=1))
    assert not held.wait(0.3)
    assert tier.stats()["writes"] == 1
    tier.hurry()
    written(tier, 2)
    # A hurry covers the jobs queued before it, not the ones after: those wait again.
    tier.put([7, 8, 9], kv(3, seed=2))
    assert not held.wait(0.3)
    assert tier.stats()["writes"] == 2
    tier.hurry()
    written(tier, 3)
    tier.close()


def test_an_entry_waits_at_most_max_defer_s_and_close_writes_at_once(tmp_path: Path) -> None:
    # Steady traffic never leaves the engine quiet: the entry is written by its deadline.
    tier = DiskTier(tmp_path, FP, 1 << 30, quiet_s=3600.0, max_defer_s=0.1)
    tier.engine_busy(True)
    tier.put([1, 2, 3], kv(3))
    written(tier, 1)
    tier.close()
    # Closing writes what is queued without waiting for quiet or the deadline.
    tier = DiskTier(tmp_path / "b", FP, 1 << 30, quiet_s=3600.0, max_defer_s=3600.0)
    tier.engine_busy(True)
    for i in range(3):
        tier.put([i + 1, 50], kv(2, seed=i))
    tier.close()
    assert tier.stats()["writes"] == 3


def test_deleting_the_directory_is_safe(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, FP, 1 << 30)
    tier.put([1, 2, 3], kv(3))
    written(tier, 1)
    shutil.rmtree(tmp_path / FP)
    assert tier.load(tier.longest_prefix([1, 2, 3, 4])[1], 3) is None  # type: ignore[index]
    tier.put([4, 5, 6], kv(3))
    tier.close()
    assert tier.stats()["writes"] == 2 and tier.stats()["missing"] == 1 and len(files(tier)) == 1


def test_bad_puts(tier: DiskTier, tmp_path: Path) -> None:
    tier.put([1, 2, 3], kv(4))  # the cache holds 4 tokens, not 3: refused, counted
    assert tier.stats()["write_errors"] == 1 and tier.stats()["pending"] == 0
    small = DiskTier(tmp_path / "small", FP, 100)
    small.put([1, 2, 3], kv(3))
    small.close()
    assert small.stats()["too_large"] == 1 and small.stats()["writes"] == 0


def test_options_and_default_root(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path / "home")}
    assert disk_cache.default_root(env) == tmp_path / "xdg" / "mlx-headroom" / "prompt-cache"
    assert disk_cache.default_root({"HOME": "/h"}) == Path("/h/.cache/mlx-headroom/prompt-cache")
    assert disk_cache.from_options(disk_bytes=0, fingerprint=FP, env=env) is None
    tier = disk_cache.from_options(disk_bytes=None, fingerprint=FP, env=env)
    assert tier is not None and tier.dir == disk_cache.default_root(env) / FP
    assert 0 < tier.max_bytes <= disk_cache.DEFAULT_MAX_BYTES
    assert (tier.dir.stat().st_mode & 0o777) == 0o700 == (tier.dir.parent.stat().st_mode & 0o777)
    tier.close()
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert disk_cache.from_options(disk_bytes=1 << 20, fingerprint=FP, env=env, root=blocked) is None
    assert disk_format.dir_name("a/b") != "a/b" and disk_format.dir_name(FP) == FP


def test_put_names_what_the_writer_holds_until_it_is_written(tmp_path: Path) -> None:
    small = disk_format.check_and_eval(kv(10), 10)
    tier = DiskTier(tmp_path, FP, 1 << 30, max_pending_bytes=small)
    try:
        key = tier.put(list(range(1, 11)), kv(10))
        assert key == disk_format.token_key(disk_format.as_ids(list(range(1, 11))))
        written(tier, 1)
        assert key not in tier.pending_keys() and tier.stats()["pending_bytes"] == 0
        assert tier.put(list(range(1, 11)), kv(10)) is None, "already on disk: nothing held"
        assert tier.put(list(range(1, 301)), kv(300)) is None and tier.stats()["dropped"] == 1
    finally:
        tier.close()


@pytest.mark.real_heads
def test_an_entry_shorter_than_the_first_head_is_never_offered(tier: DiskTier) -> None:
    assert disk_cache.HEAD_TOKENS == 16
    # What the index never offers, the prefix cache would not use either.
    assert disk_cache.HEAD_TOKENS <= prefix_cache.MIN_REUSE_TOKENS
    tier.put(list(range(1, 13)), kv(12))
    tier.put(list(range(1, 41)), kv(40, seed=1))
    written(tier, 2)
    assert tier.longest_prefix(list(range(1, 13)) + [99]) is None    # 12 tokens: prefill them
    assert tier.longest_prefix(list(range(1, 41)) + [99]) == (40, disk_format.token_key(
        disk_format.as_ids(list(range(1, 41)))))
    assert tier.longest_prefix(list(range(1, 21)) + [99])[0] == 20   # type: ignore[index]


@pytest.mark.real_heads
def test_a_lookup_compares_only_entries_that_share_its_head(tier: DiskTier,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Many conversations behind one 64-token system prompt, and others: the prompt that
    continues one of them finds it (the longest), comparing only entries of its heads."""
    system = list(range(100, 164))
    convs = [system + [200 + i] * 40 for i in range(12)]          # 104 tokens each, shared 64
    others = [[300 + i] + list(range(20 + i, 80 + i)) for i in range(12)]
    for i, ids in enumerate(convs + others):  # one at a time: the writer's queue is bounded
        tier.put(ids, kv(len(ids), seed=i))
        written(tier, i + 1)
    compared: list[int] = []
    real = disk_cache._Entry.usable_for
    monkeypatch.setattr(disk_cache._Entry, "usable_for",
                        lambda self, q: compared.append(len(self.ids)) or real(self, q))
    query = convs[5] + [7, 8, 9]
    assert tier.longest_prefix(query) == (104, disk_format.token_key(disk_format.as_ids(convs[5])))
    # Its deepest head (ids[:64], all twelve conversations share it) has a usable entry:
    # no other entry was compared.
    assert len(compared) == len(convs)
    compared.clear()
    assert tier.longest_prefix(others[3][:50] + [1]) == (50, disk_format.token_key(
        disk_format.as_ids(others[3])))                           # a trimmed longer entry
    assert compared == [61]
    compared.clear()
    assert tier.longest_prefix([999] * 40) is None and compared == []
