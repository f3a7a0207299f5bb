"""worker/sampling.py on plain arrays: each row's sampler, its processors and its logprobs."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from common.protocol import SamplingParams
from worker.sampling import MIN_LOGPROB, logprob_rows, make_processors, make_sampler

VOCAB = 50


def logprobs(seed: int = 0) -> mx.array:
    logits = mx.random.normal((1, VOCAB), key=mx.random.key(seed))
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def draws(sampler, lp: mx.array, n: int = 20) -> list[int]:
    return [int(sampler(lp).item()) for _ in range(n)]


def test_greedy_rows_share_the_generators_sampler() -> None:
    assert make_sampler(SamplingParams(temperature=0.0)) is None


def test_a_seeded_row_repeats_itself_whatever_the_global_random_state() -> None:
    lp = logprobs()
    p = SamplingParams(temperature=1.0, seed=2**64 - 1)
    mx.random.seed(1)
    first = draws(make_sampler(p), lp)
    mx.random.seed(999)
    again = draws(make_sampler(p), lp)
    assert first == again and len(set(first)) > 1  # the same stream, and a random one


def test_top_k_1_and_a_tiny_top_p_are_the_most_likely_token() -> None:
    lp = logprobs(3)
    best = int(mx.argmax(lp, axis=-1).item())
    for p in (SamplingParams(temperature=1.0, top_k=1, seed=1),
              SamplingParams(temperature=1.0, top_p=1e-6, seed=1),
              SamplingParams(temperature=1.0, min_p=0.9999, seed=1)):
        assert set(draws(make_sampler(p), lp)) == {best}, p


def test_processors_bias_then_the_grammar_last() -> None:
    lp = logprobs(4)
    (bias,) = make_processors(SamplingParams(logit_bias=[[7, 100.0]]))
    assert int(mx.argmax(bias(mx.array([[1, 2]]), lp), axis=-1).item()) == 7
    assert make_processors(SamplingParams()) == []
    with pytest.raises(ValueError, match="grammar"):
        make_processors(SamplingParams(grammar="{}"), grammars=None)


def test_logprob_rows_are_the_sampled_token_and_the_k_most_likely() -> None:
    lp = logprobs(5)[0]
    order = mx.argsort(-lp).tolist()
    forbidden = mx.where(mx.arange(VOCAB) == order[-1], -math.inf, lp)  # as a grammar masks
    rows = logprob_rows([(lp, order[2], 3), (forbidden, order[-1], 0), (lp, order[0], 5)])
    values = lp.tolist()
    chosen, ids, top = rows[0]
    assert chosen == pytest.approx(values[order[2]]) and ids == order[:3]
    assert top == pytest.approx([values[i] for i in order[:3]])
    assert rows[1] == [MIN_LOGPROB, [], []]          # -inf is reported as a finite floor
    assert rows[2][1] == order[:5] and logprob_rows([]) == []
