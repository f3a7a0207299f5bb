"""mlx-lm's batch-cache copies, made one layer at a time.

When a row joins the decoding batch (``extend``: a concatenation) or leaves it (``filter``:
a gather), mlx-lm rebuilds every layer's batch cache lazily, and the next evaluation runs all
the layers' copies together: for a moment the whole old batch cache and the whole new one
coexist, twice the batch's KV. Eight agent sessions of ~8k tokens on an 8B model hold 8.6 GB
of KV, 17 GB at a join, and the gate must promise that peak: on the H200 it ran two to four of
them at a time where the budget held all eight (bench/README, "The memory model run in order").

Evaluated as each layer is rebuilt, a layer's old buffers are freed before the next layer
is copied, so the spike is one layer's cache (``common/costmodel.copy_spike_bytes``). A row
that finishes leaves through ``GenerationBatch.next``, which first extracts its KV (a lazy
copy for the prefix cache) and then filters the batch: left lazy, that extraction would keep
every layer's old buffers alive, so within ``next`` a layer's extractions are evaluated with
its filter (the row's KV then lives in its extraction instead of the batch: no more bytes).
Extractions made elsewhere (a message boundary's, after the step) stay lazy: the block store
evaluates them one layer at a time as it copies blocks out (worker/block_store.py).

Prompts of different lengths prefilled in one chunk are right-padded, and the chunk ends
with ``finalize``, which rolls every layer's cache to move that padding left: evaluated
together, the whole prompt batch's cache twice (on the demo model under 400 MB, two ~1,250-token
prompts prefilled together peaked 1.2-1.3x the gate's charge there, and the OOM guard aborted).
Each layer's roll is evaluated as it is made, like a filter.

Prompts that finish their prefill while others in the prompt batch go on leave it through
``PromptProcessingBatch.split``, which deep-copies the whole prompt batch's cache and then
filters the original and the copy: the prompt batch's KV and more beside it (the same two
prompts: 1.25x the batch). Split here instead: each layer's cache is copied shallowly (its
arrays shared) and the two filters run on it together, so its old buffers go before the
next layer is split.

What it costs: an evaluation per layer at a join or a finish, where the host waits for the
step in flight instead of queuing the next one ahead of it. So only a batch whose layers are
large is copied this way (``costmodel.copies_layerwise``, checked here at half its threshold
so that the model's estimate of a layer, which rounds like the cache, never assumes a
layer-wise copy that ran whole); a small batch's copies stay lazy, and are charged whole.

Installed once per process by the engine (``install``); the worker owns its process and
every batch cache in it. Its cost model charges layer-wise copies only where this module
could install (``layerwise_copy_bytes``): an mlx-lm without what it wraps is charged whole.
Pinned against the installed mlx-lm by tests/unit/test_kvcopy.py (peak memory of a real
join and a real finish through mlx-lm's own batch methods).
"""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch
from mlx_lm.models import cache as mlx_cache

from common.costmodel import LAYERWISE_COPY_BYTES

# The batch caches mlx-lm's BatchGenerator builds; each rebuilds its own arrays in place.
BATCH_CACHES = ("BatchKVCache", "BatchRotatingKVCache", "ArraysCache")
IN_PLACE = ("extend", "filter", "finalize")
_MARK = "_headroom_layerwise"
# Below the cost model's threshold: a layer it estimates at the threshold is evaluated here.
EVAL_LAYER_BYTES = LAYERWISE_COPY_BYTES // 2


class _Finishing(threading.local):
    """Inside ``GenerationBatch.next``: the extractions of rows that finish, by layer."""

    def __init__(self) -> None:
        self.active = False
        self.extracted: dict[int, list[Any]] = {}


_finishing = _Finishing()


def arrays_of(obj: Any) -> list[mx.array]:
    """Every array a cache object holds (its attributes, lists of them included)."""
    return [v for _, v in tree_flatten(vars(obj)) if isinstance(v, mx.array)]


def _large(arrays: list[mx.array]) -> bool:
    return sum(a.nbytes for a in arrays) >= EVAL_LAYER_BYTES


def _in_place(method: Callable[..., Any], *, joins: bool = False) -> Callable[..., Any]:
    """``method`` rebuilds the layer in place (``filter``, or ``extend`` when ``joins``)."""
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        large = _large(arrays_of(self))  # a filter's source, before it shrinks
        rows_out = _finishing.extracted.pop(id(self), []) if _finishing.active else []
        out = method(self, *args, **kwargs)
        arrays = arrays_of(self)
        if large or _large(arrays):
            mx.eval(arrays, [arrays_of(c) for c in rows_out])
            if joins and hasattr(args[0], "keys"):
                # The joining rows' layer now lives in this one: let it go with the old
                # layer, not when mlx-lm drops the joining batch after its last layer
                # (many rows joining a small batch would otherwise hold both whole).
                args[0].keys = args[0].values = None
        return out

    return run


def _extract(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = method(self, *args, **kwargs)
        if _finishing.active:
            _finishing.extracted.setdefault(id(self), []).append(out)
        return out

    return run


def _next(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        _finishing.active, _finishing.extracted = True, {}
        try:
            return method(self, *args, **kwargs)
        finally:
            _finishing.active, _finishing.extracted = False, {}

    return run


def _split(method: Callable[..., Any]) -> Callable[..., Any]:
    """``PromptProcessingBatch.split`` without its deep copy of every layer (for plain
    batch caches, whose ``filter`` rebinds its arrays and never changes them)."""
    @functools.wraps(method)
    def run(self: Any, indices: list[int]) -> Any:
        caches = self.prompt_cache
        if not caches or not all(type(c) is mlx_cache.BatchKVCache for c in caches):
            return method(self, indices)
        indices = sorted(indices)
        left = sorted(set(range(len(self.uids))) - set(indices))
        self.prompt_cache = []  # the library's _copy deep-copies nothing, and filters none
        new_batch = self._copy()
        self.filter(left)
        new_batch.filter(indices)
        split: list[Any] = []
        for c in caches:  # a layer at a time (``filter`` evaluates a large one here)
            moved = copy.copy(c)
            moved.filter(indices)
            if left:
                c.filter(left)
            else:
                c.keys = c.values = None  # every row moved: the old layer goes now
            split.append(moved)
        self.prompt_cache = caches if left else []
        new_batch.prompt_cache = split
        return new_batch

    return run


def _wrap(cls: type, attr: str, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    method = cls.__dict__.get(attr)
    if method is not None and not getattr(method, _MARK, False):
        wrapped = wrapper(method)
        setattr(wrapped, _MARK, True)
        setattr(cls, attr, wrapped)


def install() -> None:
    """Wrap the batch caches' ``extend``, ``filter``, ``finalize`` and ``extract``,
    ``GenerationBatch.next`` and ``PromptProcessingBatch.split`` (idempotent)."""
    for name in BATCH_CACHES:
        cls = getattr(mlx_cache, name, None)
        if cls is None:
            continue
        _wrap(cls, "extend", functools.partial(_in_place, joins=True))
        _wrap(cls, "filter", _in_place)
        _wrap(cls, "finalize", _in_place)
        _wrap(cls, "extract", _extract)
    _wrap(GenerationBatch, "next", _next)
    _wrap(PromptProcessingBatch, "split", _split)


def layerwise_copy_bytes() -> int:
    """What the cost model is told (``CostModel.layerwise_copy_bytes``): the threshold
    where this process copies layer by layer, once installed; 0 (every copy charged
    whole) where the installed mlx-lm no longer has what ``install`` wraps."""
    install()
    return LAYERWISE_COPY_BYTES if installed() else 0


def installed() -> bool:
    cls = mlx_cache.BatchKVCache
    return all(getattr(cls.__dict__.get(attr), _MARK, False) for attr in (*IN_PLACE, "extract")) \
        and getattr(GenerationBatch.__dict__.get("next"), _MARK, False) \
        and getattr(PromptProcessingBatch.__dict__.get("split"), _MARK, False)
