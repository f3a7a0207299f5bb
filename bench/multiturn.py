"""Multi-turn chat with reuse: cold and cached TTFT, cached-token ratio, peak memory, restart.

    python -m bench multiturn [--system-tokens 256] [--tools 1] [--turns 3] [--concurrency 1,4] [--json out.json]

Each system in turn (started, warmed, measured, stopped): at every concurrency c, c
conversations at once (bench/conversations.py: a long system prompt with tools, then
append-only turns carrying the model's own replies), streamed chat completions. Cold =
first turns, cached = later turns; `cached_tokens` is read from
`usage.prompt_tokens_details` where the server reports it (0 where it does not). Peak
memory is the largest RSS of the system's processes, sampled every 50 ms.

Restart (servers only, at c = 1 after the last concurrency): one more turn of a finished
conversation after Headroom's worker is SIGKILLed and back (its disk tier should make it
warm), or after `mlx_lm.server` is SIGKILLed and started again (it has no disk tier).

Systems: `headroom` (defaults: its prompt cache, once it has one), `mlx_lm_server` with its
prompt cache on (`--prompt-cache-size 10`, its default) and in-process mlx-lm with the
same LRU prompt cache (bench/inprocess_chat.py). Defaults fit the demo model on a CPU in a
few minutes; on a GPU scale up, e.g. `--system-tokens 3000 --tools 4 --turns 5 --turn-tokens 200
--max-tokens 64`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from bench import cli
from bench.conversations import TOOLS, Conversation, TurnResult, make_conversations, summarize

log = logging.getLogger("bench.multiturn")
SYSTEM_NAMES = ("headroom", "mlx_lm_server", "inprocess")


class PeakRss:
    """The largest summed RSS of a process and its children, sampled in a thread."""

    def __init__(self, pid: int, interval_s: float = 0.05) -> None:
        self.pid, self.interval_s, self.peak_bytes = pid, interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            total = 0
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(self.pid)
                for p in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        total += p.memory_info().rss
            self.peak_bytes = max(self.peak_bytes, total)


async def chat_turn(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                    result: TurnResult) -> str:
    """One streamed chat completion; fills ``result``, returns the reply's text."""
    sent, parts = time.perf_counter(), []
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return ""
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                obj = json.loads(line[5:])
                if "error" in obj:
                    result.error = f"error event: {json.dumps(obj['error'])[:200]}"
                    return ""
                for choice in obj.get("choices") or ():
                    delta = choice.get("delta") or {}
                    if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"):
                        result.ttft_s = result.ttft_s or time.perf_counter() - sent
                    parts.append(delta.get("content") or "")
                usage = obj.get("usage") or {}
                if usage:
                    result.prompt_tokens = int(usage.get("prompt_tokens", 0))
                    details = usage.get("prompt_tokens_details") or {}
                    cached = details.get("cached_tokens")
                    result.cached_tokens = int(cached) if cached is not None else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return ""
    result.ok = result.ttft_s is not None
    result.error = None if result.ok else "no output"
    return "".join(parts)


def chat_body(conv: Conversation, turn: int, replies: list[str], max_tokens: int,
              extra: dict[str, Any]) -> dict[str, Any]:
    tools = {"tools": TOOLS[:conv.num_tools]} if conv.num_tools else {}
    return {"model": "bench", "messages": conv.messages(turn, replies), **tools,
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}


async def http_conversations(url: str, name: str, convs: list[Conversation], replies: list[list[str]],
                             *, turns: range, max_tokens: int, extra: dict[str, Any],
                             timeout_s: float, after_restart: bool = False) -> list[TurnResult]:
    results: list[TurnResult] = []

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        for turn in turns:
            res = TurnResult(name, len(convs), i, turn, after_restart=after_restart)
            text = await chat_turn(session, url, chat_body(convs[i], turn, replies[i], max_tokens, extra), res)
            results.append(res)
            if not res.ok:
                return
            replies[i].append(text)

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=len(convs))) as s:
        await asyncio.gather(*(one(s, i) for i in range(len(convs))))
    return results


def _wait_new_worker(system: Any, old_pid: int | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        worker = system._worker()
        if worker.get("state") == "ready" and worker.get("pid") not in (None, old_pid):
            system.worker_pid = worker["pid"]
            return
        time.sleep(0.1)
    raise TimeoutError(f"no new ready worker within {timeout_s:.0f} s")


def restart(system: Any, timeout_s: float) -> float:
    """SIGKILL Headroom's worker (the router restarts it) or the whole mlx_lm.server and
    start it again; returns seconds until it serves again."""
    started = time.monotonic()
    if system.name == "headroom":
        old = system._worker().get("pid")
        os.kill(old, signal.SIGKILL)
        _wait_new_worker(system, old, timeout_s)
    else:
        assert system.proc.popen is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(system.proc.popen.pid, signal.SIGKILL)
        system.proc.popen.wait(timeout_s)
        system.start(timeout_s)
    return time.monotonic() - started


def measure_http(system: Any, encode: Any, args: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    last: tuple[list[Conversation], list[list[str]]] | None = None
    for c in args.concurrency:
        convs = make_conversations(encode, f"{system.name}-c{c}", c, system_tokens=args.system_tokens,
                                   turns=args.turns + 1, turn_tokens=args.turn_tokens,
                                   num_tools=args.tools)
        replies: list[list[str]] = [[] for _ in convs]
        with PeakRss(system.proc.popen.pid) as rss:
            results = asyncio.run(http_conversations(
                system.url, system.name, convs, replies, turns=range(args.turns),
                max_tokens=args.max_tokens, extra=system.extra_body, timeout_s=args.request_timeout))
        out[f"c{c}"] = {**summarize(results), "peak_rss_bytes": rss.peak_bytes,
                        "server_memory": _server_memory(system)}
        last = (convs[:1], replies[:1])
        log.info("%s c=%d: %s", system.name, c, _brief(out[f"c{c}"]))
    if args.restart and last is not None:
        convs, replies = last
        took = restart(system, args.startup_timeout)
        results = asyncio.run(http_conversations(
            system.url, system.name, convs, replies, turns=range(args.turns, args.turns + 1),
            max_tokens=args.max_tokens, extra=system.extra_body, timeout_s=args.request_timeout,
            after_restart=True))
        r = results[0]
        out["restart"] = {"back_after_s": took, "ok": r.ok, "error": r.error, "ttft_s": r.ttft_s,
                          "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens}
        log.info("%s after restart: %s", system.name, out["restart"])
    return out


def _server_memory(system: Any) -> dict[str, Any] | None:
    """Headroom's own account (/v1/memory: peak_bytes, and the prompt cache once it has one)."""
    if system.name != "headroom":
        return None
    try:
        import urllib.request

        with urllib.request.urlopen(system.url + "/v1/memory", timeout=5.0) as resp:
            doc = json.loads(resp.read())
        worker = (doc.get("workers") or [{}])[0]
        return {k: v for k, v in worker.items() if "peak" in k or "cache" in k or k == "limit_bytes"}
    except (OSError, ValueError, AttributeError, IndexError):
        return None


def measure_inprocess(folder: Path, encode: Any, args: Any) -> dict[str, Any]:
    import mlx.core as mx

    from bench.inprocess_chat import InProcessChat

    chat = InProcessChat(folder)
    out: dict[str, Any] = {}
    try:
        warm = make_conversations(encode, "warm", 1, system_tokens=32, turns=1, turn_tokens=8)
        chat.run(warm, turns=1, max_tokens=2, timeout_s=args.request_timeout, concurrency=1)
        for c in args.concurrency:
            convs = make_conversations(encode, f"inprocess-c{c}", c, system_tokens=args.system_tokens,
                                       turns=args.turns, turn_tokens=args.turn_tokens,
                                       num_tools=args.tools)
            mx.reset_peak_memory()
            with PeakRss(os.getpid()) as rss:
                results = chat.run(convs, turns=args.turns, max_tokens=args.max_tokens,
                                   timeout_s=args.request_timeout, concurrency=c)
            out[f"c{c}"] = {**summarize(results), "peak_rss_bytes": rss.peak_bytes,
                            "server_memory": {"mlx_peak_bytes": mx.get_peak_memory()}}
            log.info("inprocess c=%d: %s", c, _brief(out[f"c{c}"]))
    finally:
        chat.close()
    return out


def _brief(s: dict[str, Any]) -> str:
    return (f"cold {s['cold_ttft_p50_s']:.3f} s, cached {s['cached_ttft_p50_s']:.3f} s, "
            f"cached tokens {s['cached_token_ratio']:.2f}, errors {s['errors']}")


def _warm_http(system: Any, encode: Any, timeout_s: float) -> None:
    """One short conversation turn, discarded: kernel setup and lazy imports."""
    warm = make_conversations(encode, "warm", 1, system_tokens=32, turns=1, turn_tokens=8)
    results = asyncio.run(http_conversations(system.url, system.name, warm, [[]], turns=range(1),
                                             max_tokens=2, extra=system.extra_body, timeout_s=timeout_s))
    if not results[0].ok:
        log.warning("%s warm-up failed: %s", system.name, results[0].error)


def run(args: Any) -> dict[str, Any]:
    from mlx_lm.utils import load_tokenizer

    from bench.runner import _git, _machine, resolve_model
    from bench.systems import Headroom, MlxLmServer

    model_arg, folder, model_info = resolve_model(args.model)
    encode = load_tokenizer(folder).encode
    run_dir = Path(tempfile.mkdtemp(prefix="headroom-multiturn-"))
    results: dict[str, Any] = {}
    for name in args.systems:
        if name == "inprocess":
            results[name] = measure_inprocess(folder, encode, args)
            continue
        system: Any = (Headroom(model_arg, run_dir, args.headroom_arg) if name == "headroom" else
                       MlxLmServer(folder, run_dir, args.max_tokens,
                                   ["--prompt-cache-size", "10", *args.mlx_lm_arg]))
        try:
            system.start(args.startup_timeout)
            _warm_http(system, encode, args.request_timeout)
            results[name] = {**measure_http(system, encode, args), "describe": system.describe()}
        finally:
            system.stop()
    meta = {"command": " ".join(["python", "-m", "bench", "multiturn", *sys.argv[2:]]),
            "machine": _machine(), "git": _git(), "model": model_info,
            "system_tokens": args.system_tokens, "tools": args.tools, "turns": args.turns, "turn_tokens": args.turn_tokens,
            "max_tokens": args.max_tokens, "concurrency": args.concurrency, "loadavg": os.getloadavg()}
    return {"meta": meta, "results": results}


def main(argv: list[str] | None = None) -> int:
    from bench.conversations import render

    p = cli.parser("multiturn", __doc__)
    p.add_argument("--model", default="demo", help="demo | bench-shaped | PATH")
    p.add_argument("--system-tokens", type=int, default=256, help="system prompt length (tools come on top)")
    p.add_argument("--tools", type=int, default=1, choices=range(len(TOOLS) + 1),
                   help=f"tool definitions in the system turn (0-{len(TOOLS)}; ~280 demo tokens each)")
    p.add_argument("--turns", type=int, default=3, help="turns per conversation (the first is cold)")
    p.add_argument("--turn-tokens", type=int, default=32, help="length of each user message")
    p.add_argument("--max-tokens", type=int, default=8, help="reply length")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--systems", type=lambda s: s.split(","), default=list(SYSTEM_NAMES))
    p.add_argument("--no-restart", dest="restart", action="store_false",
                   help="skip the turn after a SIGKILL of the worker (or server)")
    p.add_argument("--startup-timeout", type=float, default=240.0)
    p.add_argument("--request-timeout", type=float, default=600.0, help="bounds each conversation run")
    p.add_argument("--headroom-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--mlx-lm-arg", action="append", default=[], metavar="ARG")
    ns = cli.parse(p, argv)
    if min(ns.turns, ns.system_tokens, ns.turn_tokens, ns.max_tokens, *ns.concurrency) < 1 or ns.turns < 2:
        p.error("--turns must be >= 2 (one cold, one cached); sizes and concurrency >= 1")
    unknown = set(ns.systems) - set(SYSTEM_NAMES)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {','.join(SYSTEM_NAMES)}")
    # SIGTERM becomes an exception, so every `finally` stops the servers.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    doc = run(ns)
    print(render(doc))
    if ns.json:
        ns.json.write_text(json.dumps(doc, indent=1, default=str))
        print(f"\nJSON: {ns.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
