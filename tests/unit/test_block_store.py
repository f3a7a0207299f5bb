"""Tests for worker/block_store.py, block_disk.py and block_format.py: the prefix cache as
KV blocks, on real MLX arrays (a few tiny layers: no model).

Each position's keys and values are a function of the token there and its position, so an
assembled hit can be compared value for value with the sequence it came from.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from worker import block_format as bfmt
from worker.block_disk import BlockDisk
from worker.block_store import BLOCK_TOKENS, BlockStore, blockable

LAYERS, HEADS, DIM = 2, 2, 4
PER_TOKEN = 2 * LAYERS * HEADS * DIM * 4  # keys and values, float32
FP = "test-model"
B = BLOCK_TOKENS


def seq(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def row(tokens: list[int]) -> list[Any]:
    """One row's per-layer KVCache for ``tokens``: position t holds (layer, token, t)."""
    ids = mx.array(tokens, dtype=mx.float32)
    pos = mx.arange(len(tokens), dtype=mx.float32)
    out = []
    for layer in range(LAYERS):
        base = (ids * 10 + pos * 0.001 + layer)[None, None, :, None]
        c = KVCache()
        c.keys = mx.broadcast_to(base, (1, HEADS, len(tokens), DIM)) + 0
        c.values = mx.broadcast_to(-base, (1, HEADS, len(tokens), DIM)) + 0
        c.offset = len(tokens)
        mx.eval(c.keys, c.values)
        out.append(c)
    return out


def make(tmp: Path | None = None, max_bytes: int = 1 << 30, max_entries: int = 32,
         disk_bytes: int = 1 << 30) -> BlockStore:
    disk = BlockDisk(tmp, FP, disk_bytes) if tmp is not None else None
    return BlockStore(fingerprint=FP, num_layers=LAYERS, max_bytes=max_bytes,
                      max_entries=max_entries, disk=disk, clear=lambda: None)


def put(store: BlockStore, tokens: list[int], keep: bool = False) -> bool:
    return store.store(tokens, row(tokens), keep=keep)


def same_as(hit_views: list[Any], tokens: list[int]) -> bool:
    """The hit's caches hold exactly what a row of ``tokens`` holds."""
    want = row(tokens)
    n = len(tokens)
    return all(v.offset == n and mx.array_equal(v.keys[..., :n, :], w.keys).item()
               and mx.array_equal(v.values[..., :n, :], w.values).item() for v, w in zip(hit_views, want))


def flush(store: BlockStore) -> None:
    """Wait (bounded) until the disk writer has written what is queued."""
    assert store.disk is not None
    store.disk.hurry()
    deadline = time.monotonic() + 30
    while store.disk.pending_keys() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not store.disk.pending_keys()
    store.ledger()  # takes the finished writes in


def written(tmp: Path, tokens: list[int], fingerprint: str = FP) -> Path:
    """A store's disk tier left holding ``tokens`` (written, closed); its blocks folder."""
    store = BlockStore(fingerprint=fingerprint, num_layers=LAYERS, max_bytes=1 << 30, max_entries=8,
                       disk=BlockDisk(tmp, fingerprint, 1 << 30), clear=lambda: None)
    put(store, tokens, keep=True)
    flush(store)
    store.close()
    return tmp / fingerprint / "blocks"


def block_file(folder: Path, first_token: int) -> Path:
    """The block file whose ids start with ``first_token``."""
    (path,) = [p for p in folder.glob("b-*") if bfmt.inspect(p, FP).ids[0] == first_token]
    return path


def test_only_plain_kv_caches_are_blocks() -> None:
    assert blockable(row(seq(20)))
    assert not blockable([])
    assert not blockable([*row(seq(20)), object()])


def test_a_hit_assembles_exactly_the_prefix_and_leaves_the_last_token() -> None:
    store = make()
    tokens = seq(600)  # two whole blocks and a partial one
    assert put(store, tokens)
    assert store.report()["blocks"]["ram"] == 3
    assert store.ledger().resident_bytes == 600 * PER_TOKEN
    hit = store.lookup(tokens + seq(50, 7000))
    assert hit is not None and hit.tokens == 600 and same_as(hit.views, tokens)
    store.release(hit)
    exact = store.lookup(tokens)  # the whole prompt again: its last token is fed
    assert exact is not None and exact.tokens == 599 and same_as(exact.views, tokens[:599])


def test_a_prompt_that_diverges_inside_a_block_reuses_it_up_to_that_token() -> None:
    store = make()
    put(store, seq(600))
    prompt = seq(300) + seq(100, 9000)
    hit = store.lookup(prompt)
    assert hit is not None and hit.tokens == 300 and hit.kind == "trimmed"
    assert same_as(hit.views, seq(300))


def test_conversations_sharing_a_system_prompt_hold_it_once() -> None:
    store = make()
    system = seq(2 * B + 40)
    chats = [system + seq(300, 10_000 * (i + 1)) for i in range(6)]
    put(store, chats[0])
    one = store.ledger().resident_bytes
    for chat in chats[1:]:
        put(store, chat)
    # Each later chat adds its own tokens and at most the shared block it diverges in.
    added = store.ledger().resident_bytes - one
    assert added <= 5 * (300 + 40) * PER_TOKEN
    report = store.report()["blocks"]
    assert report["shared"] == 2 and report["shared_bytes"] == 2 * B * PER_TOKEN
    for chat in chats:
        hit = store.lookup(chat + [1])
        assert hit is not None and hit.tokens == len(chat) and same_as(hit.views, chat)
        store.release(hit)


def test_a_longer_sequence_supersedes_the_partial_block_it_extends() -> None:
    store = make()
    put(store, seq(B + 44))
    put(store, seq(3 * B))
    assert store.report()["blocks"]["ram"] == 3
    assert store.ledger().resident_bytes == 3 * B * PER_TOKEN
    assert store.evictions.get("superseded") == 1
    assert not store.wants(B + 44, seq(B + 44), (B + 44) * PER_TOKEN)  # already held


def test_a_shared_block_is_promised_once_and_never_evicted_while_held() -> None:
    store = make()
    put(store, seq(B) + seq(100, 5000))
    put(store, seq(B) + seq(100, 6000))
    a = store.lookup(seq(B) + seq(100, 5000) + [1])
    b = store.lookup(seq(B) + seq(100, 6000) + [1])
    assert a is not None and b is not None
    ledger = store.ledger()
    assert ledger.resident_bytes == (B + 200) * PER_TOKEN
    assert ledger.promised_bytes == ledger.resident_bytes  # the shared block counted once
    assert store.evict(10**9, "admission") == 0 and ledger.evictable_bytes == 0
    store.release(a)
    assert store.ledger().evictable_bytes == 100 * PER_TOKEN  # the shared block is still b's
    store.release(b)
    assert store.evict(10**9, "admission") == (B + 200) * PER_TOKEN
    assert store.ledger().resident_bytes == 0 and store.lookup(seq(B) + seq(100, 5000)) is None


def test_least_recently_used_leaves_go_first_and_parents_after_their_children() -> None:
    store = make()
    old, new = seq(B) + seq(100, 5000), seq(B) + seq(100, 6000)
    put(store, old)
    put(store, new)
    assert store.evict(1, "admission") == 100 * PER_TOKEN  # old's own block, not the shared one
    assert store.lookup(old + [1]).tokens == B  # type: ignore[union-attr]
    hit = store.lookup(new + [1])
    assert hit is not None and hit.tokens == len(new)


def test_the_byte_bound_evicts_lru_leaves_and_skips_what_cannot_fit() -> None:
    store = make(max_bytes=3 * B * PER_TOKEN)
    put(store, seq(2 * B, 100))
    put(store, seq(2 * B, 5000))  # needs one of the first sequence's blocks
    assert store.ledger().resident_bytes <= 3 * B * PER_TOKEN
    assert store.lookup(seq(2 * B, 5000) + [1]).tokens == 2 * B  # type: ignore[union-attr]
    assert not put(store, seq(4 * B, 9000))  # larger than the bound: skipped, not forced
    assert store.num_skipped == 1


def test_the_entry_bound_counts_sequences() -> None:
    store = make(max_entries=2)
    for start in (100, 5000, 9000):
        put(store, seq(B + 10, start))
    assert store.report()["tiers"]["ram"]["entries"] == 2
    assert store.lookup(seq(B + 10, 100) + [1]) is None


def test_only_new_blocks_are_written_and_a_restart_finds_them(tmp_path: Path) -> None:
    store = make(tmp_path)
    turn1 = seq(2 * B + 30)
    put(store, turn1, keep=True)
    flush(store)
    turn2 = turn1 + seq(B, 20_000)
    put(store, turn2, keep=True)
    flush(store)
    written = store.report()["blocks"]
    # turn 1: 2 blocks + a partial; turn 2: its 2 new blocks (the partial is superseded).
    assert written["written"] == 5 and store.report()["tiers"]["disk"]["blocks"] == 4
    store.close()

    again = make(tmp_path)
    assert again.report()["tiers"]["disk"]["blocks"] == 4 and again.ledger().resident_bytes == 0
    hit = again.lookup(turn2 + [1])
    assert hit is not None and hit.kind == "disk" and hit.tokens == len(turn2)
    assert same_as(hit.views, turn2)
    again.release(hit)
    again.close()


def test_a_damaged_block_is_removed_counted_and_never_loaded(tmp_path: Path) -> None:
    tokens = seq(3 * B)
    folder = written(tmp_path, tokens)
    assert len(list(folder.glob("b-*.safetensors"))) == 3
    second = block_file(folder, tokens[B])
    data = bytearray(second.read_bytes())
    data[-5] ^= 0xFF  # a flipped byte in its arrays: the header is intact
    second.write_bytes(bytes(data))

    again = make(tmp_path)
    hit = again.lookup(tokens + [1])
    assert hit is not None and hit.tokens == B and same_as(hit.views, tokens[:B])
    report = again.report()["tiers"]["disk"]
    assert report["corrupt"] == 1 and report["blocks"] == 1  # the block below it is unreachable
    assert not second.exists()
    again.close()


def test_foreign_and_orphaned_files_are_removed_at_start(tmp_path: Path) -> None:
    tokens = seq(2 * B)
    blocks = written(tmp_path, tokens)
    block_file(blocks, tokens[0]).unlink()  # its child cannot be reached any more
    (blocks / "b-0123456789abcdef0123456789abcdef-00000000.safetensors").write_bytes(b"not ours")
    again = make(tmp_path)
    assert again.report()["tiers"]["disk"]["blocks"] == 0
    assert again.report()["tiers"]["disk"]["corrupt"] == 2
    assert list(blocks.glob("b-*")) == []
    again.close()


def test_another_models_block_is_removed_and_counted(tmp_path: Path) -> None:
    (theirs,) = written(tmp_path, seq(B), "other-model").glob("b-*")
    ours = tmp_path / FP / "blocks"
    ours.mkdir(parents=True)
    (ours / theirs.name).write_bytes(theirs.read_bytes())  # a valid file, of another model
    store = make(tmp_path)
    assert store.report()["tiers"]["disk"]["corrupt"] == 1 and list(ours.glob("b-*")) == []
    assert store.lookup(seq(B) + [1]) is None
    store.close()


def test_the_disk_bound_removes_lru_leaf_files(tmp_path: Path) -> None:
    probe = make(tmp_path / "probe")
    put(probe, seq(B), keep=True)
    flush(probe)
    one_file = probe.report()["tiers"]["disk"]["bytes"]
    probe.close()
    store = make(tmp_path / "bounded", disk_bytes=int(2.5 * one_file))
    for start in (100, 5000, 9000):
        put(store, seq(B, start), keep=True)
        flush(store)
    disk = store.report()["tiers"]["disk"]
    assert disk["blocks"] == 2 and disk["bytes"] <= 2.5 * one_file and disk["evictions"] == 1
    store.close()


@pytest.mark.parametrize("held", [False, True])
def test_a_restore_asks_for_room_first(tmp_path: Path, held: bool) -> None:
    store = make(tmp_path)
    tokens = seq(2 * B)
    put(store, tokens, keep=True)
    flush(store)
    store.close()
    again = make(tmp_path)
    asked: list[tuple[int, int]] = []

    def room(nbytes: int, tokens: int) -> bool:
        asked.append((nbytes, tokens))
        return held

    hit = again.lookup(tokens + [1], room)
    assert asked == [(2 * B * PER_TOKEN, 2 * B)]
    assert (hit is not None) is held
    assert again.ledger().resident_bytes == (2 * B * PER_TOKEN if held else 0)
    again.close()


@pytest.mark.parametrize("length", [B // 2, 2 * B + 30])
def test_a_block_evicted_while_its_write_is_queued_is_a_miss_until_written(tmp_path: Path, length: int) -> None:
    """The entry bound evicts a sequence to disk while the engine is busy (its write waits
    for an idle engine): until the file exists it is in neither tier, and a lookup of it is
    a miss, never a crash; once written it comes back from disk."""
    disk = BlockDisk(tmp_path, FP, 1 << 30, max_defer_s=600)
    store = BlockStore(fingerprint=FP, num_layers=LAYERS, max_bytes=1 << 30, max_entries=1,
                       disk=disk, clear=lambda: None)
    disk.engine_busy(True)
    first, second = seq(length, 100), seq(length, 9000)
    put(store, first)
    put(store, second)  # the bound of one sequence sends ``first`` to the writer
    assert disk.pending_keys() and store.report()["tiers"]["ram"]["entries"] == 1
    assert store.lookup(first + [1]) is None
    check_invariants(store, pending_ok=True)
    flush(store)
    hit = store.lookup(first + [1])
    assert hit is not None and hit.kind == "disk" and hit.tokens == length
    assert same_as(hit.views, first)
    store.release(hit)
    store.close()


def one_block_file_bytes(tmp: Path) -> int:
    probe = make(tmp)
    put(probe, seq(B), keep=True)
    flush(probe)
    nbytes = probe.report()["tiers"]["disk"]["bytes"]
    probe.close()
    return nbytes


def test_making_room_in_ram_never_removes_the_file_of_a_block_being_restored(tmp_path: Path) -> None:
    """RAM for one block, disk for one file: restoring A spills X to disk, and X's file
    needs A's room on disk. A's file is not removed for it (it was, and an assert in the
    restore ended the lookup); X is not written."""
    store = make(tmp_path / "s", max_bytes=B * PER_TOKEN,
                 disk_bytes=int(1.5 * one_block_file_bytes(tmp_path / "probe")))
    a = seq(B, 100)
    put(store, a, keep=True)
    flush(store)
    store.evict(10**12, "admission")  # A on disk only
    put(store, seq(B, 5000))  # X: in RAM only, used after A, the RAM bound reached
    hit = store.lookup(a + [1], lambda nbytes, tokens: True)
    assert hit is not None and (hit.kind, hit.tokens) == ("disk", B) and same_as(hit.views, a)
    store.release(hit)
    check_invariants(store, pending_ok=True)
    store.close()


def test_making_room_in_ram_never_removes_the_file_of_a_block_being_extended(tmp_path: Path) -> None:
    """A conversation comes back after its first block went to disk: storing its next turn
    makes RAM room by spilling an older sequence, whose file needs room on disk. The first
    block's file stays: the store goes on with a block still in the index (it once went on
    with a forgotten one, whose bytes the ledger then lost track of)."""
    store = make(tmp_path / "s", max_bytes=4 * B * PER_TOKEN,
                 disk_bytes=int(1.5 * one_block_file_bytes(tmp_path / "probe")))
    a = seq(B, 100)
    put(store, a, keep=True)
    flush(store)
    store.evict(10**12, "admission")  # A on disk only
    put(store, seq(3 * B, 5000))  # three blocks in RAM only, used after A
    conversation = a + seq(B, 7000)
    assert put(store, conversation)
    check_invariants(store, pending_ok=True)
    hit = store.lookup(conversation + [1], lambda nbytes, tokens: True)
    assert hit is not None and hit.tokens == 2 * B and same_as(hit.views, conversation)
    store.release(hit)
    flush(store)
    store.evict(2 * B * PER_TOKEN, "admission")
    put(store, conversation)
    check_invariants(store, pending_ok=True)
    store.close()


def test_a_block_file_that_cannot_be_read_is_a_miss_from_there_and_forgotten(tmp_path: Path) -> None:
    store = make(tmp_path)
    tokens = seq(2 * B, 100)
    put(store, tokens, keep=True)
    flush(store)
    store.evict(10**12, "admission")
    second = block_file(tmp_path / FP / "blocks", 100 + B)
    second.unlink()
    second.mkdir()  # open() fails with EISDIR: an error other than "no such file", as EIO would
    for kind in ("disk", "prefix"):  # the first block read back, then found in RAM
        hit = store.lookup(tokens + [1], lambda nbytes, tokens: True)
        assert hit is not None and (hit.kind, hit.tokens) == (kind, B)
        store.release(hit)
    assert store.report()["tiers"]["disk"]["missing"] == 1 and len(store._blocks) == 1
    check_invariants(store)
    store.close()


def test_a_write_that_fails_is_counted_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tries: list[str] = []

    def disk_full(directory: Path, key: str, *args: Any, **kwargs: Any) -> None:
        tries.append(key)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bfmt, "write", disk_full)
    store = make(tmp_path, max_entries=1)
    put(store, seq(2 * B, 100), keep=True)
    put(store, seq(2 * B, 9000), keep=True)  # the entry bound spills the first
    flush(store)
    check_invariants(store)
    disk = store.report()["tiers"]["disk"]
    assert disk["write_errors"] == len(tries) >= 4 and disk["writes"] == 0 and disk["blocks"] == 0
    store.close()


def test_whole_sequence_files_of_an_earlier_version_are_removed(tmp_path: Path) -> None:
    folder = tmp_path / FP
    folder.mkdir(parents=True)
    (folder / ("0" * 32 + "-00000000.safetensors")).write_bytes(b"an entry")
    store = make(tmp_path)
    assert list(folder.glob("*.safetensors")) == [] and (folder / "blocks").is_dir()
    store.close()


def check_invariants(store: BlockStore, pending_ok: bool = False) -> None:
    """The ledger counts each RAM block once; what is in RAM is a tree from the root; a
    held block's ancestors are held too."""
    # Taken before the ledger takes in the finished writes: a write that finishes after
    # that is still in this snapshot (the writer runs beside the test).
    pending = store.disk.pending_keys() if pending_ok and store.disk is not None else frozenset()
    ram = [b for b in store._blocks.values() if b.kv is not None]
    ledger = store.ledger()
    assert ledger.resident_bytes == sum(b.nbytes for b in ram)
    assert ledger.promised_bytes == sum(b.nbytes for b in ram if b.holders)
    for b in ram:
        assert b.parent is store.root or b.parent.kv is not None, "RAM is prefix-closed"
        if b.holders:
            assert all(a.holders for a in b.lineage()), "a hit holds its whole chain"
    for b in store._blocks.values():
        # A block evicted while its write is queued is in the writer until its file exists.
        assert b.kv is not None or b.file is not None or b.key in pending, "every block is in a tier"
        assert b.parent is not None and b.parent.children.get(b.key) is b, "every block is reachable"
    assert all(store._blocks.get(k) is b for k, b in store._ram.items()), "RAM holds indexed blocks only"
    assert set(store._spilled) <= pending, "a spilled block is one the writer still holds"


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("disk", ["none", "wide", "narrow"])
def test_random_stores_hits_and_evictions_keep_the_ledger_exact(seed: int, disk: str,
                                                               tmp_path: Path) -> None:
    """``narrow``: a disk bound of a few blocks, so making room in RAM also removes files."""
    rng = random.Random(seed)
    store = make(tmp_path if disk != "none" else None, max_bytes=6 * B * PER_TOKEN,
                 max_entries=2 if disk != "none" else 4,
                 disk_bytes=4 * B * PER_TOKEN if disk == "narrow" else 1 << 30)
    heads = [seq(rng.randrange(20, 2 * B), 100 * i) for i in range(3)]  # shared beginnings
    held = []
    for _ in range(40):
        tokens = rng.choice(heads) + seq(rng.randrange(1, B + 50), rng.randrange(10**6))
        if store.disk is not None:  # writes wait for an idle engine: evictions meet queued writes
            store.disk.engine_busy(rng.random() < 0.7)
        op = rng.random()
        if op < 0.45:
            put(store, tokens, keep=rng.random() < 0.3)
        elif op < 0.8:
            hit = store.lookup(tokens)
            if hit is not None:
                assert same_as(hit.views, tokens[:hit.tokens])
                held.append(hit)
        elif held:
            store.release(held.pop(rng.randrange(len(held))))
        else:
            store.evict(rng.randrange(1, 3 * B) * PER_TOKEN, "admission")
        check_invariants(store, pending_ok=True)
        assert store.ledger().resident_bytes <= store.max_bytes
    for hit in held:
        store.release(hit)
    check_invariants(store, pending_ok=True)
    assert store.ledger().promised_bytes == 0
    if store.disk is not None:
        flush(store)  # a block being written stays in RAM until its file exists
    store.evict(10**12, "admission")
    assert store.ledger().resident_bytes == 0
    store.close()


def test_a_lazy_extraction_is_copied_out_one_layer_at_a_time() -> None:
    """The store's peak: the new blocks and one layer of the row's extraction (evaluating
    the whole extraction first would hold the row twice)."""
    layers, heads, dim, n, pad = 8, 4, 64, 3 * B, 10
    batch = [(mx.random.normal((2, heads, n + pad, dim)), mx.random.normal((2, heads, n + pad, dim)))
             for _ in range(layers)]
    mx.eval(batch)
    row = []
    for k, v in batch:  # as mlx-lm extracts a row from the batch: a lazy contiguous copy
        c = KVCache()
        c.keys, c.values, c.offset = mx.contiguous(k[1:2, :, pad:]), mx.contiguous(v[1:2, :, pad:]), n
        row.append(c)
    store = BlockStore(fingerprint=FP, num_layers=layers, max_bytes=1 << 32, max_entries=8, clear=lambda: None)
    one_layer = 2 * heads * n * dim * 4
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    assert store.store(seq(n), row)
    assert all(c.keys is None for c in row)  # the extraction is let go
    held = mx.get_active_memory() - before
    assert held == store.ledger().resident_bytes == layers * one_layer
    assert mx.get_peak_memory() - before <= held + one_layer


def test_boot_keeps_blocks_for_plain_kv_and_whole_entries_for_caches_that_cannot_be_cut(tmp_path: Path) -> None:
    from mlx_lm.models.cache import ArraysCache, RotatingKVCache

    from common.config import WorkerConfig
    from common.costmodel import CostModel
    from worker.boot import make_prefix_cache
    from worker.disk_cache import DiskTier, from_options
    from worker.prefix_cache import PrefixCache

    cfg = WorkerConfig(model="demo", router="ipc:///tmp/nobody")
    model = CostModel(kv_bytes_per_token=4096, num_layers=2, prefill_a_bytes=0.0, prefill_c_bytes=0.0,
                      growth_factor=1.0, budget_bytes=1 << 30, context_length=4096,
                      prefill_step_tokens=512, prefill_batch_size=8)

    def disk_for(max_pending_bytes: int, make: type) -> Any:
        return from_options(disk_bytes=1 << 30, fingerprint=FP, env={}, root=tmp_path,
                            max_pending_bytes=max_pending_bytes, make=make)

    for layers, kind, disk in (([KVCache(), KVCache()], BlockStore, BlockDisk),
                               ([RotatingKVCache(max_size=64), KVCache()], PrefixCache, DiskTier),
                               ([ArraysCache(2), KVCache()], PrefixCache, DiskTier)):
        cache = make_prefix_cache(cfg, model, fingerprint=FP, num_layers=len(layers),
                                  blocks=blockable(layers), disk_for=disk_for)
        assert type(cache) is kind and type(cache.disk) is disk and cache.max_bytes == 1 << 29
        cache.close()
