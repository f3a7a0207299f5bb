"""Coding agents: N concurrent sessions x T turns, cold and cached TTFT, output tokens/s.

    python -m bench agents [--sessions 1,8] [--turns 5] [--system-tokens 2000] [--tools 8]
                           [--grow-to 8000] [--turn-tokens 150] [--max-tokens 48]
                           [--tool-time-s 0.5,2] [--repeats 2] [--json out.json]

Each session is a coding agent's conversation (bench/agent_sessions.py): a system prompt
and tool definitions of ~--system-tokens, growing by ~--turn-tokens a turn (the previous
answer with a tool call, and the tool's result) to ~--grow-to at the last of --turns
measured turns, streamed chat completions of exactly --max-tokens, and a pause of
"tool time" (uniform in --tool-time-s, seeded: the same for every system) between a
session's turns. The defaults are issue 25's sizes (for a real model on a GPU); on the
demo model use smaller ones (bench/README.md, "Agents").

Three systems in one run on one machine, all up for the whole run and measured in turn
(order rotated every workload): Headroom (`python -m router`, defaults), `mlx_lm.server`
with its prompt cache on (as shipped: 10 entries) and in-process mlx-lm with the same
cache (bench/agent_inprocess.py). Every system gets the same sessions, rendered with the
model's chat template; a server whose `usage.prompt_tokens` differs from the rendered
length is reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench import cli
from bench.agent_report import TurnRecord, derive, render, summarize
from bench.agent_sessions import AGENT_TOOLS, Session, Shape, accounting, make_sessions, template_messages

log = logging.getLogger("bench.agents")
SYSTEM_NAMES = ("headroom", "mlx_lm_server", "inprocess")


async def stream_turn(http: aiohttp.ClientSession, url: str, body: dict[str, Any], rec: TurnRecord,
                      max_tokens: int) -> None:
    """One streamed chat completion; fills ``rec`` (exactly max_tokens or an error)."""
    sent, first, done = time.perf_counter(), None, False
    try:
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if line.startswith(b"event:") and line[6:].strip() == b"error":
                    rec.error = "SSE error event"
                if not line.startswith(b"data:"):
                    continue
                if line[5:].strip() == b"[DONE]":
                    done = True
                    break
                obj = json.loads(line[5:])
                if "error" in obj:
                    rec.error = f"error event: {json.dumps(obj['error'])[:200]}"
                    return
                for choice in obj.get("choices") or ():
                    delta = choice.get("delta") or {}
                    if first is None and (delta.get("content") or delta.get("tool_calls")
                                          or delta.get("reasoning_content")):
                        first = time.perf_counter()
                if usage := obj.get("usage"):
                    rec.completion_tokens = int(usage.get("completion_tokens") or 0)
                    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                    rec.cached_tokens = int(cached) if cached is not None else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
        return
    # Decode time ends at [DONE], not at the last text chunk: servers coalesce the last
    # tokens into fewer chunks, which would make a few tokens look instantaneous.
    ended = time.perf_counter()
    if first is not None:
        rec.ttft_s, rec.decode_s, rec.latency_s = first - sent, ended - first, ended - sent
    rec.error = rec.error or (
        "stream ended without [DONE]" if not done else "no output" if first is None else
        f"{rec.completion_tokens} tokens, expected {max_tokens}" if rec.completion_tokens != max_tokens else None)
    rec.ok = rec.error is None


def chat_body(s: Session, turn: int, max_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    return {"model": "bench", "messages": s.request(turn), **({"tools": list(s.tools)} if s.tools else {}),
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}


async def http_sessions(system: Any, sessions: list[Session], *, repetition: int, max_tokens: int,
                        timeout_s: float) -> list[TurnRecord]:
    records: list[TurnRecord] = []

    async def one(http: aiohttp.ClientSession, i: int, s: Session) -> None:
        for turn in range(len(s.prompt_ids)):
            rec = TurnRecord(system.name, len(sessions), repetition, i, turn, len(s.prompt_ids[turn]),
                             s.new_tokens(turn))
            body = chat_body(s, turn, max_tokens, system.extra_body)
            await stream_turn(http, system.url, body, rec, max_tokens)
            records.append(rec)
            await asyncio.sleep(s.tool_times_s[turn] if turn + 1 < len(s.prompt_ids) else 0)

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=len(sessions))
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        with contextlib.suppress(TimeoutError):  # the turns not recorded are counted as failed
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(*(one(http, i, s) for i, s in enumerate(sessions)))
    return records


def run_workload(system: Any, sessions: list[Session], *, repetition: int, max_tokens: int,
                 timeout_s: float) -> dict[str, Any]:
    restarts, started = system.worker_restarts(), time.perf_counter()
    if system.name == "inprocess":
        records = system.run(sessions, repetition=repetition, max_tokens=max_tokens, timeout_s=timeout_s)
    else:
        records = asyncio.run(http_sessions(system, sessions, repetition=repetition,
                                            max_tokens=max_tokens, timeout_s=timeout_s))
    wall_s = time.perf_counter() - started
    return {"records": records + missing(system.name, sessions, records, repetition, timeout_s),
            "wall_s": wall_s, "worker_restarts": system.worker_restarts() - restarts}


def missing(name: str, sessions: list[Session], records: list[TurnRecord], repetition: int,
            timeout_s: float) -> list[TurnRecord]:
    """A failed record for every turn the workload's time bound left unfinished or unsent."""
    seen = {(r.session, r.turn) for r in records}
    return [TurnRecord(name, len(sessions), repetition, i, t, len(s.prompt_ids[t]), s.new_tokens(t),
                       error=f"not finished within the workload's {timeout_s:g} s")
            for i, s in enumerate(sessions) for t in range(len(s.prompt_ids)) if (i, t) not in seen]


def make_system(name: str, model_arg: str, folder: Path, run_dir: Path, args: Any) -> Any:
    from bench.agent_inprocess import InProcessAgents
    from bench.systems import Headroom, MlxLmServer

    if name == "headroom":
        return Headroom(model_arg, run_dir, args.headroom_arg)
    if name == "mlx_lm_server":  # its prompt cache on, at its default size (the last flag wins)
        return MlxLmServer(folder, run_dir, args.max_tokens, ["--prompt-cache-size", "10", *args.mlx_lm_arg])
    return InProcessAgents(folder, args.peer_memory_limit_mb)


def build_sessions(encode: Any, render_ids: Any, args: Any,
                   context_tokens: int | None) -> dict[tuple[int, int], list[Session]]:
    """Every workload's sessions, built before any server starts (a size error costs nothing)."""
    shape = Shape(system_tokens=args.system_tokens, grow_to_tokens=args.grow_to, turn_tokens=args.turn_tokens,
                  num_turns=args.turns, num_tools=args.tools)
    out = {}
    try:
        for rep in range(args.repeats):
            for n in args.sessions:
                out[(n, rep)] = make_sessions(encode, render_ids, f"r{rep}n{n}", n, shape,
                                              tool_time_s=args.tool_time_s, seed=args.seed * 1000 + rep * 100 + n)
    except ValueError as exc:
        raise SystemExit(f"--system-tokens {args.system_tokens} --tools {args.tools}: {exc}") from None
    longest = max(len(s.prompt_ids[-1]) for ss in out.values() for s in ss)
    if context_tokens is not None and longest + args.max_tokens > context_tokens:
        raise SystemExit(f"the last turn's prompt is {longest} tokens + {args.max_tokens} out, over the "
                         f"model's context of {context_tokens}: lower --grow-to or --turn-tokens")
    return out


def _context_tokens(folder: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(json.loads((folder / "config.json").read_text()).get("max_position_embeddings"))
    return None


def measure(systems: list[Any], plan: dict[tuple[int, int], list[Session]], args: Any) -> dict[str, dict[str, Any]]:
    """Every workload on every system, the order rotated each time."""
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for k, ((n, rep), sessions) in enumerate(plan.items()):  # repetitions outermost
        shift = k % len(systems)
        for system in systems[shift:] + systems[:shift]:
            run = run_workload(system, sessions, repetition=rep, max_tokens=args.max_tokens,
                               timeout_s=args.workload_timeout)
            runs.setdefault((system.name, n), []).append(run)
            short = summarize(run["records"])["pooled"]
            log.info("N=%d rep %d %-14s cold %.0f ms, cached p50 %.0f ms, %d/%d ok", n, rep, system.name,
                     short["cold_ttft_p50_ms"], short["cached_ttft_p50_ms"],
                     sum(r.ok for r in run["records"]), len(run["records"]))
    results: dict[str, dict[str, Any]] = {}
    for (name, n), rs in runs.items():
        results.setdefault(name, {})[f"n{n}"] = summarize(
            [r for run in rs for r in run["records"]], worker_restarts=sum(run["worker_restarts"] for run in rs),
            wall_s=sum(run["wall_s"] for run in rs))
    return {name: results[name] for name in args.systems if name in results}


def warm_sessions(encode: Any, render_ids: Any, args: Any) -> dict[str, list[Session]]:
    """One short two-turn session per system: kernels, lazy imports, the tool path."""
    fixed = len(render_ids([{"role": "system", "content": ""}], AGENT_TOOLS[:args.tools]))
    shape = Shape(system_tokens=fixed + 96, grow_to_tokens=0, turn_tokens=32, num_turns=2, num_tools=args.tools)
    return {name: make_sessions(encode, render_ids, f"warm-{name}", 1, shape, tool_time_s=(0.0, 0.0), seed=0)
            for name in args.systems}


def _warm(systems: list[Any], warm: dict[str, list[Session]], args: Any) -> None:
    """Each system's warm session, discarded."""
    for system in systems:
        run = run_workload(system, warm[system.name], repetition=-1, max_tokens=4,
                           timeout_s=args.workload_timeout)
        bad = [r.error for r in run["records"] if not r.ok]
        if bad:
            log.warning("%s warm-up: %s", system.name, bad[0])


def run(args: Any) -> dict[str, Any]:
    from mlx_lm.utils import load_tokenizer

    from bench.runner import _git, _machine, resolve_model

    model_arg, folder, model_info = resolve_model(args.model)
    tokenizer = load_tokenizer(folder)

    def render_ids(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        return list(tokenizer.apply_chat_template(template_messages(messages), tools=tools or None,
                                                  add_generation_prompt=True))

    plan = build_sessions(tokenizer.encode, render_ids, args, _context_tokens(folder))
    warm = warm_sessions(tokenizer.encode, render_ids, args)
    if args.keep_logs is not None:
        args.keep_logs.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="headroom-agents-", dir=args.keep_logs))
    started, load_before = time.monotonic(), os.getloadavg()
    with contextlib.ExitStack() as stack:
        systems = []
        for name in args.systems:
            system = make_system(name, model_arg, folder, run_dir, args)
            stack.callback(system.stop)  # registered before start: stopped even if start fails
            system.start(args.startup_timeout)
            systems.append(system)
        _warm(systems, warm, args)
        results = measure(systems, plan, args)
        described = {s.name: s.describe() for s in systems}
    if args.keep_logs is None:
        shutil.rmtree(run_dir, ignore_errors=True)
    ratios, targets, notes = derive(results)
    meta = {"command": " ".join(["python", "-m", "bench", "agents", *args.argv]), "machine": _machine(),
            "git": _git(), "model": model_info, "sessions": args.sessions, "turns": args.turns,
            "system_tokens": args.system_tokens, "tools": args.tools, "grow_to_tokens": args.grow_to,
            "turn_tokens": args.turn_tokens, "max_tokens": args.max_tokens, "tool_time_s": args.tool_time_s,
            "seed": args.seed, "repeats": args.repeats, "systems": described,
            "duration_s": round(time.monotonic() - started, 1), "loadavg_before": load_before,
            "loadavg_after": os.getloadavg()}
    acc = {f"n{n}": accounting(plan[(n, 0)]) for n in args.sessions}
    return {"meta": meta, "accounting": acc, "results": results, "ratios": ratios, "targets": targets,
            "notes": notes}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _seconds_range(text: str) -> tuple[float, float]:
    parts = [float(x) for x in text.split(",")]
    if len(parts) not in (1, 2) or min(parts) < 0 or parts[0] > parts[-1]:
        raise ValueError(text)
    return parts[0], parts[-1]


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("agents", __doc__)
    p.add_argument("--model", default="demo", help="demo | bench-shaped | PATH")
    p.add_argument("--sessions", type=_ints, default=[1, 8], help="concurrent sessions, one workload each (1,8)")
    p.add_argument("--turns", type=int, default=5, help="measured turns per session; the first is cold")
    p.add_argument("--system-tokens", type=int, default=2000, help="system prompt + tool definitions")
    p.add_argument("--tools", type=int, default=len(AGENT_TOOLS), choices=range(len(AGENT_TOOLS) + 1),
                   help=f"tool definitions sent (0-{len(AGENT_TOOLS)}, JSON-schema parameters)")
    p.add_argument("--grow-to", type=int, default=8000,
                   help="the last turn's prompt tokens (0: no earlier exchanges)")
    p.add_argument("--turn-tokens", type=int, default=150,
                   help="new tokens a turn: the previous answer + a tool result")
    p.add_argument("--max-tokens", type=int, default=48, help="exact output length of every turn")
    p.add_argument("--tool-time-s", type=_seconds_range, default=(0.5, 2.0), metavar="LOW[,HIGH]",
                   help="pause between a session's turns, uniform in [LOW, HIGH], seeded")
    p.add_argument("--seed", type=int, default=0, help="seeds the tool times (the same for every system)")
    p.add_argument("--repeats", type=int, default=2, help="repetitions of each workload")
    p.add_argument("--systems", type=lambda s: s.split(","), default=list(SYSTEM_NAMES))
    p.add_argument("--startup-timeout", type=float, default=240.0)
    p.add_argument("--workload-timeout", type=float, default=600.0, help="bounds each system's workload")
    p.add_argument("--headroom-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--mlx-lm-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--peer-memory-limit-mb", type=int, default=None,
                   help="bound the in-process peer's MLX memory (and a quarter of it for its "
                        "buffer cache): on a shared GPU, give it Headroom's --memory-limit-mb")
    p.add_argument("--keep-logs", type=Path, default=None, metavar="DIR",
                   help="keep the servers' logs under DIR (default: removed after a clean run)")
    ns = cli.parse(p, argv)
    ns.argv = list(sys.argv[2:] if argv is None else argv)
    if not ns.sessions or min(ns.sessions) < 1 or min(ns.max_tokens, ns.repeats) < 1:
        p.error("--sessions, --max-tokens and --repeats must be >= 1")
    unknown = set(ns.systems) - set(SYSTEM_NAMES)
    if unknown or len(set(ns.systems)) != len(ns.systems):
        p.error(f"choose distinct systems from {','.join(SYSTEM_NAMES)}; got {ns.systems}")
    try:
        Shape(system_tokens=ns.system_tokens, grow_to_tokens=ns.grow_to, turn_tokens=ns.turn_tokens,
              num_turns=ns.turns, num_tools=ns.tools)
    except ValueError as exc:
        p.error(str(exc))
    # SIGTERM becomes an exception, so every `finally` stops the servers.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    doc = run(ns)
    print(render(doc))
    out = ns.json or Path(__file__).resolve().parent / "results" / f"agents-{time.strftime('%Y%m%d-%H%M%S')}.json"
    from bench.report import write_json

    write_json(doc, out)
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
