"""What the Messages and Responses APIs cost over chat completions: the same requests.

    python -m bench apis [--concurrency 1,8] [--waves 24] [--max-tokens 64] [--json out.json]

One Headroom router on the demo model. Each prompt goes to every API as the same one-turn
conversation (so the same prompt ids reach the worker), streaming, greedy, exactly
--max-tokens tokens (ignore_eos), each request checked (HTTP 200, the API's closing event,
usage equal to max_tokens).

At each concurrency c the prompts come in waves of c: a wave goes to one API (all c at
once), then the same wave to the next, the order rotated per wave. A shared machine's speed
drifts by tens of percent within a minute; back to back, a wave's three runs see the same
machine, so each figure is a median over waves of a per-wave comparison with chat:
added TTFT = median TTFT of the wave on the API − on chat; tokens/s ratio = the wave's
tokens/s on the API ÷ on chat (1.0 = the translation costs nothing).
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
    sent = time.perf_counter()
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
                    res.output_chunk(now - sent)
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


Round = tuple[list[RequestResult], float]  # one wave's results and its wall seconds


async def rounds(url: str, waves: list[list[Prompt]], max_tokens: int) -> dict[str, list[Round]]:
    """Each wave of prompts to every API in turn (order rotated per wave), all of a wave at
    once; one keep-alive connection per stream slot and API, as a real client keeps."""
    out: dict[str, list[Round]] = {api.name: [] for api in APIS}
    width = max(len(w) for w in waves)
    async with contextlib.AsyncExitStack() as stack:
        sessions = {api.name: await stack.enter_async_context(
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=width))) for api in APIS}
        for i, wave in enumerate(waves):
            for api in APIS[i % 3:] + APIS[:i % 3]:
                started = time.perf_counter()
                results = await asyncio.gather(*(one_request(sessions[api.name], url, api, p, max_tokens)
                                                 for p in wave))
                out[api.name].append((list(results), time.perf_counter() - started))
    return out


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else float("nan")


def _ttft_s(results: list[RequestResult]) -> float | None:
    values = [r.ttft_s for r in results if r.ok and r.ttft_s is not None]
    return statistics.median(values) if values else None


def _tokens_per_s(results: list[RequestResult], wall_s: float) -> float:
    return sum(r.completion_tokens for r in results if r.ok) / wall_s


def summarize(runs: dict[str, list[Round]]) -> dict[str, Any]:
    """Per API: pooled figures, and per-wave differences to chat's (median over waves)."""
    out: dict[str, Any] = {}
    for name, waves in runs.items():
        results = [r for rs, _ in waves for r in rs]
        good = [r for r in results if r.ok]
        added, ratios = [], []
        for (rs, wall), (chat_rs, chat_wall) in zip(waves, runs["chat"]):
            ttft, chat_ttft = _ttft_s(rs), _ttft_s(chat_rs)
            if ttft is not None and chat_ttft is not None:
                added.append(ttft - chat_ttft)
            if _tokens_per_s(chat_rs, chat_wall) > 0:
                ratios.append(_tokens_per_s(rs, wall) / _tokens_per_s(chat_rs, chat_wall))
        out[name] = {
            "requests": len(results), "errors": len(results) - len(good),
            "ttft_p50_ms": _median_ms([r.ttft_s for r in good if r.ttft_s is not None]),
            "tokens_per_s": sum(r.completion_tokens for r in good) / sum(w for _, w in waves),
            "added_ttft_ms": _median_ms(added),
            "tokens_per_s_ratio": statistics.median(ratios) if ratios else float("nan"),
            "error_samples": sorted({r.error or "" for r in results if not r.ok})[:3]}
    return out


def _best_us(fn: Callable[[], object], number: int) -> float:
    """Mean CPU µs of fn over `number` calls, the best of 7 runs: this process's own CPU time,
    so other processes on a shared machine add little (and only ever add)."""
    best = float("inf")
    for _ in range(7):
        started = time.process_time()
        for _ in range(number):
            fn()
        best = min(best, (time.process_time() - started) / number)
    return best * 1e6


def router_cpu(folder: Path, max_tokens: int) -> dict[str, Any]:
    """The router's own work for one request on each API, timed in-process: parsing the body
    (translation included) and presenting max_tokens tokens, one event each, as the stream
    loop does. Prompt tokenizing and everything after the HTTP handler are the same for all
    three, so they are left out."""
    from router.chat.plan import plan_output
    from router.chat.tokenizer import RouterTokenizer
    from router.http.anthropic_api import MESSAGES
    from router.http.api import CHAT
    from router.http.output import Collector
    from router.http.responses_api import RESPONSES
    from router.http.rows import Rows
    from router.job import TokenEvent

    tok = RouterTokenizer.load(folder)
    text = make_prompts(tok.encode, "cpu", 1, PROMPT_TOKENS["short"])[0].text
    out_ids = (tok.encode("the router presents each token in the shape of its API ") * max_tokens)[:max_tokens]
    out: dict[str, Any] = {}
    for api, endpoint in zip(APIS, (CHAT, MESSAGES, RESPONSES)):
        body = api.body(text, max_tokens)

        def one_request() -> None:
            # as Api._run does it, less tokenizing the prompt (the same for every API)
            parsed = endpoint.parse(body, 512, 1)
            plan = plan_output(parsed, tok, "auto")
            rows = Rows(endpoint.id_prefix + "0", prompt_tokens=len(out_ids), plan=plan)
            present = endpoint.present(body, parsed, rows, "demo", tok)
            c = Collector(tok.make_detokenizer(plan.keep_markers), parsed.stop, len(out_ids), 0,
                          plan.parser(), inline_reasoning=not parsed.separate_reasoning)
            for i, token in enumerate(out_ids):
                c.feed(TokenEvent([token], "length" if i == len(out_ids) - 1 else None))
                present.delta(c)
            present.tail([c], len(out_ids))

        parse_us = _best_us(lambda: endpoint.parse(body, 512, 1), 2000)
        request_us = _best_us(one_request, 100)
        out[api.name] = {"parse_us": parse_us, "request_us": request_us,
                         "per_token_us": (request_us - parse_us) / max_tokens}
    for figures in out.values():
        figures["added_us_per_request"] = figures["request_us"] - out["chat"]["request_us"]
        figures["added_us_per_token"] = figures["per_token_us"] - out["chat"]["per_token_us"]
    return out


def measure(url: str, encode: Callable[[str], list[int]], args: Any) -> dict[str, Any]:
    short = PROMPT_TOKENS["short"]
    doc: dict[str, Any] = {"max_tokens": args.max_tokens, "prompt_tokens": short,
                           "waves": args.waves}
    asyncio.run(rounds(url, [make_prompts(encode, "warm", 4, short)], args.max_tokens))
    for c in args.concurrency:
        waves = [make_prompts(encode, f"c{c}w{i}", c, short) for i in range(args.waves)]
        doc[f"c{c}"] = summarize(asyncio.run(rounds(url, waves, args.max_tokens)))
    return doc


def render(doc: dict[str, Any]) -> str:
    lines = ["api        c requests errors  TTFT p50 ms  tokens/s  added TTFT ms  tok/s ÷ chat's"]
    for key, rows in doc.items():
        if key.startswith("c"):
            for name, f in rows.items():
                lines.append(f"{name:<9} {key[1:]:>2} {f['requests']:>8} {f['errors']:>6} "
                             f"{f['ttft_p50_ms']:>12.2f} {f['tokens_per_s']:>9.1f} "
                             f"{f['added_ttft_ms']:>14.2f} {f['tokens_per_s_ratio']:>15.3f}")
    if "router_cpu" in doc:
        lines.append("\nrouter CPU per request (in-process, best of 7): parse µs, whole request µs, "
                     "per token µs, added per request µs, added per token µs")
        for name, f in doc["router_cpu"].items():
            lines.append(f"{name:<9} {f['parse_us']:>8.1f} {f['request_us']:>10.1f} "
                         f"{f['per_token_us']:>8.2f} {f['added_us_per_request']:>10.1f} "
                         f"{f['added_us_per_token']:>8.2f}")
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("apis", __doc__)
    p.add_argument("--concurrency", type=_int_list, default=[1, 8])
    p.add_argument("--waves", type=int, default=24, help="waves of c requests per concurrency")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--startup-timeout", type=float, default=180.0)
    args = cli.parse(p, argv)
    from mlx_lm.utils import load_tokenizer

    from bench.runner import resolve_model
    from bench.systems import Headroom

    model_arg, folder, _ = resolve_model("demo")
    cpu = router_cpu(folder, args.max_tokens)
    router = Headroom(model_arg, Path(tempfile.mkdtemp(prefix="headroom-apis-")), ["--log-level", "warning"])
    router.start(args.startup_timeout)
    try:
        doc = measure(router.url, load_tokenizer(folder).encode, args)
    finally:
        router.stop()
    doc["router_cpu"] = cpu
    print(render(doc))
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=2))
    return 0
