"""Scoring clients (lm-evaluation-harness's loglikelihood, perplexity scripts) against a real
router and worker on the demo model, under a tight memory limit with the OOM guard armed:
``echo``, the prompt's logprobs (legacy ``logprobs`` with echo, vLLM's ``prompt_logprobs``),
``max_tokens`` 0 and 1, lists of prompts, and admission by the same rules as any request."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from common.costmodel import CostModel, never_fits
from tests.integration.conftest import NO_EOS, Router, start_router
from tests.integration.test_memory_limit import WORKLOAD_TIMEOUT_S, Watcher

LIMIT = ["--memory-limit-mb", "200", "--oom-guard", "abort"]
TEXT = "The quick brown fox jumps over the lazy dog."
IDS = [70 + (i * 37) % 300 for i in range(40)]


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, cache_home: Path) -> Iterator[Router]:
    r = start_router(tmp_path_factory.mktemp("scoring"), cache_home, *LIMIT)
    yield r
    r.stop()


@pytest.fixture(scope="module")
def reference(cache_home: Path) -> Any:
    """Logprobs of a plain mlx-lm forward of the whole prompt at once, in this process."""
    import mlx.core as mx

    from worker.loader import load_model

    model = load_model("demo", {"XDG_CACHE_HOME": str(cache_home)}).model

    def logprobs(ids: list[int]) -> list[list[float]]:
        logits = model(mx.array(ids)[None])[0].astype(mx.float32)
        return (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).tolist()

    return logprobs


def test_echo_with_logprobs_covers_the_prompt_then_the_new_token(router: Router) -> None:
    r = router.client().completions.create(model="m", prompt=TEXT, echo=True, logprobs=2, max_tokens=1,
                                           temperature=0)
    choice = r.choices[0]
    assert r.usage is not None and r.usage.completion_tokens == 1
    n = r.usage.prompt_tokens
    assert choice.text.startswith(TEXT) and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert 1 <= len(top) <= 3 and top[token] == logprob  # the top two, and always the token
    # Each prompt token's offset is where it stands in the echoed text; the new token's is
    # the end of the prompt.
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(TEXT[at:].startswith(token) for at, token in zip(lp.text_offset[:n], lp.tokens[:n]))
    assert lp.text_offset[n] == len(TEXT)


def test_a_list_of_prompts_gives_one_choice_each_with_no_tokens(router: Router, cache_home: Path) -> None:
    from tokenizers import Tokenizer

    from worker.demo import demo_folder

    folder = demo_folder(cache_home / "mlx-headroom")
    decoded = Tokenizer.from_file(str(folder / "tokenizer.json")).decode(IDS)
    client = router.client()
    for logprobs in (None, 0):  # echo alone is answered by the router; with logprobs, scored
        r = client.completions.create(model="m", prompt=[TEXT, IDS], echo=True, max_tokens=0,
                                      **({"logprobs": logprobs} if logprobs is not None else {}))
        assert [c.index for c in r.choices] == [0, 1]
        assert r.choices[0].text == TEXT and r.choices[1].text == decoded  # ids are echoed decoded
        assert all(c.finish_reason == "length" for c in r.choices)
        assert r.usage is not None and r.usage.completion_tokens == 0
        if logprobs is None:
            assert all(c.logprobs is None for c in r.choices)
        else:
            assert len(r.choices[1].logprobs.token_logprobs) == len(IDS)
            assert sum(len(c.logprobs.tokens) for c in r.choices) == r.usage.prompt_tokens


def test_the_prompts_logprobs_equal_a_plain_forward_even_after_a_cache_hit(router: Router, reference: Any) -> None:
    client = router.client()
    # The same prompt first, plainly: its KV is now in the prompt cache, which the scoring
    # request must not take (every position it scores must be run).
    plain = client.completions.create(model="m", prompt=IDS, max_tokens=1, temperature=0)
    r = client.completions.create(model="m", prompt=IDS, echo=True, logprobs=1, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 3})
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    expected = reference(IDS)
    got = r.choices[0].logprobs.token_logprobs
    assert len(got) == len(IDS) + 1
    for i in range(1, len(IDS)):
        assert abs(got[i] - expected[i - 1][IDS[i]]) < 1e-3, i
    # vLLM's prompt_logprobs: the same numbers by token id, the top three with their ranks
    scores = (r.choices[0].model_extra or {})["prompt_logprobs"]
    assert scores[0] is None and len(scores) == len(IDS)
    for i, entry in enumerate(scores[1:], start=1):
        row = expected[i - 1]
        best = sorted(range(len(row)), key=row.__getitem__, reverse=True)[:3]
        ranked = {int(t): v["rank"] for t, v in entry.items()}
        assert {t for t, rank in ranked.items() if rank <= 3} == set(best)
        assert abs(entry[str(IDS[i])]["logprob"] - row[IDS[i]]) < 1e-3
        assert ranked[IDS[i]] == 1 + sum(v > row[IDS[i]] for v in row)
    # The token generated from the scored KV is the one the plain request generated.
    assert r.choices[0].text.endswith(plain.choices[0].text)


def test_lm_evaluation_harness_loglikelihood(router: Router, reference: Any) -> None:
    """local-completions' own payload (a batch of context + continuation token lists) and
    its own reading of the answer (``parse_logprobs``): the continuation's logprob sum and
    whether it is the greedy one, as a plain forward gives them."""
    after = reference(IDS[:12])[-1]
    greedy = max(range(len(after)), key=after.__getitem__)   # the model's own next token
    contexts = [IDS[:30], IDS[:12]]
    requests = [IDS[:30] + IDS[30:34], IDS[:12] + [greedy]]
    r = router.http.post("/v1/completions", json={
        "model": "m", "prompt": requests, "temperature": 0, "max_tokens": 1, "logprobs": 1,
        "seed": 1234, "echo": True})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    greedy_seen = []
    for choice, ids, context in zip(choices, requests, contexts):
        ctxlen = len(context)
        token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(lp == max(top.values()) for lp, top in zip(token_logprobs, tops))
        expected = reference(ids)
        wanted = [expected[i - 1][ids[i]] for i in range(ctxlen, len(ids))]
        assert len(token_logprobs) == len(wanted)
        assert abs(sum(token_logprobs) - sum(wanted)) < 1e-3
        assert is_greedy == all(expected[i - 1][ids[i]] == max(expected[i - 1]) for i in range(ctxlen, len(ids)))
        greedy_seen.append(is_greedy)
    assert greedy_seen[1], "the model's own next token reads as greedy: its logprob is its top value"


def test_a_streamed_echo_equals_the_whole_answer(router: Router) -> None:
    client = router.client()
    whole = client.completions.create(model="m", prompt=TEXT, echo=True, logprobs=1, max_tokens=3,
                                      temperature=0, extra_body=NO_EOS)
    chunks = [c for c in client.completions.create(model="m", prompt=TEXT, echo=True, logprobs=1, max_tokens=3,
                                                   temperature=0, extra_body=NO_EOS, stream=True) if c.choices]
    assert chunks[0].choices[0].text.startswith(TEXT)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == whole.choices[0].logprobs.token_logprobs


def test_chat_takes_prompt_logprobs(router: Router) -> None:
    r = router.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 1, "max_tokens": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    scores = body["prompt_logprobs"]
    assert len(scores) == body["usage"]["prompt_tokens"] and scores[0] is None
    assert all(1 <= len(entry) <= 2 for entry in scores[1:])


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 6}, "logprobs"),
])
def test_bad_scoring_requests_are_refused_by_name(router: Router, path: str, body: dict[str, Any],
                                                  param: str) -> None:
    r = router.http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_scoring_requests_are_admitted_by_the_same_rules_under_a_tight_limit(router: Router) -> None:
    pid = router.worker()["pid"]
    model = CostModel.from_dict(router.memory()["workers"][0]["cost_model"])
    assert model.vocab_size == 512
    # A prompt whose scores can never fit gets the usual 400 before any work, though the same
    # prompt without them would be admitted.
    long_prompt = [70] * 1500
    assert never_fits(model, 1500, 1, scoring=True) and not never_fits(model, 1500, 1)
    r = router.http.post("/v1/completions", json={"prompt": long_prompt, "echo": True, "logprobs": 1,
                                                  "max_tokens": 1})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "insufficient_memory" and error["needed_bytes"] > model.budget_bytes
    assert 0 < error["max_request_tokens"] < 1500
    # Scoring requests that do not all fit at once wait in the router's queue, and every one
    # is answered; the worker, whose guard aborts on a peak above the limit, never does.
    bodies = [{"prompt": [71 + i] * 400, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
              for i in range(4)]
    watcher = Watcher(router)
    watcher.start()
    try:
        with httpx.Client(base_url=router.url, timeout=WORKLOAD_TIMEOUT_S) as http, \
                concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            futures = [pool.submit(http.post, "/v1/completions", json=b) for b in bodies]
            responses = [f.result(timeout=WORKLOAD_TIMEOUT_S) for f in futures]
    finally:
        watcher.stop.set()
        watcher.join(10)
    assert [r.status_code for r in responses] == [200] * len(bodies), [r.text for r in responses]
    for r in responses:
        assert len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == 401
    assert watcher.max_queued >= 1, "scoring requests that do not fit now should wait in the router"
    final = router.memory()["workers"][0]
    assert final["peak_bytes"] <= final["limit_bytes"]
    assert router.worker()["pid"] == pid and router.worker()["restarts"] == 0
