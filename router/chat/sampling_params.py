"""OpenAI sampling parameters → the wire ``SamplingParams``. Pure: no I/O.

Every rule raises ``BadRequest`` naming the parameter; ``None`` always means "not given"
and a falsy value (``0``, ``0.0``) is taken as given, never mistaken for the default.
The context-size fields are mlx-lm server's extensions, accepted under the same names.
The token ids in ``logit_bias`` are checked against the vocabulary later, by the caller
that has the tokenizer (``check_token_ids``).
"""

from __future__ import annotations

from typing import Any

from common.errors import BadRequest
from common.protocol import SamplingParams
from router.job import ROOM_LEFT

__all__ = ["MAX_LOGIT_BIAS", "MAX_TOP_LOGPROBS", "MAX_COMPLETION_LOGPROBS", "parse_max_tokens",
           "parse_sampling", "parse_prompt_logprobs", "check_token_ids", "is_int", "is_number"]

MAX_LOGIT_BIAS = 1024
MAX_TOP_LOGPROBS = 20          # chat completions
MAX_COMPLETION_LOGPROBS = 5    # legacy completions
MAX_CONTEXT_SIZE = 1 << 20
SEED_RANGE = (-(2**63), 2**64)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float,
            *, open_lo: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    ok = is_number(value) and (lo < value if open_lo else lo <= value) and value <= hi
    if not ok:
        span = f"({lo}, {hi}]" if open_lo else f"[{lo}, {hi}]"
        raise BadRequest(f"{name} must be a number in {span}, got {value!r}", param=name)
    return float(value)


def _integer(body: dict[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value) or not lo <= value <= hi:
        raise BadRequest(f"{name} must be an integer in [{lo}, {hi}], got {value!r}", param=name)
    return int(value)


def parse_max_tokens(body: dict[str, Any], default_max_tokens: int | None, *, allow_zero: bool = False) -> int:
    """The max_tokens asked for, else the default; ``ROOM_LEFT`` without a default.
    ``allow_zero``: 0 asks for no tokens at all (with echo: the prompt, and its logprobs)."""
    max_tokens = ROOM_LEFT if default_max_tokens is None else default_max_tokens
    least = 0 if allow_zero else 1
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not is_int(value) or value < least:
            what = "a non-negative integer (0 only with echo)" if allow_zero else "a positive integer"
            raise BadRequest(f"{name} must be {what}, got {value!r}", param=name)
        max_tokens = value
    return max_tokens


def parse_sampling(body: dict[str, Any], *, chat: bool) -> SamplingParams:
    """Every sampling parameter of a chat or text completion request."""
    top_k = _integer(body, "top_k", 0, -1, 1 << 31)
    seed = body.get("seed")
    if seed is not None and (not is_int(seed) or not SEED_RANGE[0] <= seed < SEED_RANGE[1]):
        raise BadRequest(f"seed must be an integer in [-2**63, 2**64), got {seed!r}", param="seed")
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise BadRequest("ignore_eos must be a bool", param="ignore_eos")
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:  # OpenAI's and Anthropic's range takes 0: the smallest nucleus, one token
        top_p, top_k = 1.0, 1
    return SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=top_p,
        top_k=max(top_k, 0),  # -1 and 0 both mean "off", as in vLLM and mlx-lm
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 10.0, open_lo=True),
        repetition_context_size=_integer(body, "repetition_context_size", 20, 1, MAX_CONTEXT_SIZE),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        presence_context_size=_integer(body, "presence_context_size", 20, 1, MAX_CONTEXT_SIZE),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        frequency_context_size=_integer(body, "frequency_context_size", 20, 1, MAX_CONTEXT_SIZE),
        logit_bias=_logit_bias(body.get("logit_bias")),
        # One 64-bit key space: a negative seed names the same key as its two's complement.
        seed=None if seed is None else seed % 2**64,
        ignore_eos=bool(ignore_eos),
        num_logprobs=_chat_logprobs(body) if chat else _completion_logprobs(body),
    )


def _logit_bias(value: Any) -> list[list[float]]:
    if value is None:
        return []
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise BadRequest(f"logit_bias must be an object of up to {MAX_LOGIT_BIAS} token ids "
                         "to numbers", param="logit_bias")
    out: list[list[float]] = []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise BadRequest(f"logit_bias key {key!r} is not a token id", param="logit_bias") from None
        if token < 0 or not is_number(bias) or not -100 <= bias <= 100:
            raise BadRequest(f"logit_bias[{key!r}] must map a token id to a number in "
                             "[-100, 100]", param="logit_bias")
        out.append([token, float(bias)])
    return out


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise BadRequest("logprobs must be a bool", param="logprobs")
    top = _integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if body.get("top_logprobs") is not None and not logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    return top if logprobs else None


def _completion_logprobs(body: dict[str, Any]) -> int | None:
    if body.get("logprobs") is None:
        return None
    return _integer(body, "logprobs", 0, 0, MAX_COMPLETION_LOGPROBS)


def parse_prompt_logprobs(body: dict[str, Any]) -> int | None:
    """vLLM's ``prompt_logprobs``: each prompt token's logprob with the k most likely."""
    if body.get("prompt_logprobs") is None:
        return None
    return _integer(body, "prompt_logprobs", 0, 0, MAX_TOP_LOGPROBS)


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """``logit_bias`` ids must be in the vocabulary (known only once a tokenizer is)."""
    for token, _ in params.logit_bias:
        if token >= vocab_size:
            raise BadRequest(f"logit_bias token id {int(token)} is not in [0, {vocab_size})",
                             param="logit_bias")
