"""Tests for router/fleet/admission.py: "fits ever?" (the 400s) and "fits now?" (dispatch or queue)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common import costmodel
from common.costmodel import CostModel
from common.errors import BadRequest, ContextLengthExceeded, InsufficientMemory
from router.fleet.admission import (
    STALE_REPORT_S, UNKNOWN_CONTEXT_TOKENS, Verdict, WorkerView, can_dispatch, check_ever,
    check_max_tokens_only, room_left,
)

FAST = settings(max_examples=200, deadline=None)


def make_model(**overrides: Any) -> CostModel:
    values: dict[str, Any] = dict(
        kv_bytes_per_token=1000, num_layers=4, prefill_a_bytes=100.0, prefill_c_bytes=0.1,
        growth_factor=1.0, budget_bytes=8_000_000, context_length=32768,
        prefill_step_tokens=512, prefill_batch_size=8)
    values.update(overrides)
    return CostModel(**values)


def make_view(model: CostModel | None = None, **overrides: Any) -> WorkerView:
    values: dict[str, Any] = dict(model=model or make_model(), admission=True, max_running=8,
                                  report_age_s=0.1, held=False)
    values.update(overrides)
    return WorkerView(**values)


# -- check_ever ----------------------------------------------------------------------


def test_fits() -> None:
    assert check_ever(make_model(), True, 100, 100) is None


def test_context_length_exceeded() -> None:
    m = make_model(context_length=1000)
    err = check_ever(m, True, 900, 101)
    assert isinstance(err, ContextLengthExceeded)
    assert err.status == 400 and err.code == "context_length_exceeded"
    assert "1000" in err.message
    assert not isinstance(check_ever(m, True, 900, 100), ContextLengthExceeded)


def test_a_prompt_whose_scores_can_never_fit_is_refused_with_the_scoring_limit() -> None:
    m = make_model(vocab_size=32_000)
    most = costmodel.max_request_tokens(m, scoring=True)
    assert 0 < most < costmodel.max_request_tokens(m)
    prompt = most + 300
    assert check_ever(m, True, prompt, 1) is None  # without its scores it fits
    err = check_ever(m, True, prompt, 1, scoring=True)
    assert isinstance(err, InsufficientMemory) and err.code == "insufficient_memory"
    assert err.extra["max_request_tokens"] == most and "prompt's logprobs" in err.message
    assert err.extra["needed_bytes"] == costmodel.request_cost_bytes(m, prompt, 1, scoring=True) > m.budget_bytes
    assert check_ever(m, False, prompt, 1, scoring=True) is None  # --unsafe-no-admission


@pytest.mark.parametrize(("prompt", "max_tokens", "param"), [
    (2000, 10, "messages"), (10, 2000, "max_tokens"),
])
def test_context_length_names_the_larger_part(prompt: int, max_tokens: int, param: str) -> None:
    err = check_ever(make_model(context_length=1000), False, prompt, max_tokens)
    assert isinstance(err, ContextLengthExceeded) and err.param == param


def test_insufficient_memory_carries_numbers() -> None:
    m = make_model()
    limit = costmodel.max_request_tokens(m)
    assert limit < m.context_length
    err = check_ever(m, True, limit, 100)
    assert isinstance(err, InsufficientMemory)
    assert err.status == 400 and err.code == "insufficient_memory" and err.param == "max_tokens"
    assert err.extra["max_request_tokens"] == limit
    assert err.extra["needed_bytes"] == costmodel.request_cost_bytes(m, limit, 100)
    assert err.extra["needed_bytes"] > m.budget_bytes
    body = err.to_body()["error"]
    assert body["needed_bytes"] == err.extra["needed_bytes"]
    assert body["max_request_tokens"] == limit


def test_context_checked_before_memory() -> None:
    m = make_model(context_length=1000, budget_bytes=0)
    assert isinstance(check_ever(m, True, 1000, 1), ContextLengthExceeded)


def test_admission_off_skips_the_memory_check() -> None:
    m = make_model(budget_bytes=0)
    assert isinstance(check_ever(m, True, 10, 10), InsufficientMemory)
    assert check_ever(m, False, 10, 10) is None
    assert isinstance(check_ever(make_model(context_length=100), False, 90, 11),
                      ContextLengthExceeded)


def test_check_max_tokens_only() -> None:
    m = make_model(context_length=1000)
    assert check_max_tokens_only(m, True, 999) is None
    assert isinstance(check_max_tokens_only(m, True, 1000), ContextLengthExceeded)
    assert isinstance(check_max_tokens_only(make_model(budget_bytes=0), True, 1), InsufficientMemory)
    # Before tokenizing, the prompt's size is a lower bound, and said to be one
    error = check_max_tokens_only(m, True, 5000)
    assert error is not None and "at least 1 prompt token" in error.message
    assert "1 prompt tokens" not in error.message


def test_context_length_carries_its_sizes() -> None:
    error = check_ever(make_model(context_length=4096), False, 296, 4000)
    assert isinstance(error, ContextLengthExceeded) and error.sizes == (296, 4000, 4096)
    assert "296 prompt tokens" in error.message


@FAST
@given(prompt=st.integers(0, 40000), max_tokens=st.integers(1, 40000),
       budget=st.integers(0, 50_000_000))
def test_check_ever_matches_the_cost_model(prompt: int, max_tokens: int, budget: int) -> None:
    m = make_model(budget_bytes=budget)
    err = check_ever(m, True, prompt, max_tokens)
    if prompt + max_tokens > m.context_length:
        assert isinstance(err, ContextLengthExceeded)
    elif costmodel.never_fits(m, prompt, max_tokens):
        assert isinstance(err, InsufficientMemory)
        assert err.extra["max_request_tokens"] < prompt + max_tokens
    else:
        assert err is None
    assert err is None or isinstance(err, BadRequest)


# -- can_dispatch --------------------------------------------------------------------


def test_idle_fresh_worker_dispatches() -> None:
    assert can_dispatch(make_view(), [], 100, 100) is Verdict.DISPATCH


def test_stale_report_queues() -> None:
    assert can_dispatch(make_view(report_age_s=STALE_REPORT_S + 0.01), [], 1, 1) is Verdict.QUEUE
    assert can_dispatch(make_view(report_age_s=STALE_REPORT_S), [], 1, 1) is Verdict.DISPATCH


def test_stale_report_queues_even_without_admission() -> None:
    view = make_view(admission=False, report_age_s=STALE_REPORT_S * 10)
    assert can_dispatch(view, [], 1, 1) is Verdict.QUEUE


def test_held_queues() -> None:
    assert can_dispatch(make_view(held=True), [], 1, 1) is Verdict.QUEUE
    assert can_dispatch(make_view(held=True, admission=False), [], 1, 1) is Verdict.QUEUE


def test_running_cap() -> None:
    view = make_view(max_running=2)
    assert can_dispatch(view, [10], 1, 1) is Verdict.DISPATCH
    assert can_dispatch(view, [10, 10], 1, 1) is Verdict.QUEUE
    assert can_dispatch(dataclasses.replace(view, admission=False), [10, 10], 1, 1) is Verdict.QUEUE


def test_budget() -> None:
    m = make_model()
    limit = costmodel.max_request_tokens(m)
    assert can_dispatch(make_view(m), [], limit - 1, 1) is Verdict.DISPATCH
    assert can_dispatch(make_view(m), [], limit, 1) is Verdict.QUEUE


def test_short_request_held_back_beside_a_long_one() -> None:
    m = make_model(prefill_a_bytes=0.0, prefill_c_bytes=0.0, growth_factor=0.0,
                   budget_bytes=1000 * (4096 + 1024))
    view = make_view(m)
    assert can_dispatch(view, [200], 100, 100) is Verdict.DISPATCH
    assert can_dispatch(view, [4000], 100, 100) is Verdict.QUEUE


def test_admission_off_ignores_the_budget() -> None:
    view = make_view(make_model(budget_bytes=0), admission=False)
    assert can_dispatch(view, [], 1000, 1000) is Verdict.DISPATCH


@FAST
@given(prompt=st.integers(1, 40000), max_tokens=st.integers(1, 40000),
       budget=st.integers(0, 50_000_000))
def test_what_fits_ever_dispatches_on_an_idle_worker(prompt: int, max_tokens: int,
                                                     budget: int) -> None:
    """Otherwise a request that passed check_ever would wait in the queue forever."""
    m = make_model(budget_bytes=budget)
    if check_ever(m, True, prompt, max_tokens) is None:
        assert can_dispatch(make_view(m), [], prompt, max_tokens) is Verdict.DISPATCH


@FAST
@given(running=st.lists(st.integers(1, 20000), max_size=6), prompt=st.integers(1, 20000),
       max_tokens=st.integers(1, 5000), more=st.integers(1, 5000))
def test_more_in_flight_never_turns_queue_into_dispatch(running: list[int], prompt: int,
                                                        max_tokens: int, more: int) -> None:
    view = make_view(max_running=100)
    if can_dispatch(view, running, prompt, max_tokens) is Verdict.QUEUE:
        assert can_dispatch(view, running + [more], prompt, max_tokens) is Verdict.QUEUE


# -- room_left: the max_tokens of a request that named none ----------------------------


def test_room_left_is_the_context_left_when_memory_holds_it() -> None:
    m = make_model(budget_bytes=10**12, context_length=4096)
    assert room_left(m, True, 1000, None) == 3096
    assert room_left(m, True, 1000, 512) == 512  # --default-max-tokens / --max-tokens-limit
    assert check_ever(m, True, 1000, 3096) is None


@given(prompt=st.integers(1, 40000), budget=st.integers(1_000_000, 80_000_000))
@FAST
def test_room_left_always_fits_an_idle_worker(prompt: int, budget: int) -> None:
    """Tight memory caps the default at what fits, so a request is never refused for a
    max_tokens it did not ask for, and one token more would not fit."""
    m = make_model(budget_bytes=budget)
    room = room_left(m, True, prompt, None)
    if check_ever(m, True, prompt, 1) is not None:
        assert room == 1  # the prompt alone does not fit: check_ever's own 400
        return
    assert check_ever(m, True, prompt, room) is None
    full_step = costmodel.max_new_tokens(m, prompt)
    edge = costmodel.max_new_tokens(m, prompt, costmodel.MIN_CHUNK_TOKENS)
    assert costmodel.never_fits(m, prompt, edge + 1) or edge == m.context_length - prompt
    # The room keeps a full prefill chunk free when any room does; else it is all that fits
    assert room == (full_step or edge)


def test_room_left_without_admission_ignores_memory() -> None:
    m = make_model(budget_bytes=1, context_length=4096)
    assert room_left(m, False, 96, None) == 4000


def test_room_left_before_any_worker_said_hello() -> None:
    assert room_left(None, True, 100, None, context_length=8192) == 8092
    assert room_left(None, True, 100, 256, context_length=8192) == 256
    assert room_left(None, True, 100, None) == UNKNOWN_CONTEXT_TOKENS - 100
    assert room_left(None, True, 10**6, None) == 1
