"""In-process mlx-lm with a prompt cache, driven through agent sessions: the agents floor.

The model, the BatchGenerator (Headroom's worker settings) and mlx_lm.server's
`LRUPromptCache` (10 entries) come from bench/inprocess_chat.py; the reuse is the
server's: the nearest cached entry (trimmed when it runs past the common prefix) is handed
to `insert(caches=...)`, and a finished turn's cache is stored under its prompt +
generated ids. Prompts are the pre-rendered token ids every system gets. A session's next
turn "arrives" its tool time after its last token and is inserted at the next step
boundary; its TTFT counts from the arrival, as a server's client would see it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.agent_report import TurnRecord
from bench.agent_sessions import Session

IDLE_POLL_S = 0.05   # the longest sleep while every session is in its tool time


@dataclass(slots=True)
class _Live:
    index: int
    record: TurnRecord
    arrived: float
    max_tokens: int
    first_at: float | None = None


class InProcessAgents:
    name = "inprocess"

    def __init__(self, folder: Path, memory_limit_mb: int | None = None) -> None:
        self.folder = folder
        self.memory_limit_mb = memory_limit_mb
        self.chat: Any = None
        self.startup_s: float | None = None

    def start(self, timeout_s: float) -> None:
        from bench.inprocess_chat import InProcessChat

        from bench.systems import bound_mlx_memory

        started = time.monotonic()
        bound_mlx_memory(self.memory_limit_mb)
        self.chat = InProcessChat(self.folder)
        self.startup_s = time.monotonic() - started

    def stop(self) -> None:
        from bench.systems import release_mlx_memory

        if self.chat is not None:
            self.chat.close()
            self.chat = None
        release_mlx_memory()

    def worker_restarts(self) -> int:
        return 0

    def describe(self) -> dict[str, Any]:
        from bench.inprocess import MAX_BATCH_SIZE, PREFILL_BATCH_SIZE, PREFILL_STEP_SIZE
        from bench.inprocess_chat import PROMPT_CACHE_SIZE

        return {"batch_generator": {"completion_batch_size": MAX_BATCH_SIZE,
                                    "prefill_batch_size": PREFILL_BATCH_SIZE,
                                    "prefill_step_size": PREFILL_STEP_SIZE},
                "prompt_cache_entries": PROMPT_CACHE_SIZE, "startup_s": self.startup_s}

    def run(self, sessions: list[Session], *, repetition: int, max_tokens: int,
            timeout_s: float) -> list[TurnRecord]:
        """Every session at once, each turn sent its tool time after the last one ended."""
        started = time.perf_counter()
        next_turn = [0] * len(sessions)
        arrives = [started] * len(sessions)
        live: dict[int, _Live] = {}
        done: list[TurnRecord] = []
        while len(done) < sum(len(s.prompt_ids) for s in sessions):
            now = time.perf_counter()
            if now - started > timeout_s:
                self._give_up(live)
                break
            busy = {lv.index for lv in live.values()}
            for i, s in enumerate(sessions):
                if i not in busy and next_turn[i] < len(s.prompt_ids) and arrives[i] <= now:
                    uid, record = self._insert(s, i, next_turn[i], len(sessions), repetition, max_tokens)
                    live[uid] = _Live(i, record, arrives[i], max_tokens)
                    next_turn[i] += 1
            if not live:
                waiting = [arrives[i] for i, s in enumerate(sessions) if next_turn[i] < len(s.prompt_ids)]
                time.sleep(min(IDLE_POLL_S, max(0.0, min(waiting, default=now) - now)))
                continue
            for lv in self._step(live):
                done.append(lv.record)
                s = sessions[lv.index]
                arrives[lv.index] = time.perf_counter() + s.tool_times_s[lv.record.turn]
        return done

    def _insert(self, s: Session, index: int, turn: int, num_sessions: int, repetition: int,
                max_tokens: int) -> tuple[int, TurnRecord]:
        prompt = list(s.prompt_ids[turn])
        uid, cached = self.chat.insert(prompt, max_tokens)
        record = TurnRecord("inprocess", num_sessions, repetition, index, turn, len(prompt),
                            s.new_tokens(turn), prompt_tokens=len(prompt), cached_tokens=cached)
        return uid, record

    def _step(self, live: dict[int, _Live]) -> list[_Live]:
        from bench.inprocess_chat import MODEL_KEY

        _, responses = self.chat.generator.next()
        now = time.perf_counter()
        finished = []
        for r in responses:
            lv = live.get(r.uid)
            if lv is None:
                continue
            if lv.first_at is None:
                lv.first_at = now
                lv.record.ttft_s = now - lv.arrived
            lv.record.completion_tokens += 1
            if r.finish_reason is None:
                continue
            self.chat.cache.insert_cache(MODEL_KEY, list(r.all_tokens), r.prompt_cache)
            r.prompt_cache = None
            lv.record.latency_s, lv.record.decode_s = now - lv.arrived, now - lv.first_at
            lv.record.ok = lv.record.completion_tokens == lv.max_tokens and r.finish_reason == "length"
            if not lv.record.ok:
                lv.record.error = f"finish_reason {r.finish_reason!r} after {lv.record.completion_tokens} tokens"
            finished.append(lv)
            del live[r.uid]
        return finished

    def _give_up(self, live: dict[int, _Live]) -> None:
        """Drop the turns in flight; the caller records every unfinished turn as failed."""
        self.chat.generator.remove(list(live))
        live.clear()
