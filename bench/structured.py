"""Throughput of the per-row features at c = 8, each ÷ plain sampling, in one run.

    python -m bench structured [--concurrency 8] [--requests 32] [--repeats 2] [--json out.json]

One router (``--model demo`` unless ``--model`` says otherwise) and four workloads,
interleaved per repeat so the machine's drift hits each alike: plain sampling, the three
penalties and a logit bias, ``logprobs`` with 5 top entries, and a ``json_schema``
response format (a grammar applied to every token). Every request asks for
``--max-tokens`` tokens; the JSON schema is one long string field, so its answers run to
the same length. Reported: completion tokens/s of each and its ratio to plain.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench import cli
from bench.faults import RouterUnderTest

log = logging.getLogger("bench.structured")

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 2000}},
          "required": ["text"], "additionalProperties": False}
WORKLOADS: dict[str, dict[str, Any]] = {
    "plain": {},
    "penalties": {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                  "logit_bias": {"40": 1.0}},
    "logprobs": {"logprobs": True, "top_logprobs": 5},
    "json_schema": {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "t", "schema": SCHEMA}}},
}


async def run(url: str, extra: dict[str, Any], concurrency: int, requests: int,
              max_tokens: int) -> float:
    """Completion tokens/s of one closed-loop workload."""
    body = {"messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": max_tokens, "temperature": 1.0, **extra}
    left, tokens = requests, 0
    async with httpx.AsyncClient(timeout=300) as client:
        async def worker() -> None:
            nonlocal left, tokens
            while left > 0:
                left -= 1
                r = await client.post(url + "/v1/chat/completions", json=body)
                r.raise_for_status()
                tokens += r.json()["usage"]["completion_tokens"]

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return tokens / (time.perf_counter() - started)


async def measure(ns: Any, router: RouterUnderTest) -> dict[str, list[float]]:
    async with httpx.AsyncClient() as client:
        await router.wait_ready(client, None, 180)
    rates: dict[str, list[float]] = {name: [] for name in WORKLOADS}
    await run(router.url, {}, ns.concurrency, ns.concurrency, 4)  # warm-up
    for rep in range(ns.repeats):
        for name, extra in WORKLOADS.items():
            rate = await run(router.url, extra, ns.concurrency, ns.requests, ns.max_tokens)
            rates[name].append(rate)
            log.info("repeat %d %s: %.1f tokens/s", rep, name, rate)
    return rates


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("structured", __doc__)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model", default="demo")
    ns = cli.parse(p, argv)
    with tempfile.TemporaryDirectory() as tmp:
        router = RouterUnderTest(Path(tmp), ["--model", ns.model] if ns.model != "demo" else [])
        try:
            rates = asyncio.run(measure(ns, router))
        finally:
            router.stop()
    plain = statistics.median(rates["plain"])
    print(f"c={ns.concurrency}, {ns.requests} requests x {ns.max_tokens} tokens, "
          f"{ns.repeats} repeats (medians)")
    print(f"{'workload':<12} {'tokens/s':>9} {'÷ plain':>8}")
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"{name:<12} {rate:>9.1f} {rate / plain:>8.2f}")
    if ns.json is not None:
        ns.json.write_text(json.dumps({"rates": rates}, indent=2))
    return 0
