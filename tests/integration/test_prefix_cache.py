"""The prefix cache end to end: reuse across turns, the same tokens as a cold run, and
cached prompts given back before any request waits for memory (real processes, demo model).

The cached runs use the session's router; the cold runs a router started with
``--no-prompt-cache``; the memory test a router under a tight ``--memory-limit-mb`` with the
OOM guard armed, where a step above the limit aborts the worker as Metal would.
"""

from __future__ import annotations

import concurrent.futures
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.integration.conftest import Router

# Each test's system prompt is its own, so no other test's cache entries can serve it.
SYSTEM = ("You are the build assistant of project {name}. Answer in one short sentence, cite "
          "the file you used, never invent flags, and keep the tone plain. ") * 2
USERS = ["Which flag sets the memory limit?", "And the prompt cache size?", "Does it survive a restart?",
         "What does the status page show?", "How do I turn it off?"]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 8}
SEEDED: dict[str, Any] = {"temperature": 0.9, "top_p": 0.95, "seed": 7, "max_tokens": 8}
TIGHT = ["--memory-limit-mb", "200", "--oom-guard", "abort"]
TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def routers(tmp_path_factory: pytest.TempPathFactory, cache_home: Any) -> Iterator[dict[str, Router]]:
    """Started together: their model loads and warm starts overlap."""
    started = {"cold": Router(tmp_path_factory.mktemp("cold"), cache_home, "--no-prompt-cache"),
               "tight": Router(tmp_path_factory.mktemp("tight"), cache_home, *TIGHT)}
    try:
        for r in started.values():
            r.wait_ready()
        yield started
    finally:
        for r in started.values():
            r.stop()


def chat(router: Router, messages: list[dict[str, str]], **params: Any) -> dict[str, Any]:
    resp = router.http.post("/v1/chat/completions", json={"model": "m", "messages": messages, **params},
                            timeout=TIMEOUT_S)
    assert resp.status_code == 200, resp.text
    return resp.json()


def cached(answer: dict[str, Any]) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def text(answer: dict[str, Any]) -> str:
    return answer["choices"][0]["message"]["content"]


def test_the_second_turn_reuses_the_shared_prefix_and_answers_as_a_cold_run(
        router: Router, routers: dict[str, Router]) -> None:
    turn1 = [{"role": "system", "content": SYSTEM.format(name="alpha")}, {"role": "user", "content": USERS[0]}]
    first = chat(router, turn1, **GREEDY)
    assert cached(first) == 0
    turn2 = turn1 + [{"role": "assistant", "content": text(first)}, {"role": "user", "content": USERS[1]}]
    for params in (GREEDY, SEEDED):
        hit, cold = chat(router, turn2, **params), chat(routers["cold"], turn2, **params)
        # The whole first prompt is a prefix of the second (and its answer's KV was kept).
        assert cached(hit) >= first["usage"]["prompt_tokens"]
        assert cached(hit) < hit["usage"]["prompt_tokens"] == cold["usage"]["prompt_tokens"]
        assert cached(cold) == 0
        assert text(hit) == text(cold), params


def test_a_five_turn_conversation_hits_every_turn_with_cold_outputs(
        router: Router, routers: dict[str, Router]) -> None:
    messages = [{"role": "system", "content": SYSTEM.format(name="beta")}]
    previous_prompt = 0
    for n, question in enumerate(USERS):
        messages.append({"role": "user", "content": question})
        hit, cold = chat(router, messages, **GREEDY), chat(routers["cold"], messages, **GREEDY)
        assert text(hit) == text(cold), f"turn {n + 1}"
        assert cached(hit) >= previous_prompt and (n == 0 or cached(hit) > 0), f"turn {n + 1}"
        previous_prompt = hit["usage"]["prompt_tokens"]
        messages.append({"role": "assistant", "content": text(hit)})
    # A new chat with the same system prompt reuses at least the system message.
    other = chat(router, messages[:1] + [{"role": "user", "content": "Something else entirely?"}], **GREEDY)
    assert cached(other) > 0.8 * len(SYSTEM) / 4, "the system prompt's KV"
    # The other APIs say it their way: Anthropic apart from input_tokens, Responses in details.
    follow_up = messages[1:] + [{"role": "user", "content": "Thanks. Anything else?"}]
    body = {"model": "m", "max_tokens": 8, "temperature": 0, "system": messages[0]["content"],
            "messages": follow_up}
    message = router.http.post("/v1/messages", json=body).json()
    assert message["usage"]["cache_read_input_tokens"] >= previous_prompt
    count = router.http.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
    assert message["usage"]["input_tokens"] + message["usage"]["cache_read_input_tokens"] == count
    response = router.http.post("/v1/responses", json={
        "model": "m", "max_output_tokens": 8, "temperature": 0, "instructions": messages[0]["content"],
        "input": follow_up}).json()
    assert response["usage"]["input_tokens_details"]["cached_tokens"] >= previous_prompt
    # Counted per worker in /v1/memory and /metrics; nothing in the cold router's.
    report = router.memory()["workers"][0]["prompt_cache"]
    assert report["enabled"] and report["hits"] >= 7 and report["cached_tokens"] > 0
    assert report["tiers"]["ram"]["bytes"] == report["ram_bytes"] > 0 and "disk" in report["tiers"]
    metrics = router.http.get("/metrics").text
    assert metric(metrics, "headroom_prompt_cache_hits_total") >= 7
    assert metric(metrics, 'headroom_prompt_cache_bytes{tier="ram"}') > 0
    assert routers["cold"].memory()["workers"][0]["prompt_cache"] == {"enabled": False}


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def memory_evictions(router: Router) -> float:
    text = router.http.get("/metrics").text
    return sum(metric(text, f'headroom_prompt_cache_evictions_total{{reason="{r}"}}')
               for r in ("admission", "chunk", "pressure"))


def test_cached_prompts_are_given_back_before_a_request_would_wait(routers: dict[str, Router]) -> None:
    router = routers["tight"]
    pid = router.worker()["pid"]
    report = router.memory()["workers"][0]
    assert report["prompt_cache"]["max_bytes"] == report["budget_bytes"] // 2  # the default share
    # Fill the cache with conversations that nothing else will ask for again.
    for i in range(3):
        chat(router, [{"role": "system", "content": SYSTEM.format(name=f"fill-{i}") * 2},
                      {"role": "user", "content": USERS[i]}], temperature=0, max_tokens=2)
    filled = router.memory()["workers"][0]["prompt_cache"]
    assert filled["ram_bytes"] > filled["max_bytes"] // 2
    assert memory_evictions(router) == 0
    # Requests that together need the memory the cache holds: every one is served.
    bodies = [{"prompt": [40 + i] * 300, "max_tokens": 24, "ignore_eos": True, "temperature": 0}
              for i in range(4)]
    with httpx.Client(base_url=router.url, timeout=TIMEOUT_S) as http, \
            concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        responses = [f.result(timeout=TIMEOUT_S)
                     for f in [pool.submit(http.post, "/v1/completions", json=b) for b in bodies]]
    assert [r.status_code for r in responses] == [200] * len(bodies), [r.text for r in responses]
    assert all(r.json()["usage"]["completion_tokens"] == 24 for r in responses)
    assert memory_evictions(router) > 0, "cached prompts were given back for the requests"
    final = router.memory()["workers"][0]
    assert final["peak_bytes"] <= final["limit_bytes"]
    assert router.worker()["pid"] == pid and router.worker()["restarts"] == 0
