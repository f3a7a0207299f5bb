"""The router's share of an agent's later turns on a real tokenizer and chat template.

    python -m bench.routershare --model DIR [--turns 6] [--repeats 3] [--system-tokens 2000]
                                [--grow-to 8000] [--turn-tokens 150] [--tools 8] [--root CHECKOUT]
                                [--router-arg=FLAG=V] [--json out.json]

``bench before-queue`` measures the demo model's 4k-token chats. An agent on a real model
sends longer ones through a heavier template: this bench builds one session of the
``agents`` workload (bench/agent_sessions.py: a system prompt with tools, growing by a tool
call and its result per turn) on ``DIR``'s own tokenizer and template, and sends its turns
to a router serving ``DIR`` (``max_tokens`` 1), ``--repeats`` times in order. A model folder
with a Qwen tokenizer and template that runs on a CPU: ``python -m bench.gpumodel --tiny
--out DIR``.

Reported: "HTTP before the queue" of the later turns (the router's own INFO figure: parse,
checks, template, tokenizing, up to the queue; each repetition's first turn is left out),
and the tokenizing step alone in this process, split into render, encode and message
boundaries, with every boundary (``all``) and with the system message's only (``first``,
what a worker with KV blocks asks for in its hello).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.agent_sessions import Shape, make_sessions, template_messages
from bench.procs import ServerProcess, free_port, server_env

_BEFORE_QUEUE = re.compile(r"HTTP before the queue ([\d.]+)ms")
ROOT = Path(__file__).resolve().parents[1]
READY_S = 180.0


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"n": len(values), "p50_ms": round(statistics.median(values), 3),
            "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))], 3), "max_ms": round(ordered[-1], 3)}


def tokenizing(folder: Path, session: Any, repeats: int) -> dict[str, Any]:
    """The tokenizing step of each later turn, in this process, by part."""
    from common.protocol import BOUNDARIES_ALL, BOUNDARIES_FIRST
    from router.chat.tokenizer import RouterTokenizer

    out: dict[str, Any] = {}
    for wanted in (BOUNDARIES_ALL, BOUNDARIES_FIRST):
        tok = RouterTokenizer.load(folder)
        parts: dict[str, list[float]] = {"render": [], "encode": [], "boundaries": [], "total": []}
        for _ in range(repeats):
            for turn in range(len(session.turn_ends)):
                messages, tools = template_messages(session.request(turn)), list(session.tools)
                t0 = time.perf_counter()
                text = tok.render_chat(messages, tools)
                t1 = time.perf_counter()
                ids = tok.encode_rendered(text)
                t2 = time.perf_counter()
                try:
                    tok.message_boundaries(messages, tools, None, text, ids, wanted)
                except TypeError:  # an older checkout (--root): every boundary
                    tok.message_boundaries(messages, tools, None, text, ids)
                t3 = time.perf_counter()
                if turn:
                    for name, secs in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                        parts[name].append(secs * 1e3)
        out[wanted] = {name: _summary(v)["p50_ms"] for name, v in parts.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.routershare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a model folder (tokenizer and template)")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--grow-to", type=int, default=8000)
    p.add_argument("--turn-tokens", type=int, default=150)
    p.add_argument("--tools", type=int, default=8)
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout whose router runs (a before)")
    p.add_argument("--router-arg", action="append", default=[],
                   help="one more router flag, e.g. --router-arg=--memory-limit-mb=20797 (on a GPU)")
    p.add_argument("--json", type=Path, default=None)
    ns = p.parse_args(argv)
    from router.chat.tokenizer import RouterTokenizer

    folder = ns.model.resolve()
    tok = RouterTokenizer.load(folder)
    shape = Shape(system_tokens=ns.system_tokens, grow_to_tokens=ns.grow_to, turn_tokens=ns.turn_tokens,
                  num_turns=ns.turns, num_tools=ns.tools)
    session = make_sessions(tok.encode, lambda m, tools: tok.encode_chat(template_messages(m), tools),
                            "rs", 1, shape, tool_time_s=(0.0, 0.0), seed=1)[0]
    out: dict[str, Any] = {"model": str(folder), "root": str(ns.root), "turn_tokens": [len(ids) for ids in session.prompt_ids],
                           "messages": len(session.messages)}
    with tempfile.TemporaryDirectory(prefix="hr-rs-") as tmp:
        port = free_port()
        env = {**server_env(Path(tmp)), "PYTHONPATH": str(ns.root)}
        server = ServerProcess("headroom", [sys.executable, "-m", "router", "--model", str(folder), "--port",
                                            str(port), "--log-level", "info", *ns.router_arg],
                               env, Path(tmp) / "router.log", f"http://127.0.0.1:{port}/health")
        server.cwd = ns.root
        server.start()
        try:
            server.wait_healthy(READY_S)
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
                for _ in range(ns.repeats + 1):  # the first round warms the router's caches
                    for turn in range(ns.turns):
                        res = http.post("/v1/chat/completions", json={
                            "model": "m", "messages": session.request(turn), "tools": list(session.tools),
                            "max_tokens": 1})
                        res.raise_for_status()
        finally:
            server.stop()
        values = [float(m.group(1)) for m in _BEFORE_QUEUE.finditer(server.log_tail(10 ** 9))]
    later = [v for i, v in enumerate(values[ns.turns:]) if i % ns.turns]
    out["http_before_queue_later_turns"] = _summary(later)
    out["tokenizing_p50_ms"] = tokenizing(folder, session, ns.repeats)
    text = json.dumps(out, indent=1)
    if ns.json:
        ns.json.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
