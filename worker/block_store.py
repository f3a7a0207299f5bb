"""The prefix cache as KV blocks: each shared prefix held once, in RAM and on disk.

A sequence's KV is cut into blocks of ``BLOCK_TOKENS`` tokens (the last one may be
shorter: a *partial* block), each keyed by a hash chain over the model's fingerprint and
every token up to its end (``worker/block_format.py``). The blocks form a tree: a block's
children are the blocks that follow it in some stored sequence, so a system prompt and
tools that eight conversations share are one chain of blocks with eight branches below
it. A prompt's longest cached prefix is found by walking its blocks' keys from the root;
where the walk stops, the child that shares most of the prompt's next tokens is used as
far as it agrees (KV can be cut by tokens), so reuse is exact to the token, as a whole
sequence's was.

A hit assembles the per-layer ``KVCache`` that mlx-lm's ``BatchGenerator`` takes:
a lazy concatenation of its blocks' arrays (nothing is copied until the row joins the
batch; the concatenation and the batch's copy are then that step's transient, charged as
``Hit.nbytes``). A finished request stores only the blocks not already held; a shorter
partial block that a new one extends is dropped (superseded).

Memory, as the gate sees it (``CacheLedger``): every block in RAM is resident once,
however many sequences share it; blocks a hit holds for a request that has not joined the
batch are promised (pinned, with all their ancestors); the others are evictable, least
recently used leaves first (a block is never evicted before the blocks below it, so what
stays in RAM is always a prefix-closed tree). ``--prompt-cache-bytes`` bounds the RAM
blocks' bytes; ``--prompt-cache-entries`` the sequences (leaves) kept in RAM.

Disk (``worker/block_disk.py``): a conversation's end writes its blocks that are not on
disk yet (so each block is written once), and so does a capacity eviction; an eviction
for memory wanted now writes nothing. What is on disk is prefix-closed too (parents are
queued before children; least recently used leaves go first when the disk bound is
reached), so a restart rebuilds the tree from the files' headers; a block whose file
is damaged or foreign is removed and counted, and so are the blocks below it.

Only caches that can be cut by tokens (every layer a plain ``KVCache``) are kept as blocks
(``blockable``); others (recurrent or rotating state) keep exact whole-sequence entries
(``worker/prefix_cache.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from common.costmodel import KV_STEP_TOKENS
from worker.block_disk import BlockDisk
from worker.block_format import BlockFile, LayerKV, block_key, kv_nbytes, root_key
from worker.gate import CacheLedger
from worker.prefix_cache import MIN_REUSE_TOKENS, CacheTiers, EvictReason, common_prefix

log = logging.getLogger(__name__)

# A block is one step of mlx-lm's KV buffer: a reuse of whole blocks leaves the row's later
# growths at whole steps from its start, so its reach is exactly its length.
BLOCK_TOKENS = KV_STEP_TOKENS


def blockable(cache: Sequence[Any]) -> bool:
    """Caches that can be cut into blocks by tokens: every layer a plain KVCache."""
    return bool(cache) and all(type(c) is KVCache for c in cache)


@dataclass(eq=False, slots=True)
class Block:
    key: str
    parent: Block | None
    ids: np.ndarray                 # its own token ids (int32)
    start: int                      # tokens before it in every sequence that holds it
    nbytes: int = 0                 # its arrays' bytes (what a RAM copy holds)
    kv: list[LayerKV] | None = None  # the RAM copy, per layer
    file: BlockFile | None = None    # the disk copy
    children: dict[str, Block] = field(default_factory=dict)
    used_at: int = 0
    holders: int = 0                # hits holding it for a request not yet in the batch

    @property
    def end(self) -> int:
        return self.start + len(self.ids)

    def lineage(self) -> list[Block]:
        """Its ancestors and itself, first block first (the root excluded)."""
        out: list[Block] = []
        b: Block | None = self
        while b is not None and b.parent is not None:
            out.append(b)
            b = b.parent
        return out[::-1]


@dataclass(eq=False, slots=True)
class Hit:
    """A reuse handed to one request: its first ``tokens`` come from ``views``."""

    blocks: list[Block]
    tokens: int
    kind: str                       # prefix | trimmed (a block used in part) | disk
    views: list[Any]
    join_bytes: int
    # Of that, what is held beside the row's own copy while it joins: the blocks' lazy
    # concatenation, when there are several (one block is copied straight into the batch).
    assembled_bytes: int = 0

    @property
    def nbytes(self) -> int:
        """The transient its join costs: the assembled arrays and the batch's copy."""
        return self.join_bytes


def _readable(b: Block) -> bool:
    """In RAM or in a file. A block evicted while its write is queued is in neither: the
    writer holds its arrays until the file exists, and a lookup reads only the two tiers."""
    return b.kv is not None or b.file is not None


def _slice(kv: list[LayerKV], upto: int) -> list[LayerKV]:
    return [(k[..., :upto, :], v[..., :upto, :]) for k, v in kv]


def _assemble(parts: list[list[LayerKV]], tokens: int) -> list[Any]:
    out = []
    for layer in zip(*parts):
        c = KVCache()
        if len(layer) == 1:
            c.keys, c.values = layer[0]
        else:  # lazy: evaluated by the batch's merge, when the row joins
            c.keys = mx.concatenate([k for k, _ in layer], axis=2)
            c.values = mx.concatenate([v for _, v in layer], axis=2)
        c.offset = tokens
        out.append(c)
    return out


def _clear_mlx_cache() -> None:
    mx.clear_cache()


class BlockStore(CacheTiers):
    """The prefix cache's RAM tier of blocks, and the seam to their disk tier."""

    # ``store`` takes a row's extracted caches unevaluated and evaluates them one layer at
    # a time, copying out that layer's new blocks: the store's peak is one layer of the row
    # (the extraction is a lazy copy of the batch's buffers) and one layer of new blocks.
    copies_by_layer = True

    def __init__(self, *, fingerprint: str, num_layers: int, max_bytes: int, max_entries: int,
                 disk: BlockDisk | None = None, clear: Callable[[], None] = _clear_mlx_cache,
                 budget_share: float | None = None) -> None:
        super().__init__(max_bytes=max_bytes, max_entries=max_entries, disk=disk, clear=clear,
                         budget_share=budget_share)
        self.disk: BlockDisk | None = disk
        self.fingerprint = fingerprint
        self.num_layers = num_layers
        self.root = Block(root_key(fingerprint), None, np.zeros(0, np.int32), 0)
        self._blocks: dict[str, Block] = {}
        self._ram: dict[str, Block] = {}
        self._ram_bytes = 0
        self._promised_bytes = 0            # RAM blocks with holders, each once
        self._disk_bytes = 0
        self._spilled: dict[str, int] = {}  # gone from RAM, arrays held by the writer
        self.disk_counts = dict.fromkeys(("hits", "misses", "writes", "written_bytes", "corrupt",
                                          "missing", "evictions", "write_errors"), 0)
        if disk is not None:
            self._rebuild()

    # -- the loop's and the gate's view ------------------------------------------------

    def ledger(self) -> CacheLedger:
        self._settle()
        writing = self._writing()
        # Kept as running totals: the gate asks several times a step (what the writer holds
        # is usually nothing: it writes while the engine is idle).
        unwritten = sum(b.nbytes for k in writing if (b := self._ram.get(k)) is not None and not b.holders)
        pending = sum(n for k, n in self._spilled.items() if k in writing)
        return CacheLedger(resident_bytes=self._ram_bytes, promised_bytes=self._promised_bytes,
                           writing_bytes=unwritten, pending_bytes=pending)

    def evict(self, nbytes: int, reason: str) -> int:
        """Give back RAM blocks no request holds, least recently used leaves first, until
        ``nbytes`` are freed; nothing is written for them (the memory is wanted now)."""
        freed = self._free_ram(nbytes, reason, spill=False)
        if freed:
            self._clear()
            log.debug("evicted %d B of cached prompt blocks (%s)", freed, reason)
        if freed < nbytes and self._writing():
            self.hurry()
        return freed

    # -- lookup ----------------------------------------------------------------------

    def lookup(self, prompt: Sequence[int],
               restore_room: Callable[..., bool] | None = None) -> Hit | None:
        """The longest cached prefix of ``prompt`` (its last token always left to feed),
        pinned for it, or None. Blocks only on disk are read back when the gate has room
        for them (``restore_room(nbytes, tokens=)``, else ``room``); the caller releases
        the hit when its row joins the batch or is dropped."""
        self._settle()
        ids = np.asarray(prompt, dtype=np.int32)
        chain, last_use = self._walk(ids, len(ids) - 1)
        restored = False
        first_disk = next((i for i, b in enumerate(chain) if b.kv is None), len(chain))
        if first_disk < len(chain):
            got = self._restore(chain[first_disk:], chain, restore_room,
                                tokens=chain[-1].start + last_use)
            restored = got > 0
            if got < len(chain) - first_disk:
                chain = chain[:first_disk + got]
                last_use = len(chain[-1].ids) if chain else 0
        tokens = chain[-1].start + last_use if chain else 0
        if tokens < MIN_REUSE_TOKENS:
            return None
        self._clock += 1
        for b in chain:
            b.holders += 1
            self._promised_bytes += b.nbytes if b.holders == 1 else 0
            b.used_at = self._clock
        parts = [b.kv for b in chain[:-1]] + [_slice(chain[-1].kv, last_use)]  # type: ignore[misc]
        used = sum(b.nbytes for b in chain[:-1]) + chain[-1].nbytes * last_use // len(chain[-1].ids)
        kind = "disk" if restored else "trimmed" if last_use < len(chain[-1].ids) else "prefix"
        return Hit(chain, tokens, kind, _assemble(parts, tokens),  # type: ignore[arg-type]
                   join_bytes=used * (2 if len(chain) > 1 else 1),
                   assembled_bytes=used if len(chain) > 1 else 0)

    def release(self, hit: Hit) -> None:
        for b in hit.blocks:
            if b.holders > 0:
                b.holders -= 1
                self._promised_bytes -= b.nbytes if b.holders == 0 else 0
        hit.blocks = []
        hit.views = []

    def _walk(self, ids: np.ndarray, limit: int) -> tuple[list[Block], int]:
        """The blocks (either tier) that hold the longest prefix of ``ids[:limit]``, and how
        many tokens of the last one it uses."""
        chain: list[Block] = []
        node, pos = self.root, 0
        while pos + BLOCK_TOKENS <= limit:
            b = node.children.get(block_key(node.key, ids[pos:pos + BLOCK_TOKENS]))
            if b is None or not _readable(b):
                break
            chain.append(b)
            node, pos = b, pos + BLOCK_TOKENS
        rest = ids[pos:limit]
        # The child that agrees longest (one in RAM on a tie) is used as far as it agrees.
        ranked = [(common_prefix(c.ids, rest), c.kv is not None, c)
                  for c in node.children.values() if _readable(c)]
        use, _, best = max(ranked, key=lambda r: r[:2], default=(0, False, None))
        if best is not None and use:
            chain.append(best)
            return chain, use
        return chain, (BLOCK_TOKENS if chain else 0)

    def _restore(self, missing: list[Block], chain: list[Block],
                 room: Callable[..., bool] | None, tokens: int) -> int:
        """Read blocks back from disk into RAM, all or none of their room asked first;
        returns how many of them are now in RAM (a damaged file stops there)."""
        assert self.disk is not None
        nbytes = sum(b.nbytes for b in missing)
        asked = room(nbytes, tokens=tokens) if room is not None else self.room(nbytes)
        if nbytes > self.max_bytes or not asked or not self._fit_ram(nbytes, protect=chain):
            return 0
        done = 0
        for b in missing:
            if b.file is None:  # not expected (its file is protected above); a miss from here
                break
            kv, failure = self.disk.read(b.file, self.num_layers)
            if kv is None or kv_nbytes(kv) != b.nbytes:
                self.disk_counts[failure or "corrupt"] += 1
                self._forget(b, "corrupt")  # and the blocks below it: they cannot be reached
                break
            self._put_ram(b, kv)
            self.disk.touch(b.file)  # the order survives a restart
            done += 1
        self.disk_counts["hits" if done else "misses"] += 1
        return done

    # -- store -----------------------------------------------------------------------

    def wants(self, num_tokens: int, prompt: Sequence[int], estimate_bytes: int) -> bool:
        """Should ``prompt[:num_tokens]`` be stored? Only when some of it is not in RAM
        yet, and the extraction's copy (``estimate_bytes``) and the new blocks fit now."""
        if num_tokens < MIN_REUSE_TOKENS or self.max_entries == 0:
            return False
        self._settle()
        ids = np.asarray(prompt[:num_tokens], dtype=np.int32)
        plan = self._plan(ids)
        new = sum(e - s for _, s, e, b in plan if b is None or b.kv is None)
        if new == 0:
            self._touch([b for _, _, _, b in plan if b is not None] or self._covering(ids))
            return False
        new_bytes = estimate_bytes * new // num_tokens
        # One layer of the extraction (``estimate_bytes``) and of the new blocks at a time.
        peak = (estimate_bytes + new_bytes) // max(1, self.num_layers)
        if new_bytes > self.max_bytes or not self.room(peak):
            self.num_skipped += 1
            return False
        return True

    def store(self, tokens: Sequence[int], cache: list[Any], *, keep: bool = False) -> bool:
        """Keep the blocks of one row's caches that are not held yet. ``keep``: a
        conversation's latest state, written to disk now. False when skipped.

        ``cache`` may be unevaluated (a lazy extraction from the batch): each layer is
        evaluated as its new blocks are copied out, then let go (the caller's caches are
        emptied), so the store's peak is one layer of the row and of its new blocks."""
        self._settle()
        ids = np.asarray(tokens, dtype=np.int32)
        n = len(ids)
        if n < MIN_REUSE_TOKENS or self.max_entries == 0 or not blockable(cache) \
                or any(c.offset != n for c in cache):
            return False
        plan = self._plan(ids)
        if not plan:
            return False
        per_token = sum(c.keys[..., :n, :].nbytes + c.values[..., :n, :].nbytes for c in cache) / n
        new_bytes = int(sum(e - s for _, s, e, b in plan if b is None or b.kv is None) * per_token)
        protect = [b for _, _, _, b in plan if b is not None]
        if new_bytes and not self._fit_ram(new_bytes, protect=protect) \
                or any(self._blocks.get(b.key) is not b for b in protect):
            self.num_skipped += 1  # (the second: a known block gone while room was made)
            return False
        chain: list[Block] = []
        made: list[tuple[Block, int, int]] = []
        for parent_key, s, e, b in plan:
            parent = chain[-1] if chain else self.root
            assert parent.key == parent_key
            if b is None:
                b = Block(block_key(parent.key, ids[s:e]), parent, ids[s:e].copy(), s)
            if b.kv is None:
                made.append((b, s, e))
            chain.append(b)
        copies: list[list[LayerKV]] = [[] for _ in made]
        for c in cache:
            for out, (_, s, e) in zip(copies, made):
                out.append((mx.array(c.keys[..., s:e, :]), mx.array(c.values[..., s:e, :])))
            mx.eval([a for out in copies for a in out[-1]])
            c.keys = c.values = None  # this layer of the extraction goes now
        # Linked only now: a copy that fails (a memory error) leaves no block in neither tier.
        for b in chain:
            if b.parent is not None and b.key not in self._blocks:
                b.parent.children[b.key] = b
                self._blocks[b.key] = b
        for (b, _, _), kv in zip(made, copies):
            self._put_ram(b, kv)
        self._touch(chain)
        for b, _, _ in made:
            self._supersede(b)
        self.num_stores += 1
        self._bound_entries()
        if keep:
            self._write(chain[-1])
        return True

    def _plan(self, ids: np.ndarray) -> list[tuple[str, int, int, Block | None]]:
        """The blocks ``ids`` cut into: (parent key, start, end, the block if known). A tail
        that a known block already begins with needs no block of its own."""
        plan: list[tuple[str, int, int, Block | None]] = []
        node, pos, n = self.root, 0, len(ids)
        while pos < n:
            end = min(pos + BLOCK_TOKENS, n)
            b = node.children.get(block_key(node.key, ids[pos:end]))
            if b is None and end - pos < BLOCK_TOKENS:
                rest = ids[pos:end]
                if any(c.kv is not None and common_prefix(c.ids, rest) == len(rest)
                       for c in node.children.values()):
                    break
            plan.append((node.key, pos, end, b))
            if b is None:
                node = Block(block_key(node.key, ids[pos:end]), None, ids[pos:end], pos)
            else:
                node = b
            pos = end
        return plan

    def _covering(self, ids: np.ndarray) -> list[Block]:
        chain, _ = self._walk(ids, len(ids))
        return chain

    def _supersede(self, new: Block) -> None:
        """Shorter partial siblings that ``new`` begins with serve nothing it does not."""
        parent = new.parent
        assert parent is not None
        for c in list(parent.children.values()):
            if c is not new and len(c.ids) < len(new.ids) and not c.holders and not c.children \
                    and np.array_equal(new.ids[:len(c.ids)], c.ids):
                self._forget(c, EvictReason.SUPERSEDED)

    # -- RAM -------------------------------------------------------------------------

    def _put_ram(self, b: Block, kv: list[LayerKV]) -> None:
        b.kv = kv
        b.nbytes = kv_nbytes(kv)
        if b.key not in self._ram:
            self._ram[b.key] = b
            self._ram_bytes += b.nbytes

    def _drop_ram(self, b: Block, reason: str) -> int:
        """Drop a block's RAM copy (its disk copy stays; without one it is forgotten)."""
        self._ram.pop(b.key, None)
        self._ram_bytes -= b.nbytes
        b.kv = None
        if b.key in self._writing():
            self._spilled[b.key] = b.nbytes
        self.evictions[reason] = self.evictions.get(reason, 0) + 1
        if b.file is None and b.key not in self._spilled:
            self._forget(b, None)
        return b.nbytes

    def _lru(self, blocks: list[Block]) -> list[Block]:
        """Least recently used first; of equal use, deeper first (leaves before parents)."""
        return sorted(blocks, key=lambda b: (b.used_at, -b.start))

    def _free_ram(self, nbytes: int, reason: str, *, spill: bool, protect: Sequence[Block] = ()) -> int:
        """Evict RAM leaves, least recently used first, until ``nbytes`` are freed."""
        freed, keep = 0, {id(b) for b in protect}
        while freed < nbytes:
            writing = self._writing()
            leaves = [b for b in self._ram.values() if not b.holders and b.key not in writing
                      and id(b) not in keep and not any(c.kv is not None for c in b.children.values())]
            if not leaves:
                break
            for b in self._lru(leaves):
                if freed >= nbytes:
                    break
                if spill and b.file is None:
                    self._write(b, protect)  # never by removing the file of a block the caller needs
                freed += self._drop_ram(b, reason)
        return freed

    def _fit_ram(self, nbytes: int, protect: Sequence[Block] = ()) -> bool:
        """Room within ``--prompt-cache-bytes`` for ``nbytes`` more, by evicting least
        recently used leaves (written to disk: a capacity eviction), only if that is enough."""
        if nbytes > self.max_bytes:
            return False
        over = self._ram_bytes + nbytes - self.max_bytes
        if over <= 0:
            return True
        keep, writing = {id(b) for b in protect}, self._writing()
        evictable = sum(b.nbytes for b in self._ram.values()
                        if not b.holders and b.key not in writing and id(b) not in keep)
        if evictable < over:
            return False
        self._free_ram(over, EvictReason.CAPACITY, spill=True, protect=protect)
        return self._ram_bytes + nbytes <= self.max_bytes

    def _bound_entries(self) -> None:
        """At most ``max_entries`` sequences (RAM leaves): the least recently used go."""
        leaves = [b for b in self._ram.values() if not any(c.kv is not None for c in b.children.values())]
        for leaf in self._lru(leaves)[:max(0, len(leaves) - self.max_entries)]:
            b: Block | None = leaf
            # The whole branch up to where another sequence shares it.
            while b is not None and b.parent is not None and b.kv is not None and not b.holders \
                    and not any(c.kv is not None for c in b.children.values()):
                parent = b.parent
                if b.file is None:
                    self._write(b)
                self._drop_ram(b, EvictReason.CAPACITY)
                b = None if any(c.kv is not None for c in parent.children.values()) else parent

    def _touch(self, chain: list[Block]) -> None:
        self._clock += 1
        for b in chain:
            b.used_at = self._clock

    def _forget(self, b: Block, reason: str | None) -> None:
        """Remove a block and every block below it from both tiers."""
        for c in list(b.children.values()):
            self._forget(c, "orphan" if reason == "corrupt" else reason)
        if b.parent is not None:
            b.parent.children.pop(b.key, None)
        self._blocks.pop(b.key, None)
        if b.key in self._ram:
            self._ram.pop(b.key)
            self._ram_bytes -= b.nbytes
            if b.key in self._writing():
                self._spilled[b.key] = b.nbytes
            if reason is not None:
                self.evictions[reason] = self.evictions.get(reason, 0) + 1
        b.kv = None
        if b.file is not None:
            self._disk_bytes -= b.file.file_bytes
            if self.disk is not None:
                self.disk.remove(b.file)
            b.file = None

    # -- disk ------------------------------------------------------------------------

    def _writing(self) -> frozenset[str]:
        return self.disk.pending_keys() if self.disk is not None else frozenset()

    def _write(self, b: Block, protect: Sequence[Block] = ()) -> None:
        """Queue ``b`` and its ancestors that are not on disk yet, parents first (so what is
        on disk stays a tree). Stops at the first the disk cannot take. Room on disk is
        made without removing the files of ``protect``: a spill while a lookup restores
        or a store extends a chain must not delete that chain's disk-only blocks."""
        if self.disk is None:
            return
        writing = self._writing()
        chain = b.lineage()
        keep = [*chain, *protect]
        for x in chain:
            if x.file is not None or x.key in writing:
                continue
            if x.kv is None or not self._fit_disk(x.nbytes, protect=keep) \
                    or not self.disk.put(x.key, x.parent.key if x.parent else self.root.key, x.ids, x.kv):
                return

    def _fit_disk(self, nbytes: int, protect: Sequence[Block]) -> bool:
        """Room on disk for ``nbytes`` more, removing least recently used leaf files."""
        assert self.disk is not None
        keep = {id(b) for b in protect}
        pending = self.disk.pending_bytes()

        def fits() -> bool:
            return self._disk_bytes + pending + nbytes <= self.disk.max_bytes  # type: ignore[union-attr]

        while not fits():
            writing = self._writing()
            leaves = [b for b in self._blocks.values() if b.file is not None and id(b) not in keep
                      and not any(c.file is not None or c.key in writing for c in b.children.values())]
            if not leaves:
                break
            for b in self._lru(leaves):
                if fits():
                    break
                self.disk_counts["evictions"] += 1
                self._drop_file(b)
        return fits()

    def _drop_file(self, b: Block) -> None:
        assert b.file is not None and self.disk is not None
        self._disk_bytes -= b.file.file_bytes
        self.disk.remove(b.file)
        b.file = None
        if b.kv is None and b.key not in self._spilled:
            self._forget(b, None)

    def _settle(self) -> None:
        """Take in the writes the disk tier finished since the last look."""
        if self.disk is None:
            return
        # Before the results: the writer publishes a key's result before the key leaves its
        # pending set, so a spilled key not pending now has its result in hand below (or
        # had it earlier, when the block was dropped just after that result was taken in).
        writing = self._writing()
        for key, info in self.disk.written():
            b = self._blocks.get(key)
            spilled = self._spilled.pop(key, None) is not None
            if info is None:
                self.disk_counts["write_errors"] += 1
                if b is not None and spilled and b.kv is None:
                    self._forget(b, None)  # in neither tier any more
                continue
            if b is None or b.file is not None:
                self.disk.remove(info)  # forgotten (superseded) while it was being written
                continue
            b.file = info
            self._disk_bytes += info.file_bytes
            self.disk_counts["writes"] += 1
            self.disk_counts["written_bytes"] += info.file_bytes
        for key in [k for k in self._spilled if k not in writing]:
            del self._spilled[key]
            b = self._blocks.get(key)
            if b is not None and b.kv is None and b.file is None:
                self._forget(b, None)  # in neither tier

    def _rebuild(self) -> None:
        """Index what an earlier process left: every file whose parents are all on disk
        (others cannot be reached: removed and counted)."""
        assert self.disk is not None
        found, num_bad = self.disk.scan()
        by_parent: dict[str, list[BlockFile]] = {}
        for info in found:
            by_parent.setdefault(info.parent, []).append(info)
        order = {info.key: i for i, info in enumerate(found)}  # least recently used first
        todo = [self.root]
        while todo:
            node = todo.pop()
            for info in by_parent.pop(node.key, []):
                if node is not self.root and len(node.ids) != BLOCK_TOKENS:
                    continue  # only whole blocks have children: left unreachable below
                b = Block(info.key, node, info.ids, node.end, nbytes=info.data_bytes, file=info,
                          used_at=order[info.key] - len(found))
                node.children[b.key] = b
                self._blocks[b.key] = b
                self._disk_bytes += info.file_bytes
                todo.append(b)
        for b in sorted(self._blocks.values(), key=lambda b: -b.start):  # a parent is used with its children
            if b.parent is not None and b.parent is not self.root:
                b.parent.used_at = max(b.parent.used_at, b.used_at)
        orphans = [info for infos in by_parent.values() for info in infos]
        for info in orphans:
            self.disk.remove(info)
        self.disk_counts["corrupt"] += num_bad + len(orphans)
        self._fit_disk(0, ())
        if found or num_bad:
            log.info("prompt cache: %d blocks (%d bytes) on disk in %s; %d untrusted or unreachable "
                     "files removed", len(self._blocks), self._disk_bytes, self.disk.dir,
                     num_bad + len(orphans))

    # -- report ----------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        ledger = self.ledger()
        shared, shared_bytes = self._shared()
        ram_leaves = sum(1 for b in self._ram.values() if not any(c.kv is not None for c in b.children.values()))
        ram = {"entries": ram_leaves, "bytes": ledger.resident_bytes, "blocks": len(self._ram)}
        disk = None
        if self.disk is not None:
            on_disk = [b for b in self._blocks.values() if b.file is not None]
            disk = {"entries": sum(1 for b in on_disk if not any(c.file for c in b.children.values())),
                    "bytes": self._disk_bytes, "blocks": len(on_disk),
                    "pending": len(self._writing()), "pending_bytes": self.disk.pending_bytes(),
                    "dropped": self.disk.num_dropped, **self.disk_counts}
        return {
            "enabled": True, **self.counts.report(), "stores": self.num_stores,
            "skipped_stores": self.num_skipped, "entries": ram_leaves,
            "ram_bytes": ledger.resident_bytes, "max_bytes": self.max_bytes,
            "max_entries": self.max_entries, "evictable_bytes": ledger.evictable_bytes,
            "promised_bytes": ledger.promised_bytes, "writing_bytes": ledger.writing_bytes,
            "pending_bytes": ledger.pending_bytes, "evictions": dict(self.evictions),
            "blocks": {"block_tokens": BLOCK_TOKENS, "held": len(self._blocks), "ram": len(self._ram),
                       "disk": disk["blocks"] if disk else 0, "shared": shared,
                       "shared_bytes": shared_bytes,
                       "written": self.disk_counts["writes"],
                       "written_bytes": self.disk_counts["written_bytes"]},
            "tiers": {"ram": ram, "disk": disk},
        }

    def _shared(self) -> tuple[int, int]:
        """Blocks (and their bytes) that more than one stored sequence holds."""
        leaves: dict[str, int] = {}
        for b in sorted(self._blocks.values(), key=lambda b: -b.start):
            leaves[b.key] = max(1, sum(leaves.get(c.key, 0) for c in b.children.values()))
        shared = [b for b in self._blocks.values() if leaves[b.key] > 1]
        return len(shared), sum(b.nbytes for b in shared)
