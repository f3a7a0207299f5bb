"""A mixed soak: every API and per-row feature at once against one router, until it breaks.

    python -m bench.soak [--model demo] [--sessions 6] [--seconds 240] [--seed 0]
                         [--router-arg=--memory-limit-mb=400 ...] [--json out.json]

``--sessions`` clients each hold a growing chat (a long system prompt, tools) and send, one
after another, a random kind of request: chat with tools (auto, required, a named one),
a ``json_schema`` answer, plain and streamed chat (some streams cut after a few chunks:
cancels mid-batch), ``n`` of 2-3 (streamed or not), chat logprobs with ``top_logprobs``,
completions scoring (``echo`` with ``logprobs``, ``max_tokens`` 0-3), Anthropic Messages
and Responses (streamed or not). Under a tight ``--memory-limit-mb`` with the prompt cache's
bounds small, this is where admission, the prompt cache's tiers, joins, scoring and
cancels meet; two severe defects were found this way (bench/README, "A mixed soak").

Reported: requests answered, errors by kind and status (a 400 for a prompt that can never
fit is expected under a tight limit and counted apart), the worker's restarts and their
causes (an OOM-guard abort names the step it stopped), the prompt cache's faults, and the
largest step peak over the gate's prediction when the router runs at ``--log-level debug``.
Exit status 1 when the worker restarted or a request failed other than by never fitting.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai

from bench.procs import ServerProcess, free_port, server_env

READY_S = 120.0
REQUEST_TIMEOUT_S = 180.0
TOOLS = [{"type": "function", "function": {
    "name": f"tool_{i}", "description": "does a thing " * 20,
    "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 24},
                                                    "n": {"type": "integer"}},
                   "required": ["path"], "additionalProperties": False}}} for i in range(4)]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
SYSTEM = "You are a coding agent. " + "Rules: be terse. " * 60
KINDS = ("tools", "schema", "plain", "stream", "stream_cut", "anthropic", "score", "n", "logprobs", "responses")
WORDS = ("fix", "the", "bug", "in", "file", "x.py", "then", "run", "tests")
# The step peak over the gate's prediction (worker/gate.py's DEBUG line).
PEAK_LINE = re.compile(r"step peak \d+ B, fitted prediction \d+ B \(x([\d.]+)\)")
NEVER_FITS = "needs more memory than the worker has even when idle"


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ok = 0
        self.never_fits = 0
        self.errors: dict[str, int] = {}

    def error(self, key: str) -> None:
        with self.lock:
            self.errors[key] = self.errors.get(key, 0) + 1


def _alternating(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat as Messages turns: user and assistant text, alternating, a user first."""
    merged: list[dict[str, Any]] = []
    for m in conv[1:]:
        if m["role"] not in ("user", "assistant"):
            continue
        text = m.get("content") or "x"
        if merged and merged[-1]["role"] == m["role"]:
            merged[-1]["content"] += " " + text
        else:
            merged.append({"role": m["role"], "content": text})
    if not merged or merged[0]["role"] != "user":
        merged.insert(0, {"role": "user", "content": "hi"})
    return merged


def one(kind: str, rng: random.Random, conv: list[dict[str, Any]], oa: openai.OpenAI,
        an: anthropic.Anthropic) -> None:
    """Send one request of ``kind``; the chat grows by its answer."""
    if kind == "tools":
        choice = rng.choice(["auto", "required", {"type": "function", "function": {"name": "tool_1"}}])
        r = oa.chat.completions.create(model="m", messages=conv, tools=TOOLS, tool_choice=choice,  # type: ignore[arg-type]
                                       max_tokens=40, temperature=0.7)
        msg = r.choices[0].message
        if msg.tool_calls:
            conv.append({"role": "assistant", "content": None,
                         "tool_calls": [tc.model_dump() for tc in msg.tool_calls]})
            conv += [{"role": "tool", "tool_call_id": tc.id, "content": "ok " * rng.randrange(1, 80)}
                     for tc in msg.tool_calls]
        else:
            conv.append({"role": "assistant", "content": msg.content or ""})
    elif kind == "schema":
        r = oa.chat.completions.create(model="m", messages=conv, max_tokens=60, temperature=1.0,  # type: ignore[arg-type]
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "p", "schema": SCHEMA}})
        if r.choices[0].finish_reason == "stop":
            json.loads(r.choices[0].message.content or "")
        conv.append({"role": "assistant", "content": r.choices[0].message.content or ""})
    elif kind == "plain":
        r = oa.chat.completions.create(model="m", messages=conv, max_tokens=rng.randrange(1, 30),  # type: ignore[arg-type]
                                       temperature=0.5)
        conv.append({"role": "assistant", "content": r.choices[0].message.content or ""})
    elif kind in ("stream", "stream_cut"):
        stream = oa.chat.completions.create(model="m", messages=conv, max_tokens=30, temperature=0.5,  # type: ignore[arg-type]
                                            stream=True)
        text, cut = "", rng.randrange(1, 8)
        for i, chunk in enumerate(stream):
            text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
            if kind == "stream_cut" and i > cut:
                stream.close()  # the client leaves: its row is cancelled mid-batch
                break
        conv.append({"role": "assistant", "content": text})
    elif kind == "anthropic":
        m = an.messages.create(model="m", system=SYSTEM, messages=_alternating(conv), max_tokens=20)  # type: ignore[arg-type]
        conv.append({"role": "assistant", "content": "".join(b.text for b in m.content if b.type == "text")})
    elif kind == "score":
        prompt = " ".join(str(m.get("content") or "") for m in conv[-3:])[-rng.randrange(10, 2000):] or "x"
        r = oa.completions.create(model="m", prompt=prompt, echo=True, logprobs=rng.choice([0, 1, 5]),
                                  max_tokens=rng.choice([0, 1, 3]))
        lp = r.choices[0].logprobs
        assert lp is not None and len(lp.tokens or []) == len(lp.token_logprobs or []), "echoed logprobs"
    elif kind == "n":
        stream = rng.random() < 0.5
        r = oa.chat.completions.create(model="m", messages=conv, n=rng.choice([2, 3]), max_tokens=10,  # type: ignore[arg-type]
                                       temperature=1.0, stream=stream)
        if stream:
            for _ in r:  # type: ignore[union-attr]
                pass
        else:
            assert len(r.choices) >= 2  # type: ignore[union-attr]
    elif kind == "logprobs":
        r = oa.chat.completions.create(model="m", messages=conv, logprobs=True, max_tokens=8,  # type: ignore[arg-type]
                                       top_logprobs=rng.choice([0, 5, 20]))
        assert r.choices[0].logprobs is not None
    else:  # responses
        items = [{"role": m["role"], "content": m.get("content") or "x"} for m in _alternating(conv)]
        stream = rng.random() < 0.5
        r = oa.responses.create(model="m", instructions=SYSTEM, input=items, max_output_tokens=12,  # type: ignore[arg-type]
                                stream=stream)
        if stream:
            for _ in r:  # type: ignore[union-attr]
                pass


def session(k: int, url: str, seconds: float, seed: int, tally: Tally) -> None:
    rng = random.Random(seed * 1000 + k)
    oa = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=REQUEST_TIMEOUT_S)
    an = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=REQUEST_TIMEOUT_S)
    conv: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(5, 60)))
        conv.append({"role": "user", "content": f"step {len(conv)}: {words}"})
        kind = rng.choice(KINDS)
        try:
            one(kind, rng, conv, oa, an)
            with tally.lock:
                tally.ok += 1
        except (openai.APIStatusError, anthropic.APIStatusError) as exc:
            if exc.status_code == 400 and NEVER_FITS in str(exc):
                with tally.lock:
                    tally.never_fits += 1  # a tight limit's answer to a long chat: expected
            else:
                tally.error(f"{kind}: {exc.status_code} {str(exc)[:160]}")
        except Exception as exc:  # a client-side failure: a broken stream, a bad answer
            tally.error(f"{kind}: {type(exc).__name__} {str(exc)[:160]}")
        if len(conv) > 14:  # keep the chat under the context: the system prompt and the latest turns
            conv = [conv[0], *conv[-6:]]
        while len(conv) > 1 and conv[1]["role"] == "tool":
            conv.pop(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--seconds", type=float, default=240.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--router-arg", action="append", default=[],
                   help="an mlx-router flag (repeat), e.g. --router-arg=--memory-limit-mb=400")
    p.add_argument("--json", type=Path, default=None)
    ns = p.parse_args(argv)

    tally = Tally()
    with tempfile.TemporaryDirectory(prefix="hr-soak-") as tmp:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = ServerProcess("headroom", [sys.executable, "-m", "router", "--model", ns.model,
                                            "--port", str(port), *ns.router_arg],
                               server_env(Path(tmp)), Path(tmp) / "router.log", url + "/health")
        server.start()
        try:
            server.wait_healthy(READY_S)
            threads = [threading.Thread(target=session, args=(k, url, ns.seconds, ns.seed, tally))
                       for k in range(ns.sessions)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(ns.seconds + 2 * REQUEST_TIMEOUT_S)
            health = httpx.get(url + "/health", timeout=30).json()
            memory = httpx.get(url + "/v1/memory", timeout=30).json()
        finally:
            server.stop()
        log = server.log_tail(10 ** 9)
    workers = health.get("workers", [])
    ratios = [float(r) for r in PEAK_LINE.findall(log)]
    out = {
        "argv": ns.router_arg, "sessions": ns.sessions, "seconds": ns.seconds,
        "answered": tally.ok, "never_fits_400": tally.never_fits, "errors": tally.errors,
        "restarts": sum(w.get("restarts", 0) for w in workers),
        "last_exit": [w.get("last_exit") for w in workers if w.get("last_exit")],
        "oom_guard_aborts": [line[line.index("OOM guard"):] for line in log.splitlines() if "OOM guard:" in line],
        "prompt_cache_faults": sum(w.get("prompt_cache", {}).get("faults", 0) for w in memory.get("workers", [])),
        "worst_step_over_prediction": max(ratios, default=None),
    }
    text = json.dumps(out, indent=1, default=str)
    if ns.json:
        ns.json.write_text(text)
    print(text)
    return 1 if out["restarts"] or out["errors"] or out["prompt_cache_faults"] else 0


if __name__ == "__main__":
    sys.exit(main())
