"""The official openai client against a real router + worker on the demo model."""

from __future__ import annotations

import concurrent.futures
import re

import openai
import pytest

from tests.conftest import wait_until
from tests.integration.conftest import Router

PROMPT = "The quick brown fox jumps over the lazy dog. Tell me a story about it."


def test_completion_non_streaming(router: Router) -> None:
    r = router.client().completions.create(model="anything", prompt=PROMPT, max_tokens=12,
                                           temperature=0)
    assert r.model == "demo"
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert isinstance(r.choices[0].text, str) and r.choices[0].text


def test_chat_non_streaming(router: Router) -> None:
    r = router.client().chat.completions.create(
        model="gpt-4o", messages=[{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Hello!"}],
        max_completion_tokens=9, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 9


def test_streaming_equals_non_streaming(router: Router) -> None:
    client = router.client()
    messages = [{"role": "user", "content": "Count with me: café, naïve, 日本語 😀"}]
    whole = client.chat.completions.create(model="m", messages=messages, max_tokens=24,
                                           temperature=0)
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=24,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    parts, finish, usage, roles = [], None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            if choice.delta.content:
                parts.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason
    assert "".join(parts) == whole.choices[0].message.content
    assert roles == ["assistant"]
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 24
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_completion_streaming(router: Router) -> None:
    client = router.client()
    whole = client.completions.create(model="m", prompt=PROMPT, max_tokens=16, temperature=0)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="m", prompt=PROMPT, max_tokens=16, temperature=0, stream=True) if c.choices)
    assert text == whole.choices[0].text


def test_a_streamed_requests_log_line_says_where_its_first_token_time_went(router: Router) -> None:
    # The worker's share is ttft; the router's own is before the queue and after the token.
    stream = router.client().with_options(max_retries=0).completions.with_raw_response.create(
        model="m", prompt=PROMPT, max_tokens=4, temperature=0, stream=True)
    request_id = stream.headers["x-request-id"]
    assert [c for c in stream.parse()]
    pattern = re.compile(rf"\[{re.escape(request_id)}\] finished: .*, ttft [0-9.]+s, total [0-9.]+s "
                         r"\(HTTP before the queue [0-9.]+ms, first token to first byte [0-9.]+ms\)")
    wait_until(lambda: pattern.search(router.log()), 10, "the finished line", on_fail=router.log)


def test_stop_string_ends_the_output(router: Router) -> None:
    client = router.client()
    full = client.completions.create(model="m", prompt=PROMPT, max_tokens=40, temperature=0)
    text = full.choices[0].text
    # A stop string taken from the middle of the greedy output must cut it there.
    candidates = [text[i:i + 3] for i in range(4, len(text) - 3)
                  if "\ufffd" not in text[i:i + 3] and text[i:i + 3].strip()]
    assert candidates, f"greedy output too short to pick a stop string: {text!r}"
    stop = candidates[len(candidates) // 2]
    cut = client.completions.create(model="m", prompt=PROMPT, max_tokens=40, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="m", prompt=PROMPT, max_tokens=40, temperature=0, stop=stop, stream=True)
        if c.choices)
    assert streamed == text[: text.index(stop)]


def test_seed_is_reproducible_whatever_else_is_in_the_batch(router: Router) -> None:
    client = router.client()

    def seeded() -> str:
        return client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=0.9,
                                          top_p=0.95, seed=1234).choices[0].text

    alone = seeded()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        others = [pool.submit(client.completions.create, model="m", prompt=f"{i} other prompt " * (i + 1),
                              max_tokens=30, temperature=1.0) for i in range(5)]
        together = pool.submit(seeded)
        assert together.result() == alone
        for f in others:
            f.result()
    different_seed = client.completions.create(model="m", prompt=PROMPT, max_tokens=24,
                                               temperature=0.9, top_p=0.95, seed=99).choices[0].text
    assert different_seed != alone


def test_concurrent_requests_all_complete(router: Router) -> None:
    client = router.client()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(client.completions.create, model="m", prompt=f"request {i}: " + PROMPT,
                               max_tokens=8 + i, temperature=0) for i in range(12)]
        results = [f.result() for f in futures]
    assert [r.usage.completion_tokens for r in results] == [8 + i for i in range(12)]


def test_models_lists_the_served_model(router: Router) -> None:
    models = router.client().models.list()
    assert [m.id for m in models.data] == ["demo"]


def test_openai_client_raises_on_bad_request(router: Router) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        router.client().completions.create(model="m", prompt="hi", max_tokens=5000)
    assert info.value.code == "context_length_exceeded"
