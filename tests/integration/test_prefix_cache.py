"""The prefix cache end to end: reuse across turns, the same tokens as a cold run, cached
prompts given back before any request waits for memory, and a worker that is warm again
from the disk tier after a SIGKILL (real processes, demo model).

The reuse tests' cached runs use the session's router; every cold run goes to a router
started with ``--no-prompt-cache`` (a router with a cache cannot give a cold run of a
conversation it has seen: every later turn would hit). The memory and restart tests share
a router under a tight ``--memory-limit-mb`` with the OOM guard armed (a step above the
limit aborts the worker as Metal would), in file order: the SIGKILL comes last. Every
router's disk tier is in its own run folder (tests/integration/conftest.py), never the
user's cache.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import wait_until
from tests.integration.conftest import Router

# The name comes first, so two tests' prompts share only the template's few leading tokens
# (under the 16 worth reusing): no test's cache entries can serve another's.
SYSTEM = ("{name} is the project. You are its build assistant: answer in one short sentence, "
          "cite the file you used, never invent flags, and keep the tone plain. ") * 2
USERS = ["Which flag sets the memory limit?", "And the cache size?", "Does it survive a restart?",
         "What does the page show?", "How do I turn it off?"]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 8}
SEEDED: dict[str, Any] = {"temperature": 0.9, "top_p": 0.95, "seed": 7, "max_tokens": 8}
TIGHT = ["--memory-limit-mb", "120", "--oom-guard", "abort"]
TIMEOUT_S = 120.0
RESTART_TIMEOUT_S = 90.0


@pytest.fixture(scope="module")
def routers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
            cache_home: Any) -> Iterator[dict[str, Router]]:
    """Started together, and with the session's router if it is not up yet: their model
    loads and warm starts overlap."""
    started = {"cold": Router(tmp_path_factory.mktemp("cold"), cache_home, "--no-prompt-cache"),
               "tight": Router(tmp_path_factory.mktemp("tight"), cache_home, *TIGHT)}
    try:
        request.getfixturevalue("router")
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


def side_by_side(hit: Router, cold: Router, messages: list[dict[str, str]],
                 **params: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same chat on the cached and the cold router at once (two processes, two cores)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(chat, r, messages, **params) for r in (hit, cold)]
        first, second = (f.result(timeout=TIMEOUT_S) for f in futures)
    return first, second


def cached(answer: dict[str, Any]) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def text(answer: dict[str, Any]) -> str:
    return answer["choices"][0]["message"]["content"]


def cache_report(router: Router) -> dict[str, Any]:
    return router.memory()["workers"][0]["prompt_cache"]


def test_the_second_turn_reuses_the_shared_prefix_and_answers_as_a_cold_run(
        routers: dict[str, Router], router: Router) -> None:
    turn1 = [{"role": "system", "content": SYSTEM.format(name="Alpha")}, {"role": "user", "content": USERS[0]}]
    first = chat(router, turn1, **GREEDY)
    assert cached(first) == 0
    turn2 = turn1 + [{"role": "assistant", "content": text(first)}, {"role": "user", "content": USERS[1]}]
    for params in (GREEDY, SEEDED):
        hit, cold = side_by_side(router, routers["cold"], turn2, **params)
        # The whole first prompt is a prefix of the second (and its answer's KV was kept).
        assert cached(hit) >= first["usage"]["prompt_tokens"]
        assert cached(hit) < hit["usage"]["prompt_tokens"] == cold["usage"]["prompt_tokens"]
        assert cached(cold) == 0
        assert text(hit) == text(cold), params


def test_a_five_turn_conversation_hits_every_turn_with_cold_outputs(
        routers: dict[str, Router], router: Router) -> None:
    messages = [{"role": "system", "content": SYSTEM.format(name="Beta")}]
    previous_prompt = 0
    for n, question in enumerate(USERS):
        messages.append({"role": "user", "content": question})
        hit, cold = side_by_side(router, routers["cold"], messages, **GREEDY)
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
    # Counted per worker and tier in /v1/memory and /metrics; nothing in the cold router's.
    report = cache_report(router)
    assert report["enabled"] and report["hits"] >= 7 and report["cached_tokens"] > 0
    assert report["tiers"]["ram"]["bytes"] == report["ram_bytes"] > 0
    answered = time.time()
    disk = wait_until(lambda: _written(router, answered), TIMEOUT_S, "conversation ends written to disk")
    assert disk["entries"] > 0 and disk["bytes"] > 0 and disk["corrupt"] == 0
    assert {"hits", "misses", "evictions", "dropped"} <= disk.keys()
    metrics = router.http.get("/metrics").text
    assert metric(metrics, 'headroom_prompt_cache_hits_total{tier="ram"}') >= 7
    assert metric(metrics, 'headroom_prompt_cache_bytes{tier="ram"}') > 0
    assert metric(metrics, 'headroom_prompt_cache_bytes{tier="disk"}') > 0
    assert metric(metrics, 'headroom_prompt_cache_writes_total{tier="disk"}') >= 1
    assert routers["cold"].memory()["workers"][0]["prompt_cache"] == {"enabled": False}


def test_chats_sharing_a_long_system_prompt_hold_its_blocks_once_and_answer_as_cold_runs(
        routers: dict[str, Router], router: Router) -> None:
    system = SYSTEM.format(name="Epsilon") * 3  # several 256-token blocks, its end inside one
    before = cache_report(router)
    chats = []
    for n, question in enumerate(USERS[:3]):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        if n == 0:  # the first is cold on both
            chats.append(chat(router, messages, **GREEDY))
            continue
        hit, cold = side_by_side(router, routers["cold"], messages, **GREEDY)
        assert text(hit) == text(cold), question
        chats.append(hit)
    first = chats[0]["usage"]["prompt_tokens"]
    for later in chats[1:]:  # the system prompt's blocks, and the block it ends in up to its end
        assert 2 * 256 < first - 64 <= cached(later) < later["usage"]["prompt_tokens"]
    after = cache_report(router)
    assert after["blocks"]["shared"] >= before["blocks"]["shared"] + 2
    # Three copies of the system prompt without sharing; with it, one and each chat's own
    # tokens (and at most the one block each one diverges in).
    kv = router.memory()["workers"][0]["kv_bytes_per_token"]
    one_chat = (first + GREEDY["max_tokens"]) * kv
    assert after["ram_bytes"] - before["ram_bytes"] <= 2 * one_chat
    metrics = router.http.get("/metrics").text
    assert metric(metrics, "headroom_prompt_cache_shared_blocks") >= 2
    assert metric(metrics, 'headroom_prompt_cache_blocks{tier="ram"}') >= 4


def _written(router: Router, since: float) -> dict[str, Any] | None:
    """The disk tier's stats once a report made after ``since`` (a response received: its
    entries were queued before it was sent) shows nothing left in the writer's queue."""
    report = router.memory()["workers"][0]
    disk = report["prompt_cache"]["tiers"]["disk"]
    return disk if report["reported_at"] > since and disk["pending"] == 0 else None


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def memory_evictions(router: Router) -> float:
    text = router.http.get("/metrics").text
    return sum(metric(text, f'headroom_prompt_cache_evictions_total{{reason="{r}",tier="ram"}}')
               for r in ("admission", "chunk", "pressure"))


def test_cached_prompts_are_given_back_before_a_request_would_wait(routers: dict[str, Router]) -> None:
    router = routers["tight"]
    pid = router.worker()["pid"]
    report = router.memory()["workers"][0]
    assert report["prompt_cache"]["max_bytes"] == report["budget_bytes"] // 2  # the default share
    evicted = memory_evictions(router)
    # Fill the cache with conversations that nothing else will ask for again (each also
    # queued for the disk writer: the queue's bytes are held in the ledger, never freed twice).
    for i in range(3):
        chat(router, [{"role": "system", "content": SYSTEM.format(name=f"Fill{i}")},
                      {"role": "user", "content": USERS[i]}], temperature=0, max_tokens=2)
    # The writer writes while the engine is idle: once it has, the entries can be given back
    # (queued ones cannot: they are held until written, and the gate then hurries the writer).
    since = time.time()
    wait_until(lambda: _written(router, since), TIMEOUT_S, "the disk writer's queue drained")
    filled = router.memory()["workers"][0]["prompt_cache"]
    assert filled["ram_bytes"] > filled["max_bytes"] // 2
    assert memory_evictions(router) == evicted
    # Requests that together need the memory the cache holds: every one is served.
    # Each as long as three quarters of what an idle worker can hold: with the cache
    # holding over half the budget, none can run unless cached prompts are given back
    # (fixed sizes needed no eviction on a machine whose calibration left more room).
    longest = int(router.memory()["workers"][0]["max_request_tokens"]) * 3 // 4 - 24
    bodies = [{"prompt": [40 + i] * longest, "max_tokens": 24, "ignore_eos": True, "temperature": 0}
              for i in range(2)]
    with httpx.Client(base_url=router.url, timeout=TIMEOUT_S) as http, \
            concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        responses = [f.result(timeout=TIMEOUT_S)
                     for f in [pool.submit(http.post, "/v1/completions", json=b) for b in bodies]]
    assert [r.status_code for r in responses] == [200] * len(bodies), [r.text for r in responses]
    assert all(r.json()["usage"]["completion_tokens"] == 24 for r in responses)
    assert memory_evictions(router) > evicted, "cached prompts were given back for the requests"
    final = router.memory()["workers"][0]
    assert final["peak_bytes"] <= final["limit_bytes"]
    assert router.worker()["pid"] == pid and router.worker()["restarts"] == 0


def test_after_a_sigkill_the_next_turn_is_warm_from_disk_and_a_corrupt_file_is_served_cold(
        routers: dict[str, Router]) -> None:
    router, cold = routers["tight"], routers["cold"]
    talks = {name: [{"role": "system", "content": SYSTEM.format(name=name)},
                    {"role": "user", "content": USERS[0]}] for name in ("Gamma", "Delta")}
    for messages in talks.values():  # Delta last: its conversation's state is the newest file
        messages += [{"role": "assistant", "content": text(chat(router, messages, **GREEDY))},
                     {"role": "user", "content": USERS[1]}]
    answered = time.time()
    wait_until(lambda: _written(router, answered), TIMEOUT_S, "both conversations written to disk")
    old = router.worker()["pid"]
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: (w := router.worker()).get("state") == "ready" and w.get("pid") != old,
               RESTART_TIMEOUT_S, "the worker restarted and ready", on_fail=router.log)
    files = sorted((router.run_dir / "prompt-cache").rglob("*.safetensors"), key=lambda p: p.stat().st_mtime_ns)
    flip_middle_byte(files[-1])
    # Delta's newest state cannot be trusted: removed, counted, and the turn is served cold.
    delta, delta_cold = side_by_side(router, cold, talks["Delta"], **GREEDY)
    assert cached(delta) == 0 and text(delta) == text(delta_cold)
    assert cache_report(router)["tiers"]["disk"]["corrupt"] == 1
    assert not files[-1].exists()
    # Gamma's is read back (charged to the gate first): the restarted worker is warm.
    gamma, gamma_cold = side_by_side(router, cold, talks["Gamma"], **GREEDY)
    assert cached(gamma) > gamma["usage"]["prompt_tokens"] // 2 and cached(gamma_cold) == 0
    assert text(gamma) == text(gamma_cold)
    report = cache_report(router)
    assert report["hits_by_kind"].get("disk") == 1 and report["tiers"]["disk"]["hits"] == 1
    metrics = router.http.get("/metrics").text
    assert metric(metrics, 'headroom_prompt_cache_hits_total{tier="disk"}') == 1
    assert metric(metrics, 'headroom_prompt_cache_corrupt_total{tier="disk"}') == 1
    assert router.worker()["restarts"] == 1


def flip_middle_byte(path: Path) -> None:
    """Damage the tensor data (the header stays readable: only the checksum can tell)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
