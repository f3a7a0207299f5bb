"""The load generator: streaming OpenAI /v1/completions requests at a fixed concurrency.

Closed loop: `concurrency` tasks each send a request, read its SSE stream to the end and
send the next, until every prompt has been sent once. aiohttp (not httpx) because this
client shares two CPU cores with the server under test, and aiohttp's line reader is the
cheaper of the two per chunk. Each request is checked: HTTP 200, no error event, a
`[DONE]`, finish_reason "length" and exactly max_tokens completion tokens by `usage`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import aiohttp

from bench.metrics import MixedRun, RequestResult, RunResult
from bench.prompts import Prompt

log = logging.getLogger(__name__)


async def _read_stream(resp: aiohttp.ClientResponse, res: RequestResult, sent: float) -> tuple[bool, str | None]:
    """Consume SSE lines; returns (saw [DONE], last finish_reason). Fills res in place."""
    finish: str | None = None
    is_error_event = False
    async for raw in resp.content:
        line = raw.strip()
        if not line or line.startswith(b":"):
            continue  # blank separator or keepalive comment
        if line.startswith(b"event:"):
            is_error_event = line[6:].strip() == b"error"
            continue
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return True, finish
        now = time.perf_counter()
        obj = json.loads(data)
        if is_error_event or "error" in obj:
            res.error = f"error event: {json.dumps(obj.get('error', obj))[:200]}"
            return False, finish
        if obj.get("usage"):
            res.completion_tokens = int(obj["usage"].get("completion_tokens", 0))
        for choice in obj.get("choices") or ():
            text = choice.get("text")
            if text is None:
                text = (choice.get("delta") or {}).get("content")
            if text:
                res.output_chunk(now - sent)
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
    return False, finish


async def one_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                      max_tokens: int) -> RequestResult:
    res = RequestResult()
    sent = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            done, finish = await _read_stream(resp, res, sent)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
        return res
    res.latency_s = time.perf_counter() - sent
    if res.error is None:
        res.error = _check(done, finish, res, max_tokens)
    res.ok = res.error is None
    return res


def _check(done: bool, finish: str | None, res: RequestResult, max_tokens: int) -> str | None:
    """The fixed-output-length contract every measured request must meet."""
    if not done:
        return "stream ended without [DONE]"
    if res.completion_tokens == 0:
        return "no usage.completion_tokens in the stream"
    if res.completion_tokens != max_tokens or finish != "length":
        return (f"{res.completion_tokens} tokens, finish_reason {finish!r}; "
                f"expected exactly {max_tokens} and 'length' (an EOS that was not suppressed?)")
    if res.ttft_s is None:
        return "no chunk carried output text"
    return None


def request_body(prompt: Prompt, max_tokens: int, extra_body: dict[str, Any]) -> dict[str, Any]:
    """Greedy (temperature 0), no seed, fixed length, usage in the stream."""
    body: dict[str, Any] = {"model": "bench", "prompt": prompt.text, "max_tokens": max_tokens,
                            "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    body.update(extra_body)
    return body


async def run_mixed(base_url: str, system: str, long_prompt: Prompt, shorts: list[Prompt], *,
                    max_tokens: int, head_start_s: float, extra_body: dict[str, Any],
                    repetition: int, request_timeout_s: float) -> MixedRun:
    """Send the long prompt; head_start_s later send every short one at once."""
    url = base_url + "/v1/completions"
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    connector = aiohttp.TCPConnector(limit=len(shorts) + 1)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        long_task = asyncio.create_task(
            one_request(session, url, request_body(long_prompt, max_tokens, extra_body), max_tokens))
        await asyncio.sleep(head_start_s)
        short_results = await asyncio.gather(
            *(one_request(session, url, request_body(p, max_tokens, extra_body), max_tokens)
              for p in shorts))
        long_result = await long_task
    bad = [r.error for r in [long_result, *short_results] if not r.ok]
    if bad:
        log.warning("%s mixed rep %d: %d requests failed, e.g. %s", system, repetition, len(bad), bad[0])
    return MixedRun(system=system, repetition=repetition, long=long_result, shorts=list(short_results))


async def run_workload(base_url: str, system: str, prompts: list[Prompt], *, concurrency: int,
                       max_tokens: int, extra_body: dict[str, Any], repetition: int,
                       request_timeout_s: float) -> RunResult:
    """Send every prompt once, `concurrency` at a time; wall time covers first send to last end."""
    url = base_url + "/v1/completions"
    queue: asyncio.Queue[Prompt] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[RequestResult] = []

    async def user(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            results.append(await one_request(session, url, request_body(prompt, max_tokens, extra_body),
                                             max_tokens))

    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        started = time.perf_counter()
        await asyncio.gather(*(user(session) for _ in range(concurrency)))
        wall_s = time.perf_counter() - started
    bad = [r.error for r in results if not r.ok]
    if bad:
        log.warning("%s c=%d rep %d: %d of %d requests failed, e.g. %s", system, concurrency,
                    repetition, len(bad), len(results), bad[0])
    return RunResult(system=system, concurrency=concurrency, repetition=repetition,
                     wall_s=wall_s, requests=results)
