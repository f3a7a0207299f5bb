"""Rows joining and leaving a large batch copy its cache one layer at a time (worker/kvcopy.py).

Real MLX on this CPU, mlx-lm's own batch caches and its own ``_extend_cache`` and the
extract-then-filter order of ``GenerationBatch.next``: the peak above what was live is one
layer's copy once installed, and about the whole batch's through the library's own methods
(``__wrapped__``), which is what the cost model charged before.
"""

from __future__ import annotations

import dataclasses
import gc

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch, _extend_cache
from mlx_lm.models.cache import BatchKVCache

from common import costmodel
from worker import kvcopy

LAYERS = 8
HEADS, DIM = 8, 128
TOKENS = 1024           # float16 keys and values: 4 rows x 1024 tokens = 16 MiB a layer
ROWS = 4
DEMO_ROWS = 3           # the demo model: 16 KiB a layer per token, 256-token steps: 12 MiB a layer


def batch(rows: int, tokens: int) -> list[BatchKVCache]:
    layers = []
    for _ in range(LAYERS):
        c = BatchKVCache([0] * rows)
        c.update_and_fetch(mx.ones((rows, HEADS, tokens, DIM), mx.float16),
                           mx.ones((rows, HEADS, tokens, DIM), mx.float16))
        layers.append(c)
    mx.eval([kvcopy.arrays_of(c) for c in layers])
    return layers


def layer_bytes(layers: list[BatchKVCache]) -> int:
    return layers[0].keys.nbytes + layers[0].values.nbytes


def peak_over_live(run) -> int:
    """Run ``run`` and evaluate what it left; its peak above what was live before."""
    gc.collect()
    mx.synchronize()
    mx.clear_cache()
    live = mx.get_active_memory()
    mx.reset_peak_memory()
    kept = run()
    mx.eval(kept)
    mx.synchronize()
    return mx.get_peak_memory() - live


@pytest.fixture(autouse=True)
def installed():
    kvcopy.install()
    assert kvcopy.installed()


def test_install_is_idempotent():
    before = BatchKVCache.extend
    kvcopy.install()
    assert BatchKVCache.extend is before and GenerationBatch.next.__wrapped__ is not None
    assert not hasattr(BatchKVCache.extend.__wrapped__, "__wrapped__")


def test_a_join_copies_one_layer_at_a_time():
    joined, joining = batch(ROWS, TOKENS), batch(1, TOKENS)
    one_layer = layer_bytes(joined)
    assert kvcopy._large(kvcopy.arrays_of(joined[0]))

    def join():
        _extend_cache(joined, joining)  # mlx-lm's GenerationBatch.extend
        return [kvcopy.arrays_of(c) for c in joined]

    # The batch grows by a row (a fifth); above that, one layer's old buffers at a time.
    grown = LAYERS * one_layer // ROWS
    assert peak_over_live(join) <= grown + 2 * one_layer


def test_many_rows_joining_a_small_batch_go_as_their_layers_are_copied():
    """Four rows joining one (a prefill group moving to decoding): each joining layer is
    let go once copied, not when mlx-lm drops the joining batch after its last layer,
    which would hold the old rows and the new batch whole side by side."""
    joined, joining = batch(1, TOKENS), batch(ROWS, TOKENS)
    one_layer = layer_bytes(joining)  # four rows

    def join():
        _extend_cache(joined, joining)
        return [kvcopy.arrays_of(c) for c in joined]

    assert peak_over_live(join) <= 2 * one_layer
    assert all(c.keys is None for c in joining)


def test_the_library_alone_copies_the_whole_batch():
    joined, joining = batch(ROWS, TOKENS), batch(1, TOKENS)
    one_layer = layer_bytes(joined)
    extend = BatchKVCache.extend.__wrapped__

    def join():
        for a, b in zip(joined, joining):
            extend(a, b)
        return [kvcopy.arrays_of(c) for c in joined]

    assert peak_over_live(join) >= LAYERS * one_layer // 2


def finish_one(layers: list[BatchKVCache]):
    """GenerationBatch.next's order: the finished row's KV is extracted, then the rest filtered."""
    row = [c.extract(0) for c in layers]
    for c in layers:
        c.filter([1, 2, 3])
    return [kvcopy.arrays_of(r) for r in row] + [kvcopy.arrays_of(c) for c in layers]


def test_a_finished_row_leaves_one_layer_at_a_time():
    layers = batch(ROWS, TOKENS)
    one_layer = layer_bytes(layers)
    # Inside GenerationBatch.next (the wrapper's context): the extraction is evaluated with
    # its layer's filter, so each old layer goes at once; the row now lives in its extraction.
    finish = kvcopy._next(lambda _: finish_one(layers))
    assert peak_over_live(lambda: finish(None)) <= 2 * one_layer


def test_a_boundary_extraction_stays_lazy_and_keeps_the_old_batch():
    """Outside ``next`` (a message boundary's extraction, stored after the step, one layer at
    a time by the block store) nothing is evaluated early: that extraction is never made
    whole inside a step. A filter beside it then cannot free the old layers (they are the
    extraction's source): the whole old batch stays, as mlx-lm alone would keep it."""
    layers = batch(ROWS, TOKENS)
    one_layer = layer_bytes(layers)
    assert peak_over_live(lambda: finish_one(layers)) >= LAYERS * one_layer // 2


def test_a_small_batch_stays_lazy():
    """Below the threshold nothing is evaluated in the copy (no wait for the step in
    flight): the copies are still to run when the caller evaluates them."""
    small = batch(2, 16)
    joining = batch(1, 16)
    assert not kvcopy._large(kvcopy.arrays_of(small[0]))
    _extend_cache(small, joining)
    mx.synchronize()
    live = mx.get_active_memory()
    mx.eval([kvcopy.arrays_of(c) for c in small])
    assert mx.get_active_memory() > live  # the copies ran only now


def test_the_cost_model_charges_what_runs():
    m = costmodel.CostModel(kv_bytes_per_token=128 << 10, num_layers=32, prefill_a_bytes=0,
                            prefill_c_bytes=0, budget_bytes=1 << 40, context_length=32768,
                            prefill_step_tokens=512, layerwise_copy_bytes=kvcopy.layerwise_copy_bytes())
    assert m.layerwise_copy_bytes == costmodel.LAYERWISE_COPY_BYTES  # installed here
    # Eight rows of 8k on an 8B model: 8.6 GB of KV, one layer of it ~268 MB.
    whole = costmodel.batch_kv_bytes(8, 8192, m.kv_bytes_per_token)
    assert costmodel.copy_spike_bytes(m, 8, 8192) == costmodel.LAYERWISE_COPY_LAYERS * whole // 32
    # Two rows of 256 tokens: 64 MiB in all, 2 MiB a layer, copied lazily and whole.
    assert costmodel.copy_spike_bytes(m, 2, 256) == costmodel.batch_kv_bytes(2, 256, m.kv_bytes_per_token)
    assert costmodel.copy_spike_bytes(m, 1, 8192) == 0
    # Where the model assumes a layer-wise copy, the wrapper makes one, with room to spare.
    assert kvcopy.EVAL_LAYER_BYTES < costmodel.LAYERWISE_COPY_BYTES
    # A model from a worker that could not install (or an older one) charges every copy whole.
    whole_only = dataclasses.replace(m, layerwise_copy_bytes=0)
    assert costmodel.copy_spike_bytes(whole_only, 8, 8192) == whole
    assert costmodel.CostModel.from_dict(m.to_dict()).layerwise_copy_bytes == m.layerwise_copy_bytes


@pytest.fixture(scope="module")
def demo():
    import os

    from mlx_lm import load

    from worker.demo import default_cache_root, ensure_demo_model
    model, _ = load(str(ensure_demo_model(default_cache_root(os.environ))))
    return model


def finishing_step_peak(model) -> tuple[int, int]:
    """mlx-lm's own BatchGenerator on the demo model: three rows of 200 tokens decoding (12 MiB a layer), the
    first of which finishes. The step it finishes in: its peak above what was live before,
    and the batch's KV."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=4, prefill_step_size=2048)
    prompts = [[(7 * i + j) % 500 + 3 for j in range(200)] for i in range(DEMO_ROWS)]
    uids = gen.insert(prompts, max_tokens=[3] + [12] * (DEMO_ROWS - 1))
    # Until every row decodes and the first is one token short of its end.
    for _ in range(6):
        if any(r.uid == uids[0] and r.finish_reason for r in gen.next()[1]):
            raise AssertionError("the first row finished before it was watched")
        if len(gen._generation_batch) == DEMO_ROWS and gen._generation_batch._num_tokens[0] == 2:
            break
    assert len(gen._generation_batch) == DEMO_ROWS
    kv = sum(c.nbytes for c in gen._generation_batch.prompt_cache)
    gc.collect()
    mx.synchronize()
    live = mx.get_active_memory()
    mx.reset_peak_memory()
    finished = [r for r in gen.next()[1] if r.finish_reason]
    mx.eval([kvcopy.arrays_of(c) for c in gen._generation_batch.prompt_cache],
            [kvcopy.arrays_of(c) for r in finished for c in r.prompt_cache])
    mx.synchronize()
    assert [r.uid for r in finished] == [uids[0]]
    peak = mx.get_peak_memory() - live
    gen.close()
    return peak, kv


def test_mlx_lm_finishes_a_row_one_layer_at_a_time(demo, monkeypatch):
    peak, kv = finishing_step_peak(demo)
    layers = len(demo.layers)
    assert kv // layers >= kvcopy.EVAL_LAYER_BYTES  # a batch copied layer by layer
    assert peak <= 2 * kv // layers + (8 << 20)     # a layer or two, and the step's forward
    # mlx-lm's own methods, as the library ships them: the whole batch is copied at once.
    for attr in ("filter", "extend", "extract"):
        monkeypatch.setattr(BatchKVCache, attr, getattr(BatchKVCache, attr).__wrapped__)
    monkeypatch.setattr(GenerationBatch, "next", GenerationBatch.next.__wrapped__)
    whole, _ = finishing_step_peak(demo)
    assert whole >= kv // 2


@settings(max_examples=300, deadline=None)
@given(kv=st.integers(1, 1 << 20), layers=st.integers(1, 128), rows=st.integers(1, 64),
       tokens=st.integers(1, 1 << 17), more_rows=st.integers(0, 8), more_tokens=st.integers(0, 4096))
def test_a_larger_batch_is_never_charged_a_smaller_copy(kv: int, layers: int, rows: int, tokens: int,
                                                       more_rows: int, more_tokens: int) -> None:
    """Where the copy turns layer-wise its charge must not drop (hypothesis found a
    three-row batch whose worst case was under its two-row one's)."""
    m = costmodel.CostModel(kv_bytes_per_token=kv, num_layers=layers, prefill_a_bytes=0, prefill_c_bytes=0,
                            budget_bytes=1 << 50, context_length=1 << 18, prefill_step_tokens=512,
                            layerwise_copy_bytes=costmodel.LAYERWISE_COPY_BYTES)
    assert costmodel.copy_spike_bytes(m, rows + more_rows, tokens + more_tokens) \
        >= costmodel.copy_spike_bytes(m, rows, tokens)


def ragged_prefill_peak(model) -> tuple[int, int]:
    """mlx-lm's own BatchGenerator on the demo model: two prompts of different lengths
    prefilled together in chunks of 128, so that their last chunks are ragged (right-padded,
    then ``finalize``d) and the first to finish leaves the prompt batch (``split``). The
    largest step peak above what was live before the prompts came, and their KV at the end."""
    from mlx_lm.generate import BatchGenerator

    gc.collect()
    mx.synchronize()
    mx.clear_cache()
    idle = mx.get_active_memory()
    gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=4, prefill_step_size=128)
    gen.insert([[(7 * j) % 500 + 3 for j in range(330)], [(11 * j) % 500 + 3 for j in range(300)]],
               max_tokens=[4, 4])
    worst = 0
    for _ in range(12):
        mx.reset_peak_memory()
        gen.next()
        mx.synchronize()
        worst = max(worst, mx.get_peak_memory() - idle)
        if len(gen._generation_batch) == 2:
            break
    kv = sum(c.nbytes for c in gen._generation_batch.prompt_cache)
    gen.close()
    return worst, kv


def test_prompts_prefilled_together_are_padded_and_split_one_layer_at_a_time(demo, monkeypatch):
    """Two prompts in one prompt batch: the ragged last chunk's roll (``finalize``) and the
    first prompt's leaving the batch (``split``) once held the whole batch's KV twice (the
    OOM guard aborted a demo worker under 400 MB on it)."""
    peak, kv = ragged_prefill_peak(demo)
    layers = len(demo.layers)
    assert kv // layers >= kvcopy.EVAL_LAYER_BYTES
    assert peak <= kv + 2 * kv // layers + (16 << 20)  # a layer or two, and a chunk's forward
    monkeypatch.setattr(BatchKVCache, "finalize", BatchKVCache.finalize.__wrapped__)
    monkeypatch.setattr(PromptProcessingBatch, "split", PromptProcessingBatch.split.__wrapped__)
    whole, _ = ragged_prefill_peak(demo)
    assert whole >= kv * 7 // 4
