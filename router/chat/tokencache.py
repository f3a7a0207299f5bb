"""A chat's token ids reused from the turn before: a bounded LRU keyed by rendered text.

An agent resends its whole conversation every turn, and the rendered chat of turn n + 1
begins with most of turn n's text. Encoding is most of the router's time before the queue
(the chat template renders in a small fraction of it), so ``PrefixTokenCache.encode``
finds the cached text that shares the longest prefix with the new one, keeps its ids up
to a safe cut, and encodes only the rest. The result is the full encoding, id for id.

Where a cut is safe. A Hugging Face tokenizer first splits a text at its added tokens
that are not normalized (the chat markers: ``<|im_start|>``), scanning leftmost-longest;
each piece between two of them is then normalized, pre-tokenized and encoded on its own.
So when such a marker starts at ``s``, the ids of the text are the ids before the marker
followed by the ids of ``text[s:]``, provided the split up to ``s`` is the same in both
texts: it is, unless a marker could begin at or before ``s`` and run past the text they
share (``_last_safe_cut`` checks the few places where one could). The rest is encoded
starting with the marker itself, so a pre-tokenizer that treats a text's first piece
differently (Metaspace's ``prepend_scheme="first"``) sees each piece where the whole text
has it.

Where the markers are. An entry keeps, for each marker, its character start and its index
in the ids: the ids give the markers' order, and ``str.find`` over the distinct markers
plus one leftmost-longest pass (the tokenizer's own split, replayed) gives their places.
When the two do not pair one to one (a model that emits a marker's id itself, as ``<unk>``
for an unknown character), the entry keeps only the cuts it shares with the entry it came
from, and a later turn encodes the rest in full.
Tokenizers whose split cannot be replayed this way (a ``single_word`` marker, special tokens
encoded as text, BPE dropout) get no cache at all.

Bounded by entries and total tokens, least recently used first out; a turn that keeps
every cut of the entry it extends replaces that entry, so an append-only conversation
holds one. Thread-safe: the router encodes from a small thread pool.
"""

from __future__ import annotations

import logging
import threading
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from tokenizers import Tokenizer

__all__ = ["PrefixTokenCache"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Entry:
    text: str
    ids: array[int]             # 'I': 4 bytes a token, not a list's 36
    cut_chars: array[int]       # 'q': where each marker that may start a cut starts in text
    cut_index: array[int]       # 'q': that marker's index in ids


class PrefixTokenCache:
    """Encodes rendered chats, reusing the ids of earlier texts that share a prefix."""

    def __init__(self, encode: Callable[[str], list[int]], markers: dict[int, str], *,
                 cut_ids: frozenset[int], max_entries: int, max_tokens: int) -> None:
        self._encode = encode
        self._markers = markers            # every non-normalized added token: id -> its text
        self._cut_ids = cut_ids            # those a cut may start at
        self._window = max(len(text) for text in markers.values())
        # What a text may end with and still become a marker once more text follows
        self._partial = frozenset(text[:n] for text in markers.values() for n in range(1, len(text)))
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, _Entry] = OrderedDict()   # by text, oldest use first
        self.num_tokens = 0
        self._lock = threading.Lock()

    @classmethod
    def for_backend(cls, backend: Tokenizer, encode: Callable[[str], list[int]], *,
                    max_entries: int, max_tokens: int) -> PrefixTokenCache | None:
        """A cache for ``encode`` (``backend`` without special tokens added), or None when
        the tokenizer's split cannot be replayed or the cache is sized to nothing."""
        if max_entries <= 0 or max_tokens <= 0 or getattr(backend, "encode_special_tokens", False):
            return None
        if getattr(backend.model, "dropout", None):
            return None
        added = {tid: tok for tid, tok in backend.get_added_tokens_decoder().items() if not tok.normalized}
        if not added or any(tok.single_word or not tok.content for tok in added.values()):
            return None
        # A marker led by whitespace may be swallowed by its neighbour's rstrip: no cut there
        cut_ids = frozenset(tid for tid, tok in added.items() if not tok.content[0].isspace())
        return cls(encode, {tid: tok.content for tid, tok in added.items()}, cut_ids=cut_ids,
                   max_entries=max_entries, max_tokens=max_tokens)

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def encode(self, text: str, *, remember: bool = True) -> list[int]:
        """The ids of ``text``, exactly as ``encode`` gives them; ``remember`` keeps them for
        later texts (the message-boundary prefixes of a chat are not worth an entry)."""
        with self._lock:
            base, shared = self._longest_shared(text)
            if base is not None:
                self._entries.move_to_end(base.text)
        if base is not None and shared == len(text) == len(base.text):
            return base.ids.tolist()
        k = self._last_safe_cut(base, text, shared) if base is not None else -1
        if base is None or k < 0:
            ids = self._encode(text)
            if remember:
                self._remember(self._make_entry(text, ids, base=None, k=0), replaces=None)
            return ids
        start, index = base.cut_chars[k], base.cut_index[k]
        tail = self._encode(text[start:])
        if not tail or tail[0] != base.ids[index]:  # the argument above says never; never splice on doubt
            log.warning("prefix cache: the text after a marker did not start with it; encoding in full")
            return self._encode(text)
        ids = base.ids[:index].tolist()
        ids += tail
        if remember:
            # Every cut of the base kept: this entry answers whatever the base would have
            self._remember(self._make_entry(text, ids, base=base, k=k),
                           replaces=base if k == len(base.cut_chars) - 1 else None)
        return ids

    def _last_safe_cut(self, base: _Entry, text: str, shared: int) -> int:
        """The base's last cut whose split cannot change past ``shared`` characters, or -1.

        The split up to a marker at ``s`` is the same in any text that agrees up to
        ``shared`` unless a marker could begin at some p <= s and run past ``shared``: that
        needs p > shared - longest and ``text[p:shared]`` a proper beginning of a marker."""
        k = bisect_right(base.cut_chars, shared - 1) - 1
        while k >= 0:
            s = base.cut_chars[k]
            if all(text[p:shared] not in self._partial
                   for p in range(max(0, shared - self._window + 1), s + 1)):
                return k
            k -= 1
        return -1

    def _longest_shared(self, text: str) -> tuple[_Entry | None, int]:
        """The entry sharing the longest prefix with ``text`` (more than one marker's length)."""
        best, best_len = None, self._window
        probe = text[:best_len + 1]
        for entry in reversed(self._entries.values()):
            if len(entry.text) <= best_len or not entry.text.startswith(probe):
                continue
            n = _shared_len(text, entry.text)
            if n > best_len:
                best, best_len = entry, n
                probe = text[:best_len + 1]
        return best, (best_len if best is not None else 0)

    def _make_entry(self, text: str, ids: list[int], *, base: _Entry | None, k: int) -> _Entry:
        """An entry for ``text``: the base's cuts before its k-th (all in the shared text),
        then those found from there on."""
        if base is None:
            cut_chars, cut_index, start, index = array("q"), array("q"), 0, 0
        else:
            cut_chars, cut_index = base.cut_chars[:k], base.cut_index[:k]
            start, index = base.cut_chars[k], base.cut_index[k]
        found = self._find_cuts(text, ids, start, index)
        if found is not None:
            cut_chars.extend(found[0])
            cut_index.extend(found[1])
        return _Entry(text, array("I", ids), cut_chars, cut_index)

    def _find_cuts(self, text: str, ids: list[int], start: int, index: int,
                   ) -> tuple[list[int], list[int]] | None:
        """The cut markers of ``text[start:]`` (ids from ``index``): their character starts and
        indices, or None when the text's markers and the ids' do not pair one to one."""
        markers = self._markers
        at = [i for i in range(index, len(ids)) if ids[i] in markers]
        found: list[tuple[int, int, str]] = []  # start, -length, marker text: leftmost-longest order
        for marker in {markers[ids[i]] for i in at}:
            p = text.find(marker, start)
            while p >= 0:
                found.append((p, -len(marker), marker))
                p = text.find(marker, p + 1)
        found.sort()
        chars: list[int] = []
        indices: list[int] = []
        end = start
        for p, minus_len, marker in found:
            if p < end:
                continue  # inside the match before it, as in the tokenizer's scan
            if len(chars) == len(at) or markers[ids[at[len(chars)]]] != marker:
                return None
            chars.append(p)
            indices.append(at[len(chars) - 1])
            end = p - minus_len
        if len(chars) != len(at):
            return None
        cut_ids = self._cut_ids
        keep = [j for j, i in enumerate(indices) if ids[i] in cut_ids]
        return [chars[j] for j in keep], [indices[j] for j in keep]

    def _remember(self, entry: _Entry, *, replaces: _Entry | None) -> None:
        num_tokens = len(entry.ids)
        with self._lock:
            if replaces is not None and self._entries.get(replaces.text) is replaces:
                self._drop(replaces.text)
            if entry.text in self._entries:
                self._drop(entry.text)
            if num_tokens > self.max_tokens:
                return
            self._entries[entry.text] = entry
            self.num_tokens += num_tokens
            while len(self._entries) > self.max_entries or self.num_tokens > self.max_tokens:
                self._drop(next(iter(self._entries)))

    def _drop(self, text: str) -> None:
        self.num_tokens -= len(self._entries.pop(text).ids)


def _shared_len(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings, by bisection on slices (each
    comparison is a memcmp in C; the slices add up to about one string's length)."""
    n = min(len(a), len(b))
    if b.startswith(a) if len(b) >= len(a) else a.startswith(b):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
