"""Every sampling parameter, logprobs and n > 1 through the official openai client.

The demo model has random weights, so each test shows an effect by constraint: top_k 1
equals greedy, a +100 bias forces one token, a seeded row is the same alone or in a batch.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.conftest import Router, start_router

PROMPT = [40, 41, 42, 43, 44, 45, 46, 47]  # token ids: no tokenizer drift between runs
MESSAGES = [{"role": "user", "content": "Say something."}]
N_TOKENS = 16


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, cache_home: Path) -> Iterator[Router]:
    r = start_router(tmp_path_factory.mktemp("sampling"), cache_home, "--max-n", "4")
    yield r
    r.stop()


@pytest.fixture(scope="module")
def client(router: Router) -> Iterator[openai.OpenAI]:
    """One client (thread-safe) for the module, closed at its end."""
    with router.client() as c:
        yield c


def tokens(client: openai.OpenAI, **kw: Any) -> list[str]:
    """The generated tokens (as strings, from logprobs) of one completion."""
    body: dict[str, Any] = {"max_tokens": N_TOKENS, "ignore_eos": True, **kw.pop("extra", {})}
    r = client.completions.create(model="m", prompt=PROMPT, logprobs=0, extra_body=body, **kw)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None
    return lp.tokens


def test_top_k_1_is_greedy(client: openai.OpenAI) -> None:
    greedy = tokens(client, temperature=0)
    assert tokens(client, temperature=1.5, extra={"top_k": 1}, seed=1) == greedy
    assert tokens(client, temperature=1.5, extra={"min_p": 1.0}, seed=2) == greedy
    assert tokens(client, temperature=1.5, top_p=1e-6, seed=3) == greedy


def test_high_temperature_without_filters_is_not_greedy(client: openai.OpenAI) -> None:
    """The control for the test above: the same seeds do sample away from greedy."""
    greedy = tokens(client, temperature=0)
    assert any(tokens(client, temperature=1.5, seed=s) != greedy for s in (1, 2, 3))


def test_logit_bias_forces_one_token(client: openai.OpenAI) -> None:
    out = tokens(client, temperature=1.0, seed=5, extra={"logit_bias": {"300": 100}})
    first = tokens(client, temperature=0, extra={"logit_bias": {"300": 100}, "max_tokens": 1})
    assert len(out) == N_TOKENS and set(out) == set(first)


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 2.0},
                                     {"presence_penalty": 2.0},
                                     {"frequency_penalty": 2.0}])
def test_penalties_change_a_repetitive_greedy_output(client: openai.OpenAI,
                                                    penalty: dict[str, Any]) -> None:
    body = {"max_tokens": 48, "repetition_context_size": 48, "presence_context_size": 48,
            "frequency_context_size": 48}
    greedy = tokens(client, temperature=0, extra=body)
    assert len(set(greedy)) < len(greedy)  # the random model repeats itself
    penalised = tokens(client, temperature=0, extra={**body, **penalty})
    assert penalised != greedy
    assert len(set(penalised)) > len(set(greedy))


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
def test_presence_and_frequency_count_the_output_not_the_prompt(client: openai.OpenAI, penalty: str) -> None:
    """OpenAI's definition: a token is penalised for each time it was sampled. Nothing has
    been sampled before the first token, so its distribution is the unpenalised one (over
    the prompt, a chat's own end-of-turn token was pushed down)."""
    def first(**extra: Any) -> tuple[float, dict[str, float]]:
        r = client.completions.create(model="m", prompt=PROMPT * 3, max_tokens=1, temperature=0,
                                      logprobs=5, extra_body=extra)
        lp = r.choices[0].logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        return lp.token_logprobs[0], lp.top_logprobs[0]

    assert first(**{penalty: 2.0, f"{penalty.split('_')[0]}_context_size": 256}) == first()


def test_seed_is_the_same_alone_and_in_a_busy_batch(client: openai.OpenAI) -> None:
    big = 2**64 - 5  # the whole 64-bit range is a seed
    alone = tokens(client, temperature=1.0, seed=big)
    other = tokens(client, temperature=1.0, seed=big - 1)
    assert other != alone

    def busy(i: int) -> list[str]:
        return tokens(client, temperature=1.0, extra={"max_tokens": 24, "top_k": 5 + i,
                                                      "presence_penalty": 0.5})

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        noise = [pool.submit(busy, i) for i in range(5)]
        again = pool.submit(tokens, client, temperature=1.0, seed=big)
        assert again.result(timeout=120) == alone
        for f in noise:
            f.result(timeout=120)


def test_a_seeded_prompt_answers_the_same_wherever_it_is_in_a_list(client: openai.OpenAI) -> None:
    body = {"max_tokens": 6, "ignore_eos": True}
    alone = client.completions.create(model="m", prompt="Bravo", temperature=1.0, seed=42, n=2,
                                      extra_body=body)
    listed = client.completions.create(model="m", prompt=["Alpha", "Bravo", "Bravo"], temperature=1.0,
                                       seed=42, n=2, extra_body=body)
    texts = [c.text for c in sorted(listed.choices, key=lambda c: c.index)]
    mine = [c.text for c in sorted(alone.choices, key=lambda c: c.index)]
    assert texts[2:4] == texts[4:6] == mine and mine[0] != mine[1]


def test_seed_out_of_range_is_a_400(router: Router) -> None:
    r = router.http.post("/v1/completions", json={"prompt": "x", "seed": 2**64})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"


@pytest.mark.parametrize(("field", "value"), [("top_k", -5), ("min_p", 2), ("presence_penalty", 3),
                                              ("repetition_penalty", 0), ("logit_bias", {"512": 1}),
                                              ("top_logprobs", 21)])
def test_bad_values_are_a_400_naming_the_parameter(router: Router, field: str, value: Any) -> None:
    body = {"messages": MESSAGES, field: value, "logprobs": True}
    r = router.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field


# -- logprobs ------------------------------------------------------------------------


def token_bytes(token: str) -> bytes:
    """Undo the ``bytes:\\xe2`` spelling of a token that is a piece of a character."""
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token[len("bytes:"):].split("\\x")[1:])
    return token.encode()


def check_chat_entries(content: list[Any], k: int) -> None:
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == k
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        if k:  # at temperature 0 the sampled token is the most likely one
            assert entry.top_logprobs[0].token == entry.token
            assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert bytes(entry.bytes) == token_bytes(entry.token)


@pytest.mark.parametrize("k", [0, 5, 20])
def test_chat_logprobs_streamed_and_not(client: openai.OpenAI, k: int) -> None:
    kw: dict[str, Any] = dict(model="m", messages=MESSAGES, max_tokens=N_TOKENS, temperature=0,
                              logprobs=True, top_logprobs=k, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    lp = whole.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == N_TOKENS
    check_chat_entries(lp.content, k)
    raw = b"".join(bytes(e.bytes) for e in lp.content)
    assert raw.decode(errors="replace") == whole.choices[0].message.content
    streamed: list[Any] = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                streamed.extend(choice.logprobs.content)
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in lp.content]


def test_chat_without_logprobs_has_none(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert r.choices[0].logprobs is None


@pytest.mark.parametrize("k", [0, 3])
def test_completion_logprobs_streamed_and_not(client: openai.OpenAI, k: int) -> None:
    kw: dict[str, Any] = dict(model="m", prompt=PROMPT, max_tokens=N_TOKENS, temperature=0,
                              logprobs=k, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    lp = whole.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == N_TOKENS
    assert b"".join(map(token_bytes, lp.tokens)).decode(errors="replace") == whole.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0
        assert token in top and top[token] == pytest.approx(logprob)
        assert len(top) <= k + 1 and max(top.values()) == pytest.approx(logprob)
    streamed: list[str] = []
    for chunk in client.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.tokens:
                streamed.extend(choice.logprobs.tokens)
    assert streamed == lp.tokens


# -- n and several prompts -----------------------------------------------------------


def test_chat_n_3(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="m", messages=MESSAGES, n=3, max_tokens=8,
                                                seed=11, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage is not None and r.usage.completion_tokens == 24
    assert len({c.message.content for c in r.choices}) > 1  # each choice its own seed


def test_chat_n_3_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="m", messages=MESSAGES, n=3, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert len(set(texts.values())) == 1  # greedy: three equal answers
    assert usage is not None and usage.completion_tokens == 24


def test_n_above_the_limit_is_a_400(router: Router) -> None:
    r = router.http.post("/v1/chat/completions", json={"messages": MESSAGES, "n": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_two_prompts_two_choices(client: openai.OpenAI) -> None:
    prompts = ["Once upon a time", "def add(a, b):"]
    r = client.completions.create(model="m", prompt=prompts, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    for choice, prompt in zip(r.choices, prompts):
        alone = client.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert choice.text == alone.choices[0].text
    assert r.usage is not None and r.usage.completion_tokens == 12
