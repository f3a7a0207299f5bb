"""Tests for common/costmodel.py: the pure memory math shared by router and worker."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from common.costmodel import (
    kv_aligned_chunk, kv_reach_tokens,
    KV_STEP_TOKENS, MIN_CHUNK_TOKENS, CostModel, batch_cost_bytes, batch_kv_bytes, fits_now,
    copy_spike_bytes, growth_spike_bytes, kv_bytes_per_token, max_new_tokens, max_request_tokens,
    never_fits, forward_transient_bytes, prefill_transient_bytes, request_cost_bytes, roundup,
    safe_prefill_chunk, SCORE_BYTES_PER_LOGIT, SCORE_PASS_BYTES, score_chunk_that_fits,
    score_rows_per_pass, scored_kv_start, scored_reach_tokens, scoring_step_bytes, scoring_transient_bytes,
)

FAST = settings(max_examples=200, deadline=None)


def make_model(**overrides: Any) -> CostModel:
    values: dict[str, Any] = dict(
        kv_bytes_per_token=4096, num_layers=4, prefill_a_bytes=2000.0, prefill_c_bytes=2.0,
        growth_factor=1.0, budget_bytes=256 * 1024 * 1024, context_length=8192,
        prefill_step_tokens=512, prefill_batch_size=8)
    values.update(overrides)
    return CostModel(**values)


models = st.builds(
    CostModel,
    kv_bytes_per_token=st.integers(1, 1 << 20),
    num_layers=st.integers(1, 128),
    # Zero or a plausible fitted coefficient (a subnormal one would overflow int(free / c)).
    prefill_a_bytes=st.just(0.0) | st.floats(1e-3, 1e6),
    prefill_c_bytes=st.just(0.0) | st.floats(1e-6, 1e3),
    prefill_b_bytes=st.just(0.0) | st.floats(1.0, 1e9),
    prefill_d_bytes=st.just(0.0) | st.floats(1e-3, 1e5),
    growth_factor=st.floats(0, 2),
    budget_bytes=st.integers(0, 1 << 40),
    context_length=st.integers(1, 1 << 17),
    prefill_step_tokens=st.integers(MIN_CHUNK_TOKENS, 4096),
    prefill_batch_size=st.integers(1, 16),
)


# -- shapes --------------------------------------------------------------------------


@pytest.mark.parametrize(("tokens", "expected"), [
    (0, 0), (1, 256), (255, 256), (256, 256), (257, 512), (1000, 1024), (-5, 0),
])
def test_roundup(tokens: int, expected: int) -> None:
    assert roundup(tokens) == expected


def test_roundup_custom_step() -> None:
    assert roundup(10, 8) == 16
    assert roundup(16, 8) == 16


@FAST
@given(tokens=st.integers(0, 10**7), step=st.integers(1, 4096))
def test_roundup_properties(tokens: int, step: int) -> None:
    r = roundup(tokens, step)
    assert r % step == 0 and tokens <= r < tokens + step


def test_kv_step_is_mlx_lm_step() -> None:
    assert KV_STEP_TOKENS == 256


def test_kv_bytes_per_token() -> None:
    # Llama-3-8B-ish: 32 layers, 8 KV heads, head_dim 128, fp16 → 128 KiB per token.
    assert kv_bytes_per_token(32, 8, 128, 2) == 2 * 32 * 8 * 128 * 2 == 131072
    assert kv_bytes_per_token(1, 1, 1, 1) == 2


def test_cost_model_dict_round_trip() -> None:
    m = make_model()
    assert CostModel.from_dict(m.to_dict()) == m
    assert CostModel.from_dict({**m.to_dict(), "future_coefficient": 3}) == m


def test_cost_model_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        make_model().budget_bytes = 1  # type: ignore[misc]


def test_batch_kv_bytes_pads_every_row_to_the_longest() -> None:
    assert batch_kv_bytes(1, 1, 10) == 256 * 10
    assert batch_kv_bytes(3, 300, 10) == 3 * 512 * 10


def test_short_row_beside_long_row_is_charged_the_long_length() -> None:
    m = make_model()
    short, long = 10, 3000
    padded = batch_cost_bytes(m, 2, long, 0, 0, 0)
    assert padded == 2 * roundup(long) * m.kv_bytes_per_token + max(
        growth_spike_bytes(m, 2, long), copy_spike_bytes(m, 2, long)) + int(
        m.prefill_b_bytes + 2 * (m.prefill_a_bytes + m.prefill_d_bytes * long + m.prefill_c_bytes * long))
    unpadded = (batch_kv_bytes(1, short, m.kv_bytes_per_token)
                + batch_kv_bytes(1, long, m.kv_bytes_per_token))
    assert padded > unpadded


@FAST
@given(m=models, rows=st.integers(1, 32), longest=st.integers(0, 1 << 17),
       chunk=st.integers(0, 4096), prefill_rows=st.integers(0, 8), context=st.integers(0, 1 << 17))
def test_batch_cost_is_the_sum_of_its_parts(m: CostModel, rows: int, longest: int, chunk: int,
                                           prefill_rows: int, context: int) -> None:
    prefilling = min(prefill_rows, rows) if chunk else 0
    assert batch_cost_bytes(m, rows, longest, chunk, prefill_rows, context) == int(m.scale * (
        rows * roundup(longest) * m.kv_bytes_per_token
        + int(m.prefill_b_bytes + prefill_transient_bytes(m, chunk, context, prefilling)
              + prefill_transient_bytes(m, 1, longest, rows - prefilling))
        + max(growth_spike_bytes(m, rows, longest), copy_spike_bytes(m, rows, longest))))


def test_the_fixed_forward_term_is_paid_once_per_step_not_per_token() -> None:
    m = make_model(prefill_a_bytes=10.0, prefill_c_bytes=0.0, prefill_b_bytes=100_000.0)
    one = forward_transient_bytes(m, chunk_tokens=1, context_tokens=1, prefill_rows=1,
                                  decode_rows=0, decode_context=0)
    big = forward_transient_bytes(m, chunk_tokens=500, context_tokens=500, prefill_rows=1,
                                  decode_rows=0, decode_context=0)
    assert one == 100_010 and big == 105_000
    assert forward_transient_bytes(m, chunk_tokens=0, context_tokens=0, prefill_rows=0,
                                   decode_rows=0, decode_context=0) == 0
    # Eight decoding rows: one forward, eight one-token rows.
    assert forward_transient_bytes(m, chunk_tokens=0, context_tokens=0, prefill_rows=0,
                                   decode_rows=8, decode_context=100) == 100_080
    # The chunk that fits leaves the fixed term aside first.
    assert safe_prefill_chunk(make_model(prefill_a_bytes=1000.0, prefill_c_bytes=0.0,
                                         prefill_b_bytes=1e6), 1_000_000 + 64_000, 1) == 64
    # A request's idle cost carries the fixed term.
    base = make_model(prefill_b_bytes=0.0)
    assert request_cost_bytes(make_model(prefill_b_bytes=5e6), 100, 100) == request_cost_bytes(base, 100, 100) + 5_000_000


def test_prefill_transient() -> None:
    m = make_model(prefill_a_bytes=10.0, prefill_c_bytes=0.5)
    assert prefill_transient_bytes(m, 100, 1000) == 10 * 100 + 0.5 * 100 * 1000
    assert prefill_transient_bytes(m, 100, 1000, rows=3) == 3 * (10 * 100 + 0.5 * 100 * 1000)
    assert prefill_transient_bytes(m, 0, 1000) == 0


def test_each_row_pays_for_its_context_whatever_its_chunk() -> None:
    """The per-row context term: what a decode row at 4k holds on the H200 (~7.1 KB per
    context token on an 8B model, run in order), charged per row, and once per row of a
    prefill chunk too; the chunk that fits leaves it aside first."""
    m = make_model(prefill_a_bytes=650_000.0, prefill_c_bytes=96.0, prefill_d_bytes=7_100.0,
                   prefill_b_bytes=117e6)
    decode_32 = forward_transient_bytes(m, chunk_tokens=0, context_tokens=0, prefill_rows=0,
                                        decode_rows=32, decode_context=4097)
    assert decode_32 == int(117e6 + 32 * (650_000 + 7_100 * 4097 + 96 * 4097))
    assert 1.0e9 < decode_32 < 1.3e9  # near the in-order figure measured: 1,165 MB
    assert prefill_transient_bytes(m, 512, 4096, rows=2) == int(2 * (650_000 * 512 + 7_100 * 4096
                                                                     + 96 * 512 * 4096))
    assert prefill_transient_bytes(m, 0, 4096, rows=2) == 0  # no chunk, no prefill row
    fixed = 117e6 + 7_100 * 4096
    per_token = 650_000 + 96 * 4096
    assert safe_prefill_chunk(m, int(fixed + 100.5 * per_token), 4096) == 100


def test_growth_spike_is_one_layers_old_cache() -> None:
    m = make_model(kv_bytes_per_token=1000, num_layers=10, growth_factor=1.0)
    assert growth_spike_bytes(m, 2, 300) == 2 * 512 * 1000 // 10
    assert growth_spike_bytes(make_model(growth_factor=0.0), 2, 300) == 0


def test_request_cost_on_idle_worker() -> None:
    m = make_model()
    prompt, out = 1000, 100
    # The smallest chunk an idle worker would prefill in: it never refuses a prompt that
    # fits in small chunks.
    assert request_cost_bytes(m, prompt, out) == (
        roundup(prompt + out) * m.kv_bytes_per_token
        + prefill_transient_bytes(m, MIN_CHUNK_TOKENS, prompt)
        + growth_spike_bytes(m, 1, prompt + out))


def test_request_cost_equals_a_batch_of_one() -> None:
    m = make_model()
    for prompt, out in [(1, 1), (100, 50), (600, 1000)]:
        chunk = min(prompt, MIN_CHUNK_TOKENS)
        assert request_cost_bytes(m, prompt, out) == batch_cost_bytes(
            m, 1, prompt + out, chunk, 1, prompt)


@FAST
@given(m=models, prompt=st.integers(0, 1 << 16), out=st.integers(1, 1 << 16),
       more=st.integers(0, 1 << 12))
def test_request_cost_is_monotonic(m: CostModel, prompt: int, out: int, more: int) -> None:
    base = request_cost_bytes(m, prompt, out)
    assert request_cost_bytes(m, prompt + more, out) >= base
    assert request_cost_bytes(m, prompt, out + more) >= base


@FAST
@given(m=models, total=st.integers(2, 1 << 16), split=st.integers(1, 1 << 16))
def test_all_prompt_is_the_costliest_split(m: CostModel, total: int, split: int) -> None:
    """max_request_tokens charges total-1 as prompt: no other split may cost more."""
    out = min(split, total - 1)
    assert request_cost_bytes(m, total - out, out) <= request_cost_bytes(m, total - 1, 1)


# -- fits ever -----------------------------------------------------------------------


@FAST
@given(m=models)
def test_max_request_tokens_is_the_largest_that_fits(m: CostModel) -> None:
    limit = max_request_tokens(m)
    assert 0 <= limit <= m.context_length
    if limit > 0:
        assert request_cost_bytes(m, limit - 1, 1) <= m.budget_bytes
    if limit < m.context_length:
        assert request_cost_bytes(m, limit, 1) > m.budget_bytes


def test_max_request_tokens_capped_by_context() -> None:
    m = make_model(budget_bytes=1 << 50, context_length=2048)
    assert max_request_tokens(m) == 2048


def test_max_request_tokens_zero_when_nothing_fits() -> None:
    m = make_model(budget_bytes=0)
    assert max_request_tokens(m) == 0
    assert never_fits(m, 0, 1)


def test_max_request_tokens_example() -> None:
    # No transient or spike: exactly budget / (kv per token), rounded down to the KV step.
    m = make_model(kv_bytes_per_token=1000, prefill_a_bytes=0.0, prefill_c_bytes=0.0,
                   growth_factor=0.0, budget_bytes=1000 * 1000, context_length=100_000)
    assert max_request_tokens(m) == 768  # 1024 would need 1,024,000 bytes


@FAST
@given(m=models, data=st.data())
def test_never_fits_agrees_with_max_request_tokens(m: CostModel, data: st.DataObject) -> None:
    limit = max_request_tokens(m)
    if limit >= 1:
        total = data.draw(st.integers(1, limit))
        out = data.draw(st.integers(1, total))
        assert not never_fits(m, total - out, out)
    if limit < m.context_length:
        assert never_fits(m, limit, 1)


@FAST
@given(m=models, data=st.data(), scoring=st.booleans())
def test_an_idle_worker_admits_exactly_what_never_fits_lets_through(m: CostModel, data: st.DataObject,
                                                                   scoring: bool) -> None:
    """The router's 400 and the worker's "never" are one question; the idle worker's
    "now" must answer it alike, or a request between them waits for a room that never
    comes (a scored prompt once was: its admission charged a prefill chunk it never runs)."""
    total = data.draw(st.integers(1, m.context_length))
    out = data.draw(st.integers(1, total))
    prompt = total - out
    # As the gate asks it: a scored row is charged as long as its scoring makes it.
    reach = scored_reach_tokens(prompt, out) - prompt if scoring else out
    fits, worst = fits_now(m, [], prompt, reach, 0, m.budget_bytes, prompt if scoring else 0, scoring=scoring)
    assert fits == (not never_fits(m, prompt, out, scoring=scoring)), (worst, m.budget_bytes)


# -- prefill chunk -------------------------------------------------------------------


def test_safe_prefill_chunk_plenty_of_room_is_the_static_step() -> None:
    m = make_model()
    assert safe_prefill_chunk(m, 1 << 40, 1000) == m.prefill_step_tokens


def test_safe_prefill_chunk_floor() -> None:
    m = make_model()
    assert safe_prefill_chunk(m, 0, 1000) == MIN_CHUNK_TOKENS
    assert safe_prefill_chunk(m, -(1 << 30), 1000) == MIN_CHUNK_TOKENS


def test_safe_prefill_chunk_fits_free_bytes() -> None:
    m = make_model(prefill_a_bytes=100.0, prefill_c_bytes=1.0)
    chunk = safe_prefill_chunk(m, 100 * (100 + 1 * 400), 400)
    assert chunk == 100
    assert prefill_transient_bytes(m, chunk, 400) <= 100 * (100 + 400)


def test_safe_prefill_chunk_without_coefficients_is_the_step() -> None:
    m = make_model(prefill_a_bytes=0.0, prefill_c_bytes=0.0)
    assert safe_prefill_chunk(m, 0, 1000) == m.prefill_step_tokens


@pytest.mark.parametrize("step", [16, 24, 31])
def test_safe_prefill_chunk_never_exceeds_a_small_step(step: int) -> None:
    """WorkerConfig allows --prefill-step-size down to 16, below MIN_CHUNK_TOKENS (32)."""
    m = make_model(prefill_step_tokens=step)
    assert safe_prefill_chunk(m, 1 << 40, 100) <= step
    assert safe_prefill_chunk(m, 0, 100) <= step


@FAST
@given(m=models, free=st.integers(0, 1 << 40), extra=st.integers(0, 1 << 36),
       context=st.integers(0, 1 << 17), rows=st.integers(1, 16))
def test_safe_prefill_chunk_properties(m: CostModel, free: int, extra: int, context: int,
                                       rows: int) -> None:
    chunk = safe_prefill_chunk(m, free, context, rows)
    assert MIN_CHUNK_TOKENS <= chunk <= m.prefill_step_tokens
    # Less free memory, more rows or a longer context never give a larger chunk.
    assert safe_prefill_chunk(m, free + extra, context, rows) >= chunk
    assert safe_prefill_chunk(m, free, context, rows + 1) <= chunk
    assert safe_prefill_chunk(m, free, context + extra % (1 << 17), rows) <= chunk
    # Above the floor, the chunk's transient fits in what is free.
    if chunk > MIN_CHUNK_TOKENS:
        assert prefill_transient_bytes(m, chunk, max(context, 1), rows) <= free * (1 + 1e-9) + 1


# -- fits now ------------------------------------------------------------------------


def test_fits_now_idle_worker() -> None:
    m = make_model()
    fits, worst = fits_now(m, [], 1000, 100, 0, m.budget_bytes)
    assert fits
    # With room, the full chunk; the idle cost is the floor it never goes below.
    assert worst == batch_cost_bytes(m, 1, 1100, m.prefill_step_tokens, 1, 1000)
    assert worst >= request_cost_bytes(m, 1000, 100)


def test_fits_now_refuses_over_budget_even_with_free_memory() -> None:
    m = make_model(budget_bytes=16 * 1024 * 1024)
    limit = max_request_tokens(m)
    assert limit < m.context_length
    fits, worst = fits_now(m, [], limit, 1, 0, 1 << 50)
    assert not fits and worst > m.budget_bytes


def test_fits_now_free_bytes_limits_the_increment() -> None:
    m = make_model()
    running = [2000, 500]
    old = batch_cost_bytes(m, 2, 2000, 0, 0, 0)
    _, new = fits_now(m, running, 100, 100, 0, 1 << 50)
    increment = new - old
    assert fits_now(m, running, 100, 100, 0, increment) == (True, new)
    # Less room: the chunk shrinks instead of the request waiting...
    fits, smaller = fits_now(m, running, 100, 100, 0, increment - 1)
    assert fits and smaller < new
    # ...down to the smallest chunk; below that, it waits.
    least = batch_cost_bytes(m, 3, 2000, MIN_CHUNK_TOKENS, 1, 2000) - old
    assert fits_now(m, running, 100, 100, 0, least)[0]
    assert not fits_now(m, running, 100, 100, 0, least - 1)[0]


def test_fits_now_pads_a_short_request_to_the_longest_running() -> None:
    m = make_model()
    _, worst = fits_now(m, [3000], 10, 10, 0, 1 << 50)
    chunk = 10
    assert worst == batch_cost_bytes(m, 2, 3000, chunk, 1, 3000)  # its chunk at the longest context
    assert worst >= 2 * roundup(3000) * m.kv_bytes_per_token


def test_fits_now_may_hold_a_short_request_back_beside_a_long_one() -> None:
    # Room for the long row alone and for two short rows, but not a short row padded long.
    m = make_model(prefill_a_bytes=0.0, prefill_c_bytes=0.0, growth_factor=0.0,
                   kv_bytes_per_token=1000, budget_bytes=1000 * (4096 + 1024))
    assert fits_now(m, [256], 100, 100, 0, 1 << 50)[0]
    assert not fits_now(m, [4096], 100, 100, 0, 1 << 50)[0]


def test_fits_now_counts_prefilling_rows() -> None:
    m = make_model()
    _, decoding = fits_now(m, [1010, 1010], 1000, 10, 0, 1 << 50)
    _, prefilling = fits_now(m, [1010, 1010], 1000, 10, 2, 1 << 50)
    # Two rows that are still prefilling pay a chunk each instead of one decode token each.
    assert prefilling - decoding == 2 * (prefill_transient_bytes(m, m.prefill_step_tokens, 1010)
                                         - prefill_transient_bytes(m, 1, 1010))


@FAST
@given(m=models, running=st.lists(st.integers(1, 1 << 15), max_size=8),
       prompt=st.integers(0, 1 << 15), out=st.integers(1, 1 << 12),
       prefill_rows=st.integers(0, 4), free=st.integers(-(1 << 30), 1 << 42))
@example(m=CostModel(kv_bytes_per_token=1, num_layers=1, prefill_a_bytes=0.0, prefill_c_bytes=1.0,
                     prefill_b_bytes=0.0, growth_factor=0.0, copy_factor=1.0, scale=1.0,
                     budget_bytes=1345, context_length=1, prefill_step_tokens=33,
                     prefill_batch_size=1),
         running=[], prompt=33, out=1, prefill_rows=0, free=1345)  # a 33-token chunk fits
def test_fits_now_is_consistent(m: CostModel, running: list[int], prompt: int, out: int,
                                prefill_rows: int, free: int) -> None:
    fits, worst = fits_now(m, running, prompt, out, prefill_rows, free)
    old = batch_cost_bytes(m, len(running), max(running), 0, 0, 0) if running else 0
    assert fits == (worst <= m.budget_bytes and worst - old <= free)
    assert worst >= old
    if not running and prefill_rows == 0 and prompt >= 1:
        # An idle worker charges the largest chunk that fits (at least the smallest one
        # never-fits charges), so it admits exactly what never_fits lets through.
        assert worst >= request_cost_bytes(m, prompt, out)
        if free >= m.budget_bytes:
            assert fits == (not never_fits(m, prompt, out))


def test_max_new_tokens_is_the_largest_that_fits_after_the_prompt() -> None:
    m = make_model(budget_bytes=16 * 1024 * 1024)
    n = max_new_tokens(m, 600)
    assert 0 < n < m.context_length - 600 and not never_fits(m, 600, n)
    # What is left beside the reservation holds a prefill chunk of the full step
    free = m.budget_bytes - batch_kv_bytes(1, 600 + n, m.kv_bytes_per_token) \
        - growth_spike_bytes(m, 1, 600 + n)
    assert safe_prefill_chunk(m, free, 600) == m.prefill_step_tokens
    assert safe_prefill_chunk(m, free + KV_STEP_TOKENS * m.kv_bytes_per_token, 600) \
        == m.prefill_step_tokens
    bigger = n + 1 + (-(600 + n + 1)) % KV_STEP_TOKENS  # the next step of the cache
    assert safe_prefill_chunk(m, m.budget_bytes - batch_kv_bytes(1, 600 + bigger, m.kv_bytes_per_token)
                              - growth_spike_bytes(m, 1, 600 + bigger), 600) < m.prefill_step_tokens
    assert max_new_tokens(make_model(budget_bytes=10**12), 500) == 8192 - 500
    assert max_new_tokens(m, 10**6) == 0
    edge = max_new_tokens(m, 600, MIN_CHUNK_TOKENS)  # never_fits' own edge
    assert edge >= n and not never_fits(m, 600, edge) and never_fits(m, 600, edge + 1)


@pytest.mark.parametrize(("total", "cached", "reach"), [
    (252, 0, 252), (252, 235, 491), (600, 512, 600), (600, 300, 812), (256, 255, 511), (1, 0, 1),
])
def test_kv_reach_follows_mlx_lms_growth_from_a_cached_prefix(total: int, cached: int, reach: int) -> None:
    assert kv_reach_tokens(total, cached) == reach


@pytest.mark.parametrize(("tokens", "chunk"), [(300, 256), (2047, 1792), (512, 512), (255, 128), (100, 64), (1, 1)])
def test_prefill_chunks_keep_growths_on_whole_steps(tokens: int, chunk: int) -> None:
    assert kv_aligned_chunk(tokens) == chunk


# -- scoring: a prompt's own logprobs -------------------------------------------------

QWEN_VOCAB = 152_064


def test_a_scoring_chunk_costs_one_pass_of_logprobs_never_the_prompts_matrix() -> None:
    # A 2k-token prompt at a Qwen-sized vocabulary: its logits matrix alone in float32 is
    # over 1 GB; a scoring chunk's float32 work is one pass of SCORE_PASS_BYTES at most.
    m = make_model(vocab_size=QWEN_VOCAB, prefill_a_bytes=4.0 * QWEN_VOCAB)
    matrix = 2048 * QWEN_VOCAB * 4
    assert matrix > 1 << 30
    for chunk in (32, 512, 2047):
        work = scoring_transient_bytes(m, chunk, 2048) - forward_transient_bytes(
            m, chunk_tokens=chunk, context_tokens=2048, prefill_rows=1, decode_rows=0, decode_context=0)
        assert 0 < work <= SCORE_PASS_BYTES
    assert score_rows_per_pass(QWEN_VOCAB) * QWEN_VOCAB * SCORE_BYTES_PER_LOGIT <= SCORE_PASS_BYTES
    assert score_rows_per_pass(0) >= 1 and score_rows_per_pass(10**12) == 1
    assert scoring_transient_bytes(m, 0, 2048) == 0


def test_a_small_vocabulary_is_scored_in_one_pass() -> None:
    m = make_model(vocab_size=512)
    assert scoring_transient_bytes(m, 64, 64) == forward_transient_bytes(
        m, chunk_tokens=64, context_tokens=64, prefill_rows=1, decode_rows=0,
        decode_context=0) + 64 * 512 * SCORE_BYTES_PER_LOGIT


def test_a_scored_row_reaches_from_its_scored_prefix_and_never_joins_without_tokens() -> None:
    assert scored_kv_start(1000, 1) == 999
    assert scored_kv_start(1000, 0) == 0
    assert scored_kv_start(1, 5) == 0  # a one-token prompt has nothing scored
    # Until it joins, a scored row is charged with its scored KV once more: at the join the
    # scored cache and the batch's copy of it coexist.
    assert scored_reach_tokens(1000, 1) == kv_reach_tokens(1001, 999) + 999
    assert scored_reach_tokens(1000, 0) == 1000 and scored_reach_tokens(1, 5) == 6


@given(m=models, prompt=st.integers(1, 8192), max_tokens=st.integers(0, 512))
@FAST
def test_scoring_costs_at_least_as_much_as_generating(m: CostModel, prompt: int, max_tokens: int) -> None:
    m = dataclasses.replace(m, vocab_size=QWEN_VOCAB)
    scoring = request_cost_bytes(m, prompt, max_tokens, scoring=True)
    assert scoring >= request_cost_bytes(m, prompt, max_tokens) - m.scale  # int() rounding
    assert never_fits(m, prompt, max_tokens, scoring=True) or not never_fits(m, prompt, max_tokens)


def test_a_scoring_request_that_can_never_fit_is_told_so() -> None:
    m = make_model(vocab_size=QWEN_VOCAB, prefill_a_bytes=4.0 * QWEN_VOCAB, budget_bytes=200 << 20,
                   kv_bytes_per_token=64 << 10)
    most = max_request_tokens(m, scoring=True)
    assert 0 < most < max_request_tokens(m)
    assert not never_fits(m, most - 1, 1, scoring=True)
    assert never_fits(m, most + KV_STEP_TOKENS, 1, scoring=True)
    assert not never_fits(m, most + KV_STEP_TOKENS, 1)  # the same request without its scores fits


def test_a_scoring_chunk_is_charged_beside_the_batch_at_admission() -> None:
    m = make_model(vocab_size=QWEN_VOCAB)
    plain = fits_now(m, [600], 100, 10, 0, m.budget_bytes)
    scored = fits_now(m, [600], 100, 10, 0, m.budget_bytes, score_context=100)
    assert scored[1] - plain[1] == scoring_step_bytes(m, MIN_CHUNK_TOKENS, 100)
    # Admission charges it at the smallest chunk, beside the batch at its smallest chunk: a
    # budget a byte short of both holds the request without its scores, not with them.
    least = batch_cost_bytes(m, 2, 600, MIN_CHUNK_TOKENS, 1, 600) + scoring_step_bytes(m, MIN_CHUNK_TOKENS, 100)
    tight = dataclasses.replace(m, budget_bytes=least - 1)
    assert fits_now(tight, [600], 100, 10, 0, tight.budget_bytes)[0]
    assert not fits_now(tight, [600], 100, 10, 0, tight.budget_bytes, score_context=100)[0]
    assert fits_now(dataclasses.replace(m, budget_bytes=least), [600], 100, 10, 0, least, score_context=100)[0]


def test_the_scoring_chunk_shrinks_to_what_fits() -> None:
    m = make_model(vocab_size=QWEN_VOCAB)
    assert score_chunk_that_fits(m, 2048, 1 << 40, 512) == 512
    limit = scoring_step_bytes(m, 100, 2048)
    assert score_chunk_that_fits(m, 2048, limit, 512) == 100
    assert score_chunk_that_fits(m, 2048, 0, 512) == MIN_CHUNK_TOKENS  # the floor: admission made room for it
