"""The router's share of an agent's turn: "HTTP before the queue" on the later turns of a chat.

    python -m bench before-queue [--sessions 6] [--turns 5] [--system-tokens 850]
                                 [--turn-tokens 100] [--pause-s 0.05] [--json out.json]

A coding agent resends its whole, growing conversation every turn: a long system prompt
with tool definitions, then its tool calls and their results. Each session here is one:
8 tools, a system prompt of about ``--system-tokens``, and per turn the assistant's tool
call plus a tool result of about ``--turn-tokens`` (on the demo model's tokenizer, whose
4,096-token context bounds the chat: about 3.0k tokens at turn 0, 2.1k of them the tools,
and 4.0k at turn 4 with the defaults). Sessions take turns round
robin (as several agents would), one request at a time with ``--pause-s`` of "tool time"
between, ``max_tokens`` 1.

- http: a router on the demo model at ``--log-level info``; each request's "HTTP before
  the queue N ms" (parsing, checks, template, tokenizing, up to the queue) is read from the
  router's own INFO line, matched by request id. Turn 0 of a session is cold; the figure
  is turns 1 and later.
- tokenizer: the same requests' tokenizing step alone, in this process (render the chat
  template, encode, the message boundaries: what router/http/api.py runs before the queue),
  with the router tokenizer's prefix cache and with a full tokenization each time; each
  turn checks that both give the same token ids and boundaries.

The router is pinned to CPU 0, its worker and this process to CPU 1, where the machine
has two CPUs (said in the output). Most of the run is the worker's prefill of each turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench import cli
from bench.conversations import TOOLS, string_tools
from bench.metrics import percentile
from bench.prompts import make_prompt

log = logging.getLogger("bench.beforequeue")

# Four more of what a coding agent declares, beside conversations.TOOLS: eight in all.
MORE_TOOLS: list[dict[str, Any]] = string_tools([
    ("list_dir", "List the entries of a directory in the workspace.",
     {"path": "The directory, relative to the workspace root."}),
    ("write_file", "Create or overwrite a file with the given text.",
     {"path": "The file.", "text": "Its whole new content."}),
    ("web_fetch", "Fetch a URL and return its text.", {"url": "The address."}),
    ("todo", "Record the plan as a list of steps and mark which are done.",
     {"steps": "The steps, one a line.", "done": "Indices of the finished steps."}),
])
AGENT_TOOLS = TOOLS + MORE_TOOLS
_BEFORE_QUEUE = re.compile(r"\[(?P<id>[^\]]+)\] finished: .*HTTP before the queue (?P<ms>[\d.]+)ms")


class Session:
    """One agent's conversation: what it sends at each turn."""

    def __init__(self, encode: Callable[[str], list[int]], index: int, system_tokens: int,
                 turn_tokens: int, turns: int, rng: random.Random) -> None:
        tag = f"agent-{index}-{rng.randrange(1 << 30):x}"
        self.tag = tag
        self.system = make_prompt(encode, f"You are coding agent {tag}.", system_tokens, rng).text
        self.task = make_prompt(encode, "Task:", 60, rng).text
        self.results = [make_prompt(encode, f"Result {t}:", turn_tokens, rng).text for t in range(turns)]

    def messages(self, turn: int) -> list[dict[str, Any]]:
        """Turn ``turn`` (0-based): the task, then a tool call and its result per earlier turn."""
        out: list[dict[str, Any]] = [{"role": "system", "content": self.system},
                                     {"role": "user", "content": self.task}]
        for t in range(turn):
            call_id = f"call_{self.tag}_{t}"
            tool = AGENT_TOOLS[t % len(AGENT_TOOLS)]["function"]
            args = {p: f"{p}-{t}" for p in tool["parameters"]["required"]}
            out.append({"role": "assistant", "content": f"Step {t}: calling {tool['name']}.",
                        "tool_calls": [{"id": call_id, "type": "function",
                                        "function": {"name": tool["name"], "arguments": json.dumps(args)}}]})
            out.append({"role": "tool", "tool_call_id": call_id, "content": self.results[t]})
        return out


def make_sessions(encode: Callable[[str], list[int]], ns: Any) -> list[Session]:
    rng = random.Random()  # unseeded: a rerun must not find an earlier run's prompt cache
    return [Session(encode, i, ns.system_tokens, ns.turn_tokens, ns.turns, rng) for i in range(ns.sessions)]


def summarize(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50_ms": percentile(values, 50), "p90_ms": percentile(values, 90),
            "max_ms": max(values, default=float("nan"))}


def run_http(r: Any, log_path: Path, sessions: list[Session], ns: Any) -> dict[str, Any]:
    """Send every turn round robin, one at a time; the router's log says its share of each."""
    sent: list[tuple[str, int, int]] = []  # request id, turn, prompt tokens
    with httpx.Client(timeout=300) as client:
        for turn in range(ns.turns):
            for s in sessions:
                request_id = f"bq-{s.tag}-{turn}"
                body = {"model": "demo", "messages": s.messages(turn), "tools": AGENT_TOOLS,
                        "max_tokens": 1}
                resp = client.post(r.url + "/v1/chat/completions", json=body,
                                   headers={"X-Request-Id": request_id})
                if resp.status_code != 200:
                    raise RuntimeError(f"{request_id}: {resp.status_code} {resp.text}")
                sent.append((request_id, turn, resp.json()["usage"]["prompt_tokens"]))
                time.sleep(ns.pause_s)
    time.sleep(0.5)  # the last INFO line is written after the response
    found = {m["id"]: float(m["ms"]) for m in _BEFORE_QUEUE.finditer(log_path.read_text(errors="replace"))}
    missing = [rid for rid, _, _ in sent if rid not in found]
    if missing:
        raise RuntimeError(f"no 'before the queue' line for {len(missing)} requests, e.g. {missing[0]}")
    return {"first_turns": summarize([found[rid] for rid, turn, _ in sent if turn == 0]),
            "later_turns": summarize([found[rid] for rid, turn, _ in sent if turn > 0]),
            "per_turn_p50_ms": [percentile([found[rid] for rid, t, _ in sent if t == turn], 50)
                                for turn in range(ns.turns)],
            "prompt_tokens_by_turn": [next(n for _, t, n in sent if t == turn) for turn in range(ns.turns)]}


def run_tokenizer(folder: Path, sessions: list[Session], ns: Any) -> dict[str, Any]:
    """The tokenizing step alone, as router/http/api.py runs it, with the prefix cache and without."""
    from router.chat.tokenizer import RouterTokenizer

    cached = RouterTokenizer.load(folder)
    full = RouterTokenizer.load(folder, prefix_cache_entries=0)
    times: dict[str, list[tuple[int, float]]] = {"cached": [], "full": []}
    for turn in range(ns.turns):
        for s in sessions:
            messages = s.messages(turn)
            results = []
            for name, tok in (("cached", cached), ("full", full)):
                started = time.perf_counter()
                text = tok.render_chat(messages, AGENT_TOOLS)
                ids = tok.encode_rendered(text)
                ends = tok.message_boundaries(messages, AGENT_TOOLS, None, text, ids)
                times[name].append((turn, (time.perf_counter() - started) * 1e3))
                results.append((ids, ends))
            if results[0] != results[1]:
                raise RuntimeError(f"the prefix cache changed the ids or boundaries of {s.tag} turn {turn}")
    return {name: {"first_turns": summarize([ms for t, ms in values if t == 0]),
                   "later_turns": summarize([ms for t, ms in values if t > 0])}
            for name, values in times.items()}


def pin(r: Any, cpus: list[int]) -> str:
    """The router alone on the first CPU; its worker and this process (idle while a
    request is in the router) on the second."""
    if len(cpus) < 2:
        return "not pinned (fewer than 2 CPUs available)"
    os.sched_setaffinity(r.proc.pid, {cpus[0]})
    for proc in r.proc.children(recursive=True):
        try:
            os.sched_setaffinity(proc.pid, {cpus[1]})
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    os.sched_setaffinity(0, {cpus[1]})
    return f"router on cpu {cpus[0]}, its worker and this process on cpu {cpus[1]}"


def render(out: dict[str, Any]) -> str:
    h = out["http"]
    lines = [f"prompt tokens by turn: {h['prompt_tokens_by_turn']}", f"pinning: {out['pinning']}", "",
             "| what | turns | n | p50 | p90 | max |", "|---|---|---|---|---|---|"]
    rows = [("HTTP before the queue", "later", h["later_turns"]),
            ("HTTP before the queue", "first", h["first_turns"])]
    if "tokenizer" in out:
        t = out["tokenizer"]
        rows += [("tokenizing, prefix cache", "later", t["cached"]["later_turns"]),
                 ("tokenizing, prefix cache", "first", t["cached"]["first_turns"]),
                 ("tokenizing, full each time", "later", t["full"]["later_turns"]),
                 ("tokenizing, full each time", "first", t["full"]["first_turns"])]
    lines += [f"| {what} | {turns} | {s['n']} | {s['p50_ms']:.2f} ms | {s['p90_ms']:.2f} ms "
              f"| {s['max_ms']:.2f} ms |" for what, turns, s in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("before-queue", __doc__)
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-tokens", type=int, default=850)
    p.add_argument("--turn-tokens", type=int, default=100)
    p.add_argument("--pause-s", type=float, default=0.05, help="tool time between requests")
    p.add_argument("--no-tokenizer", dest="tokenizer", action="store_false",
                   help="skip the in-process tokenizer figures")
    ns = cli.parse(p, argv)
    from bench.faults import RouterUnderTest
    from bench.routeronly import _wait
    from router.chat.tokenizer import RouterTokenizer

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    with tempfile.TemporaryDirectory(prefix="hr-bq-") as tmp:
        r = RouterUnderTest(Path(tmp), ["--log-level", "info"])
        try:
            asyncio.run(_wait(r))
            out: dict[str, Any] = {"pinning": pin(r, cpus)}
            folder = next((Path(tmp) / "cache" / "mlx-headroom").glob("demo-v*"))
            encode = RouterTokenizer.load(folder).encode
            warm = argparse.Namespace(**{**vars(ns), "sessions": 1, "turns": 2})
            run_http(r, Path(tmp) / "router.log", make_sessions(encode, warm), warm)  # first requests compile
            log.info("%d sessions x %d turns over HTTP", ns.sessions, ns.turns)
            out["http"] = run_http(r, Path(tmp) / "router.log", make_sessions(encode, ns), ns)
        finally:
            r.stop()
        if ns.tokenizer:
            log.info("the tokenizing step alone, in process")
            out["tokenizer"] = run_tokenizer(folder, make_sessions(encode, ns), ns)
    args = argv if argv is not None else sys.argv[1:]
    out["command"] = shlex.join(["python", "-m", "bench", "before-queue", *args])
    text = json.dumps(out, indent=2)
    if ns.json:
        ns.json.write_text(text)
    print(render(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
