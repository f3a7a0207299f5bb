"""Tests for worker/pacer.py: prefill chunks sized by step time (pure, no clocks)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.pacer import ChunkPacer

FAST = settings(max_examples=200, deadline=None)
MIN_CHUNK = 16


def test_starts_at_the_first_chunk() -> None:
    pacer = ChunkPacer(0.5, 512)
    assert pacer.chunk(1) == 64
    assert pacer.chunk(8) == 64
    assert ChunkPacer(0.5, 512, first_chunk=100).chunk(1) == 100


def test_first_chunk_never_above_the_max() -> None:
    assert ChunkPacer(0.5, 32, first_chunk=64).chunk(1) == 32


def test_chunk_follows_the_measured_rate() -> None:
    pacer = ChunkPacer(0.5, 4096)
    pacer.observe(200, 1.0)  # 200 tokens/s
    assert pacer.chunk(1) == 100  # 200 tokens/s x 0.5 s
    assert pacer.chunk(2) == 50
    assert pacer.chunk(4) == 25


def test_chunk_is_clamped() -> None:
    fast = ChunkPacer(0.5, 512)
    fast.observe(1_000_000, 1.0)
    assert fast.chunk(1) == 512
    slow = ChunkPacer(0.5, 512)
    slow.observe(10, 1.0)
    assert slow.chunk(1) == MIN_CHUNK
    assert slow.chunk(64) == MIN_CHUNK


def test_a_slow_step_shrinks_the_chunk_at_once() -> None:
    pacer = ChunkPacer(0.5, 4096)
    for _ in range(20):
        pacer.observe(2000, 1.0)
    assert pacer.chunk(1) == 1000
    pacer.observe(2000, 10.0)  # one step ten times slower: halfway (in log) at once
    assert pacer.chunk(1) == int(1000 / 10 ** 0.5)
    for _ in range(6):  # a slowdown that lasts is followed within a few steps
        pacer.observe(2000, 10.0)
    assert pacer.chunk(1) == pytest.approx(100, rel=0.05)


def test_a_fast_step_grows_the_chunk_gradually() -> None:
    pacer = ChunkPacer(0.5, 4096)
    pacer.observe(200, 1.0)
    before = pacer.chunk(1)
    pacer.observe(2000, 1.0)
    after = pacer.chunk(1)
    assert before < after < 1000  # smoothed, not the new rate at once
    for _ in range(100):
        pacer.observe(2000, 1.0)
    assert pacer.chunk(1) == pytest.approx(1000, abs=2)


def test_prompts_within_twice_the_chunk_finish_in_one() -> None:
    pacer = ChunkPacer(0.5, 512)
    pacer.observe(256, 1.0)  # 256 tokens/s: 16 per row for 8 rows
    assert pacer.chunk(8) == 16
    assert pacer.chunk(8, longest_left=31) == 31  # one pass instead of two
    assert pacer.chunk(8, longest_left=32) == 32
    assert pacer.chunk(8, longest_left=33) == 16  # a long prompt stays paced
    assert pacer.chunk(8, longest_left=0) == 16
    assert pacer.chunk(1, longest_left=10) == 10  # no bigger than what is left


def test_finishing_never_exceeds_the_max_chunk() -> None:
    pacer = ChunkPacer(0.5, 40)
    pacer.observe(1_000_000, 1.0)
    assert pacer.chunk(1) == 40
    assert pacer.chunk(1, longest_left=70) == 40


@pytest.mark.parametrize(("tokens", "seconds"), [(0, 1.0), (-5, 1.0), (100, 0.0), (100, -1.0),
                                                  (0, 0.0)])
def test_zero_or_negative_observations_are_ignored(tokens: int, seconds: float) -> None:
    fresh = ChunkPacer(0.5, 4096)
    fresh.observe(tokens, seconds)
    assert fresh.chunk(1) == 64
    learned = ChunkPacer(0.5, 4096)
    learned.observe(400, 1.0)
    learned.observe(tokens, seconds)
    assert learned.chunk(1) == 200


@FAST
@given(budget=st.floats(0.01, 5.0), max_chunk=st.integers(MIN_CHUNK, 8192),
       # Step durations are monotonic-clock differences: zero, or at least a microsecond.
       steps=st.lists(st.tuples(st.integers(-10, 100_000),
                                st.floats(-1.0, 0.0) | st.floats(1e-6, 30.0)), max_size=20),
       rows=st.integers(1, 64), longest_left=st.integers(0, 20_000))
def test_chunk_is_always_within_bounds(budget: float, max_chunk: int,
                                       steps: list[tuple[int, float]], rows: int,
                                       longest_left: int) -> None:
    pacer = ChunkPacer(budget, max_chunk)
    for tokens, seconds in steps:
        pacer.observe(tokens, seconds)
    paced = pacer.chunk(rows)
    assert isinstance(paced, int)
    assert MIN_CHUNK <= paced <= max_chunk or paced == min(64, max_chunk)
    chunk = pacer.chunk(rows, longest_left)
    assert 1 <= chunk <= max_chunk
    assert chunk <= 2 * paced  # a step stays within about twice the budget
    assert chunk == paced or chunk == min(longest_left, max_chunk)


@FAST
@given(budget=st.floats(0.01, 5.0), max_chunk=st.integers(MIN_CHUNK, 8192),
       tokens=st.integers(1, 100_000), seconds=st.floats(1e-3, 30.0),
       rows=st.integers(1, 63), more=st.integers(1, 64))
def test_more_rows_never_give_a_bigger_chunk(budget: float, max_chunk: int, tokens: int,
                                             seconds: float, rows: int, more: int) -> None:
    pacer = ChunkPacer(budget, max_chunk)
    pacer.observe(tokens, seconds)
    assert pacer.chunk(rows + more) <= pacer.chunk(rows)
    expected = int(tokens / seconds * budget / rows)
    assert pacer.chunk(rows) == max(MIN_CHUNK, min(max_chunk, expected))


@FAST
@given(tokens=st.integers(1, 100_000), fast=st.floats(1e-3, 10.0), slower=st.floats(1.0, 100.0))
def test_a_slower_step_never_grows_the_chunk(tokens: int, fast: float, slower: float) -> None:
    pacer = ChunkPacer(0.5, 1 << 20)
    pacer.observe(tokens, fast)
    before = pacer.chunk(1)
    pacer.observe(tokens, fast * slower)
    assert pacer.chunk(1) <= before


def test_zero_rows_is_treated_as_one() -> None:
    pacer = ChunkPacer(0.5, 4096)
    pacer.observe(400, 1.0)
    assert pacer.chunk(0) == pacer.chunk(1) == 200
