"""What the prompt cache holds and writes for agents' traffic (issue 27's figures).

One Headroom on the demo model (its disk tier in the run's folder), two workloads:

- ``conversation``: one chat of ``--turns`` turns (a ~``--system-tokens`` system prompt,
  ``--turn-tokens`` per user message, ``--max-tokens`` answers), as an agent sends it:
  every turn appends. Reported: the bytes the worker wrote (``wchar`` of its process, read
  from /proc: every byte it handed to ``write``, so the measure does not depend on the
  cache's own counters) and the RAM tier's bytes once the writer is idle, each over the KV
  of the final sequence; and each cached turn's time to first token.
- ``shared``: ``--chats`` one-turn chats sharing one ``--shared-tokens`` system prompt.
  Reported: the RAM they add over one copy of what they hold (the system prompt once and
  each chat's own tokens).

Run it from a checkout to measure that checkout's code (``python -m bench.blockstore``);
the same file copied into another checkout measures that one. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.prompts import make_prompt
from bench.systems import Headroom

TIMEOUT_S = 600.0


def wchar(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError(f"no wchar for {pid}")


def worker_report(url: str) -> dict[str, Any]:
    return httpx.get(url + "/v1/memory", timeout=30).json()["workers"][0]


def settled(url: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """The worker's report once its disk writer has nothing queued (bounded)."""
    deadline = time.monotonic() + timeout_s
    time.sleep(0.5)  # a finished request's store comes after its response
    while True:
        report = worker_report(url)
        disk = report["prompt_cache"]["tiers"]["disk"] or {}
        if not disk.get("pending") or time.monotonic() > deadline:
            return report
        time.sleep(0.2)


def chat(url: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[str, dict[str, Any], float]:
    """(answer, usage, seconds to the first content) for one streamed chat completion."""
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=TIMEOUT_S) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read().decode()[:500]}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                if choice["delta"].get("content"):
                    first = first if first is not None else time.perf_counter() - start
                    parts.append(choice["delta"]["content"])
    return "".join(parts), usage, first if first is not None else time.perf_counter() - start


def conversation(url: str, pid: int, encode: Any, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    messages = [{"role": "system", "content": make_prompt(encode, f"conv{rng.random()}", args.system_tokens, rng).text}]
    written0 = wchar(pid)
    ttfts: list[float] = []
    tokens = 0
    for turn in range(args.turns):
        messages.append({"role": "user", "content": make_prompt(encode, f"turn{turn}", args.turn_tokens, rng).text})
        answer, usage, ttft = chat(url, messages, args.max_tokens)
        messages.append({"role": "assistant", "content": answer})
        tokens = usage["prompt_tokens"] + usage["completion_tokens"]
        if turn:
            ttfts.append(ttft)
        settled(url)  # an agent's next turn comes after its tools ran: the writer is idle
    report = settled(url)
    kv = tokens * report["kv_bytes_per_token"]
    cache = report["prompt_cache"]
    written = wchar(pid) - written0
    return {"final_tokens": tokens, "final_kv_bytes": kv, "written_bytes": written,
            "written_over_kv": round(written / kv, 2), "ram_bytes": cache["ram_bytes"],
            "ram_over_kv": round(cache["ram_bytes"] / kv, 2),
            "cached_turn_ttft_ms": {"median": round(1000 * statistics.median(ttfts), 1),
                                    "min": round(1000 * min(ttfts), 1), "max": round(1000 * max(ttfts), 1)},
            "prompt_cache": {k: v for k, v in cache.items() if k in ("hits", "cached_tokens", "blocks", "evictions")}}


def shared(url: str, encode: Any, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(None if args.seed is None else args.seed + 1)
    system = make_prompt(encode, f"shared{rng.random()}", args.shared_tokens, rng).text
    before = settled(url)["prompt_cache"]["ram_bytes"]
    kv_per_token = worker_report(url)["kv_bytes_per_token"]
    own = 0
    system_tokens = 0
    for i in range(args.chats):
        question = make_prompt(encode, f"chat{i}", args.turn_tokens, rng).text
        _, usage, _ = chat(url, [{"role": "system", "content": system}, {"role": "user", "content": question}],
                           args.max_tokens)
        if i == 0:
            system_tokens = usage["prompt_tokens"] - len(encode(question))
        own += usage["prompt_tokens"] + usage["completion_tokens"] - system_tokens
    added = settled(url)["prompt_cache"]["ram_bytes"] - before
    one_copy = (system_tokens + own) * kv_per_token
    return {"chats": args.chats, "system_tokens": system_tokens, "ram_added_bytes": added,
            "one_copy_bytes": one_copy, "added_over_one_copy": round(added / one_copy, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.blockstore", description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--turn-tokens", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--chats", type=int, default=6)
    p.add_argument("--shared-tokens", type=int, default=1600)
    p.add_argument("--seed", type=int, help="the prompts' words (each run has its own cache "
                   "folder, so a seed only makes two checkouts' runs send the same prompts)")
    p.add_argument("--out", type=Path, help="write the JSON here too")
    args = p.parse_args(argv)
    from mlx_lm.utils import load_tokenizer

    import os

    from worker.demo import default_cache_root, ensure_demo_model

    folder = ensure_demo_model(default_cache_root(os.environ))
    encode = load_tokenizer(folder).encode
    with tempfile.TemporaryDirectory(prefix="bench-blockstore-") as tmp:
        system = Headroom("demo", Path(tmp), [])
        system.start(TIMEOUT_S)
        try:
            assert system.worker_pid is not None
            out = {"conversation": conversation(system.url, system.worker_pid, encode, args),
                   "shared": shared(system.url, encode, args), "args": vars(args) | {"out": None}}
        finally:
            system.stop()
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
