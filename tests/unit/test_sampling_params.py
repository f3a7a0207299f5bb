"""Tests for router/chat/sampling_params.py: each sampling parameter parsed, bad values named in a 400."""

from __future__ import annotations

from typing import Any

import pytest

from common.errors import BadRequest
from common.protocol import SamplingParams
from router.chat.sampling_params import check_token_ids, parse_sampling


def parse(chat: bool = True, **body: Any) -> SamplingParams:
    return parse_sampling(body, chat=chat)


def refused(chat: bool = True, **body: Any) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        parse_sampling(body, chat=chat)
    assert info.value.status == 400
    return info.value


def test_defaults_are_neutral() -> None:
    p = parse()
    assert p == SamplingParams(temperature=1.0)
    assert p.num_logprobs is None and p.logit_bias == [] and p.top_k == 0


@pytest.mark.parametrize(("name", "value", "expected"), [
    ("top_k", 1, 1), ("top_k", 0, 0), ("top_k", -1, 0), ("top_k", 40, 40),
    ("min_p", 0, 0.0), ("min_p", 0.05, 0.05), ("min_p", 1, 1.0),
    ("repetition_penalty", 1.3, 1.3), ("repetition_penalty", 0.5, 0.5),
    ("repetition_context_size", 64, 64),
    ("presence_penalty", -2, -2.0), ("presence_penalty", 0, 0.0), ("presence_penalty", 1.5, 1.5),
    ("presence_context_size", 100, 100),
    ("frequency_penalty", 2, 2.0), ("frequency_context_size", 7, 7),
    ("temperature", 0, 0.0), ("top_p", 0.5, 0.5),
])
def test_values_taken_as_given(name: str, value: Any, expected: Any) -> None:
    """A falsy value is a value, never mistaken for the default."""
    assert getattr(parse(**{name: value}), name) == expected


def test_top_p_zero_keeps_one_token() -> None:
    """OpenAI's and Anthropic's range is [0, 1]: 0 is the smallest nucleus, the top token."""
    params = parse(top_p=0)
    assert params.top_k == 1 and params.top_p == 1.0


@pytest.mark.parametrize(("name", "value"), [
    ("top_k", -2), ("top_k", 1.5), ("top_k", "5"), ("top_k", True),
    ("min_p", -0.1), ("min_p", 1.1), ("min_p", "0.1"), ("min_p", float("nan")),
    ("repetition_penalty", 0), ("repetition_penalty", -1), ("repetition_penalty", 11),
    ("repetition_penalty", False),
    ("repetition_context_size", 0), ("repetition_context_size", 1.5),
    ("presence_penalty", 2.5), ("presence_penalty", -3), ("presence_penalty", "1"),
    ("frequency_penalty", 2.01), ("frequency_penalty", True),
    ("presence_context_size", -1), ("frequency_context_size", "20"),
    ("ignore_eos", 1),
])
def test_bad_values_name_the_parameter(name: str, value: Any) -> None:
    err = refused(**{name: value})
    assert err.param == name and name in err.message


def test_logit_bias() -> None:
    assert parse(logit_bias={"5": 100, "7": -100.0, "9": 0}).logit_bias == [
        [5, 100.0], [7, -100.0], [9, 0.0]]
    assert parse(logit_bias={}).logit_bias == []


@pytest.mark.parametrize("bias", [[1], "x", {"a": 1}, {"5": 101}, {"5": -100.5}, {"5": "1"},
                                  {"-1": 1}, {"5": True}, {str(i): 1 for i in range(1025)}])
def test_bad_logit_bias(bias: Any) -> None:
    assert refused(logit_bias=bias).param == "logit_bias"


def test_logit_bias_ids_in_vocabulary() -> None:
    check_token_ids(parse(logit_bias={"511": 1}), 512)
    with pytest.raises(BadRequest) as info:
        check_token_ids(parse(logit_bias={"512": 1}), 512)
    assert info.value.param == "logit_bias"


@pytest.mark.parametrize(("seed", "expected"), [(0, 0), (2**63, 2**63), (2**64 - 1, 2**64 - 1),
                                               (-1, 2**64 - 1), (-(2**63), 2**63)])
def test_seed_full_64_bits(seed: int, expected: int) -> None:
    assert parse(seed=seed).seed == expected


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 1.0, "1", True])
def test_seed_out_of_range(seed: Any) -> None:
    err = refused(seed=seed)
    assert err.param == "seed" and "2**64" in err.message


@pytest.mark.parametrize(("body", "expected"), [
    ({}, None), ({"logprobs": False}, None), ({"logprobs": True}, 0),
    ({"logprobs": True, "top_logprobs": 0}, 0), ({"logprobs": True, "top_logprobs": 20}, 20),
])
def test_chat_logprobs(body: dict[str, Any], expected: int | None) -> None:
    assert parse(**body).num_logprobs == expected


@pytest.mark.parametrize(("body", "param"), [
    ({"logprobs": 1}, "logprobs"), ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"), ({"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
])
def test_bad_chat_logprobs(body: dict[str, Any], param: str) -> None:
    assert refused(**body).param == param


@pytest.mark.parametrize(("value", "expected"), [(None, None), (0, 0), (5, 5)])
def test_completion_logprobs(value: Any, expected: int | None) -> None:
    """``logprobs: 0`` asks for the sampled tokens' own logprobs (OpenAI), not nothing."""
    assert parse(chat=False, logprobs=value).num_logprobs == expected


@pytest.mark.parametrize("value", [6, -1, True, 1.0, "2"])
def test_bad_completion_logprobs(value: Any) -> None:
    assert refused(chat=False, logprobs=value).param == "logprobs"
