"""What the Messages and Responses APIs cost over chat completions: the same requests.

    python -m bench apis [--concurrency 1,8] [--requests 32] [--repeats 3] [--paired 32]
                         [--max-tokens 64] [--json out.json]

One Headroom router on the demo model. Each prompt goes to every API as the same one-turn
conversation (so the same prompt ids reach the worker), streaming, greedy, exactly
--max-tokens tokens (ignore_eos), each request checked (HTTP 200, the API's closing event,
usage equal to max_tokens).

- Paired, c=1: each prompt to the three APIs back to back, order rotated per prompt, one
  keep-alive connection per API; added TTFT = median over prompts of (API − chat), so the
  machine's drift hits the three alike.
- Workloads, every c: the same prompts to each API in rotated order, --repeats times;
  tokens/s = all completion tokens ÷ the workload's wall time, pooled over repetitions;
  the figure is API ÷ chat for tokens/s and chat ÷ API for the median TTFT (1.0 = no cost).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench import cli
from bench.metrics import RequestResult
from bench.prompts import PROMPT_TOKENS, Prompt, make_prompts

Event = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Api:
    """How one API is asked, and where its stream carries text, usage and its end."""

    name: str
    path: str
    body: Callable[[str, int], dict[str, Any]]
    text: Callable[[Event], str | None]
    usage: Callable[[Event], int | None]
    ends: Callable[[Event], bool]


def _chat_text(e: Event) -> str | None:
    choices = e.get("choices") or [{}]
    return (choices[0].get("delta") or {}).get("content")


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


SAME = {"model": "bench", "temperature": 0, "stream": True, "ignore_eos": True}
APIS = (
    Api("chat", "/v1/chat/completions",
        lambda t, n: {**SAME, "messages": _user(t), "max_tokens": n,
                      "stream_options": {"include_usage": True}},
        _chat_text, lambda e: (e.get("usage") or {}).get("completion_tokens"),
        lambda e: False),  # ends with data: [DONE]
    Api("messages", "/v1/messages",
        lambda t, n: {**SAME, "messages": _user(t), "max_tokens": n},
        lambda e: (e.get("delta") or {}).get("text") if e.get("type") == "content_block_delta" else None,
        lambda e: e["usage"]["output_tokens"] if e.get("type") == "message_delta" else None,
        lambda e: e.get("type") == "message_stop"),
    Api("responses", "/v1/responses",
        lambda t, n: {**SAME, "input": t, "max_output_tokens": n, "store": False},
        lambda e: e.get("delta") if e.get("type") == "response.output_text.delta" else None,
        lambda e: e["response"]["usage"]["output_tokens"]
        if e.get("type") in ("response.completed", "response.incomplete") else None,
        lambda e: e.get("type") in ("response.completed", "response.incomplete")),
)


async def one_request(session: aiohttp.ClientSession, url: str, api: Api, prompt: Prompt,
                      max_tokens: int) -> RequestResult:
    res = RequestResult()
    sent = last = time.perf_counter()
    done = False
    try:
        async with session.post(url + api.path, json=api.body(prompt.text, max_tokens)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue  # event names, blank separators, keepalive comments
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                now, event = time.perf_counter(), json.loads(data)
                if "error" in event or event.get("type") == "error":
                    res.error = f"error event: {data[:200]!r}"
                    return res
                if api.text(event):
                    if res.ttft_s is None:
                        res.ttft_s = now - sent
                    else:
                        res.itls_s.append(now - last)
                    last = now
                    res.num_chunks += 1
                tokens = api.usage(event)
                res.completion_tokens = tokens if tokens is not None else res.completion_tokens
                if api.ends(event):
                    done = True
                    break
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
        return res
    res.latency_s = time.perf_counter() - sent
    if not done or res.completion_tokens != max_tokens or res.ttft_s is None:
        res.error = f"closed={done}, {res.completion_tokens} tokens of {max_tokens}, ttft {res.ttft_s}"
    res.ok = res.error is None
    return res


async def paired(url: str, prompts: list[Prompt], max_tokens: int) -> dict[str, list[RequestResult]]:
    """Each prompt to every API back to back (order rotated), one connection per API."""
    out: dict[str, list[RequestResult]] = {api.name: [] for api in APIS}
    async with contextlib.AsyncExitStack() as stack:
        sessions = {api.name: await stack.enter_async_context(
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))) for api in APIS}
        for i, prompt in enumerate(prompts):
            for api in APIS[i % 3:] + APIS[:i % 3]:
                out[api.name].append(await one_request(sessions[api.name], url, api, prompt, max_tokens))
    return out


async def workload(url: str, api: Api, prompts: list[Prompt], concurrency: int,
                   max_tokens: int) -> tuple[list[RequestResult], float]:
    """Every prompt once, `concurrency` at a time; (results, wall seconds)."""
    waiting = list(reversed(prompts))
    results: list[RequestResult] = []

    async def user(session: aiohttp.ClientSession) -> None:
        while waiting:
            results.append(await one_request(session, url, api, waiting.pop(), max_tokens))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        started = time.perf_counter()
        await asyncio.gather(*(user(session) for _ in range(concurrency)))
        return results, time.perf_counter() - started


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else float("nan")


def summarize_paired(results: dict[str, list[RequestResult]]) -> dict[str, Any]:
    chat = results["chat"]
    out: dict[str, Any] = {}
    for name, rs in results.items():
        pairs = [(r.ttft_s, c.ttft_s) for r, c in zip(rs, chat)
                 if r.ok and c.ok and r.ttft_s is not None and c.ttft_s is not None]
        out[name] = {"requests": len(rs), "errors": sum(not r.ok for r in rs),
                     "ttft_p50_ms": _median_ms([r.ttft_s for r in rs if r.ok and r.ttft_s]),
                     "added_ttft_ms": _median_ms([a - b for a, b in pairs])}
    return out


def summarize_workloads(runs: dict[str, list[tuple[list[RequestResult], float]]]) -> dict[str, Any]:
    """Per API: pooled TTFT median and tokens/s, and each as a ratio to chat's."""
    base: dict[str, Any] = {}
    for name, reps in runs.items():
        results = [r for rs, _ in reps for r in rs]
        good = [r for r in results if r.ok]
        tokens = sum(r.completion_tokens for r in good)
        base[name] = {"requests": len(results), "errors": len(results) - len(good),
                      "ttft_p50_ms": _median_ms([r.ttft_s for r in good if r.ttft_s is not None]),
                      "tokens_per_s": tokens / sum(wall for _, wall in reps)}
    chat = base["chat"]
    for figures in base.values():
        figures["ttft_ratio"] = chat["ttft_p50_ms"] / figures["ttft_p50_ms"]
        figures["tokens_per_s_ratio"] = figures["tokens_per_s"] / chat["tokens_per_s"]
    return base


def measure(url: str, encode: Callable[[str], list[int]], args: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"max_tokens": args.max_tokens, "prompt_tokens": PROMPT_TOKENS["short"]}
    asyncio.run(paired(url, make_prompts(encode, "warm", 6, PROMPT_TOKENS["short"]), args.max_tokens))
    if args.paired:
        prompts = make_prompts(encode, "p", args.paired, PROMPT_TOKENS["short"])
        doc["paired_c1"] = summarize_paired(asyncio.run(paired(url, prompts, args.max_tokens)))
    for c in args.concurrency:
        runs: dict[str, list[tuple[list[RequestResult], float]]] = {api.name: [] for api in APIS}
        for rep in range(args.repeats):
            prompts = make_prompts(encode, f"r{rep}c{c}", args.requests, PROMPT_TOKENS["short"])
            for api in APIS[rep % 3:] + APIS[:rep % 3]:
                runs[api.name].append(asyncio.run(workload(url, api, prompts, c, args.max_tokens)))
        doc[f"c{c}"] = summarize_workloads(runs)
    return doc


def render(doc: dict[str, Any]) -> str:
    lines = ["api        c  requests errors  TTFT p50 ms  tokens/s  TTFT chat/api  tok/s api/chat"]
    for key, rows in doc.items():
        if not key.startswith("c"):
            continue
        for name, f in rows.items():
            lines.append(f"{name:<9} {key[1:]:>2} {f['requests']:>9} {f['errors']:>6} "
                         f"{f['ttft_p50_ms']:>12.2f} {f['tokens_per_s']:>9.1f} "
                         f"{f['ttft_ratio']:>14.3f} {f['tokens_per_s_ratio']:>15.3f}")
    if "paired_c1" in doc:
        lines.append("\npaired c=1  requests errors  TTFT p50 ms  added TTFT vs chat ms")
        for name, f in doc["paired_c1"].items():
            lines.append(f"{name:<10} {f['requests']:>9} {f['errors']:>6} {f['ttft_p50_ms']:>12.2f} "
                         f"{f['added_ttft_ms']:>22.2f}")
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("apis", __doc__)
    p.add_argument("--concurrency", type=_int_list, default=[1, 8])
    p.add_argument("--requests", type=int, default=32, help="per workload repetition")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--paired", type=int, default=32, help="prompts in the paired c=1 run (0: skip)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--startup-timeout", type=float, default=180.0)
    args = cli.parse(p, argv)
    from mlx_lm.utils import load_tokenizer

    from bench.runner import resolve_model
    from bench.systems import Headroom

    model_arg, folder, _ = resolve_model("demo")
    router = Headroom(model_arg, Path(tempfile.mkdtemp(prefix="headroom-apis-")), ["--log-level", "warning"])
    router.start(args.startup_timeout)
    try:
        doc = measure(router.url, load_tokenizer(folder).encode, args)
    finally:
        router.stop()
    print(render(doc))
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=2))
    return 0
