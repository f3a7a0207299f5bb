"""The floor: mlx-lm's BatchGenerator stepped directly in the bench process.

No HTTP, no tokenizer on the request path (prompts arrive as token ids), no IPC: what
is left is the model and mlx-lm's own batching, so (1/tps_system − 1/tps_inprocess) is
what a server adds per token. The generator is configured like Headroom's worker
(prefill chunk 512, 8 prompts prefilled together, up to 32 rows decoded together) and
built without stop tokens, which is what `ignore_eos` means on a server.

The client model is the same closed loop as bench/client.py: `concurrency` requests in
flight; when one finishes, the next prompt is inserted before the next step. Times are
taken around BatchGenerator.next(): a token "arrives" when the step that produced it
returns.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.metrics import MixedRun, RequestResult, RunResult
from bench.prompts import Prompt

log = logging.getLogger(__name__)

# Headroom's worker defaults (worker/boot.py PREFILL_BATCH_SIZE, --prefill-step-size,
# --max-batch-size), so the floor batches exactly as the system it is the floor of.
PREFILL_STEP_SIZE = 512
PREFILL_BATCH_SIZE = 8
MAX_BATCH_SIZE = 32


@dataclass(slots=True)
class _Live:
    result: RequestResult
    sent: float


class InProcess:
    """Owns a loaded model and one long-lived BatchGenerator (as a server would)."""

    def __init__(self, folder: Path) -> None:
        from mlx_lm import load
        from mlx_lm.generate import BatchGenerator

        started = time.monotonic()
        self.model, self.tokenizer = load(str(folder))[:2]
        self.generator: Any = BatchGenerator(
            self.model, completion_batch_size=MAX_BATCH_SIZE,
            prefill_batch_size=PREFILL_BATCH_SIZE, prefill_step_size=PREFILL_STEP_SIZE)
        log.info("inprocess: loaded %s in %.1f s", folder, time.monotonic() - started)

    def close(self) -> None:
        self.generator.close()

    def run(self, prompts: list[Prompt], *, concurrency: int, max_tokens: int, repetition: int,
            timeout_s: float, system: str = "inprocess") -> RunResult:
        gen = self.generator
        pending = deque(prompts)
        live: dict[int, _Live] = {}
        done: list[RequestResult] = []
        started = time.perf_counter()
        while pending or live:
            if time.perf_counter() - started > timeout_s:
                done.extend(self._abandon(live, pending, timeout_s))
                break
            while pending and len(live) < concurrency:
                prompt = pending.popleft()
                sent = time.perf_counter()
                (uid,) = gen.insert([prompt.token_ids], max_tokens=[max_tokens])
                live[uid] = _Live(RequestResult(), sent)
            done.extend(self._step(live, max_tokens))
        wall_s = time.perf_counter() - started
        return RunResult(system=system, concurrency=concurrency, repetition=repetition,
                         wall_s=wall_s, requests=done)

    def run_mixed(self, long_prompt: Prompt, shorts: list[Prompt], *, max_tokens: int,
                  head_start_s: float, repetition: int, timeout_s: float,
                  system: str = "inprocess") -> MixedRun:
        """The mixed workload: the short prompts "arrive" head_start_s after the long one.

        They can only be inserted between steps, as on a server (whose loop is inside a
        step when they arrive); their time is counted from the arrival, not the insert.
        """
        gen = self.generator
        started = time.perf_counter()
        (uid,) = gen.insert([long_prompt.token_ids], max_tokens=[max_tokens])
        live: dict[int, _Live] = {uid: _Live(RequestResult(), started)}
        long_result = live[uid].result
        short_results: list[RequestResult] = []
        arrival = started + head_start_s
        while live or not short_results:
            if time.perf_counter() - started > timeout_s:
                self._abandon(live, deque(), timeout_s)
                break
            if not short_results and time.perf_counter() >= arrival:
                uids = gen.insert([p.token_ids for p in shorts], max_tokens=[max_tokens] * len(shorts))
                for short_uid in uids:
                    live[short_uid] = _Live(RequestResult(), arrival)
                    short_results.append(live[short_uid].result)
            if not live:
                time.sleep(min(0.01, max(0.0, arrival - time.perf_counter())))
                continue
            self._step(live, max_tokens)
        if not short_results:  # timed out before they arrived
            short_results = [RequestResult() for _ in shorts]
        for res in [long_result, *short_results]:
            if res.error is None and not res.ok:
                res.error = f"timed out after {timeout_s:.0f} s"
        return MixedRun(system=system, repetition=repetition, long=long_result, shorts=short_results)

    def _step(self, live: dict[int, _Live], max_tokens: int) -> list[RequestResult]:
        """One generator step: record each live request's token; returns those finished."""
        _, responses = self.generator.next()
        now = time.perf_counter()
        finished: list[RequestResult] = []
        for r in responses:
            entry = live.get(r.uid)
            if entry is None:
                continue
            _record_token(entry, now)
            if r.finish_reason is not None:
                r.prompt_cache = None  # as Headroom's engine does: free the cache now
                _finish(entry, r.finish_reason, now, max_tokens)
                finished.append(entry.result)
                del live[r.uid]
        return finished

    def _abandon(self, live: dict[int, _Live], pending: deque[Prompt], timeout_s: float) -> list[RequestResult]:
        """Remove what is still running and report it (and what never started) as errors."""
        self.generator.remove(list(live))
        why = f"timed out after {timeout_s:.0f} s"
        out = [RequestResult(error=why) for _ in pending]
        for entry in live.values():
            entry.result.error = why
            out.append(entry.result)
        live.clear()
        return out


def _record_token(entry: _Live, now: float) -> None:
    res = entry.result
    res.completion_tokens += 1
    res.output_chunk(now - entry.sent)


def _finish(entry: _Live, finish_reason: str, now: float, max_tokens: int) -> None:
    res = entry.result
    res.latency_s = now - entry.sent
    if res.completion_tokens != max_tokens or finish_reason != "length":
        res.error = (f"{res.completion_tokens} tokens, finish_reason {finish_reason!r}; "
                     f"expected exactly {max_tokens} and 'length'")
    res.ok = res.error is None
