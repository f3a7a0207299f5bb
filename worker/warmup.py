"""Warm start: run the kernels the first requests need before the worker says hello.

A fresh worker's first prefill and first decode at a new batch size pay for kernel
compilation and allocator warm-up (on the H200 the machine's first prefill took 30-40 s;
on the demo model on CPU the first request took several times a warm one's time to first
token). Running a few small requests through the real engine first moves that cost
before "ready", and its timings seed the chunk pacer with this device's real prefill
speed instead of a CPU-sized guess. Bounded in time; skipped parts are logged.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from common import costmodel
from common.costmodel import CostModel
from common.protocol import SamplingParams
from worker.calibrate import FIT_MARGIN
from worker.engine import Engine

log = logging.getLogger(__name__)

# What to warm, most useful first: a prefill chunk ("p", tokens) or a decode batch ("d",
# rows). Each is tried only while time is left; the first requests are short and few.
# MLX's CUDA quantized matmul picks its kernel by the rows it multiplies (up to 16, 32, 64,
# 128, more), and a kernel's first launch loads it: a prefill of each bucket is warmed (on
# the H200 a fresh worker's first 32-token prompt, 31 rows, took 2.0-2.2x a warm one's TTFT
# when only 16 and 64 had run).
PLAN = (("p", 16), ("d", 1), ("p", 64), ("d", 2), ("d", 4), ("d", 8), ("p", 32), ("p", 128),
        ("p", 256), ("p", 512), ("d", 16), ("d", 32), ("p", 1024), ("p", 2048))
# A GPU worker whose calibration came from the cache follows one that ran this model on
# this machine, whose kernels are in MLX's disk cache: the whole plan then took 4.5-4.8 s
# on the H200 (14 parts of 0.1-0.9 s, each as cheap on demand), the largest phase of a
# restart. Such a start warms what every first request needs (a short prefill, a decode)
# and one large chunk, whose time seeds the chunk pacer with the device's real prefill
# speed (a 16-token part's time is mostly kernel loads); any other shape is paid once, by
# the first request that has it, instead of by every restart.
CACHED_KERNELS_PLAN = (("p", 16), ("d", 1), ("p", 512))
DECODE_TOKENS = 3
DECODE_PROMPT = 16
REFILL_PROMPT = 32


@dataclass(slots=True)
class WarmupReport:
    seconds: float = 0.0
    prefill: list[tuple[int, float]] = field(default_factory=list)   # (tokens, seconds) per step
    batches: list[int] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    # Each part's seconds, as run: on a GPU what a part costs beyond its compute is the
    # process's first use of its kernels (module loads, cuDNN graphs), paid again by every
    # new worker; the log shows which parts a restart pays most for.
    parts: list[tuple[str, float]] = field(default_factory=list)


def warm_up(engine: Engine, model: CostModel, *, vocab_size: int, max_chunk: int, max_batch: int,
            budget_s: float, clock: Callable[[], float] = time.monotonic,
            holdout_ratio: float = 0.0, plan: tuple[tuple[str, int], ...] = PLAN) -> WarmupReport:
    """Prefill a few chunk sizes, then decode at a few batch sizes with each sampler path
    (``plan``: what, in order; ``CACHED_KERNELS_PLAN`` where the kernels are on disk).

    A part is skipped when it would not fit the memory budget, or when the prefill speed
    measured so far says it would not finish within the time left. ``holdout_ratio`` is the
    calibration's measured/predicted on steps its first fit never saw: the warm start runs
    before any step has been measured (so before the gate's scale can grow) and without the
    OOM guard's eye, so it sizes its steps by a model that much larger, less the margin the
    applied fit already carries (on the H200, a warm-up prompt sized to the plain fit peaked
    0.3 % above the limit; held-out ratio 1.76).
    """
    if holdout_ratio > FIT_MARGIN:
        model = dataclasses.replace(model, scale=model.scale * holdout_ratio / FIT_MARGIN)
    started = clock()
    report = WarmupReport()
    token = _warm_token(vocab_size)

    def affordable(prefill_tokens: int) -> bool:
        left = budget_s - (clock() - started)
        if left <= 0:
            return False
        if not report.prefill:
            return True
        done = sum(n for n, _ in report.prefill)
        spent = sum(s for _, s in report.prefill)
        return prefill_tokens * spent / max(done, 1) <= left

    for kind, n in plan:
        if kind == "p" and n <= 4 * max_chunk:
            # Beyond one chunk the prompt goes in max_chunk pieces: the later ones run
            # attention over a longer context (on the H200 a fresh worker's first
            # 1024-token prompt took 6.7x a warm one's time when only short contexts ran).
            chunk = _chunk_within_budget(model, n, max_chunk)
            if (n + 1 + DECODE_TOKENS > model.context_length or chunk is None or not affordable(n)):
                report.skipped.append(f"prefill {n}")
                continue
            part_started = clock()
            _prefill(engine, n, token, chunk, max_chunk, clock, report)
            report.parts.append((f"p{n}", clock() - part_started))
        elif kind == "d" and n <= max_batch:
            if (costmodel.batch_cost_bytes(model, n, DECODE_PROMPT + DECODE_TOKENS, DECODE_PROMPT, n,
                                           DECODE_PROMPT) > model.budget_bytes
                    or not affordable(n * DECODE_PROMPT)):
                report.skipped.append(f"decode x{n}")
                continue
            part_started = clock()
            _decode(engine, n, token)
            report.batches.append(n)
            report.parts.append((f"d{n}", clock() - part_started))
    report.seconds = clock() - started
    log.info("warm start in %.2fs: prefill chunks %s, decode batches %s (seconds by part: %s)%s",
             report.seconds, [n for n, _ in report.prefill], report.batches,
             ", ".join(f"{name} {secs:.2f}" for name, secs in report.parts),
             f"; skipped (time or memory) {', '.join(report.skipped)}" if report.skipped else "")
    return report


def refill(engine: Engine, model: CostModel, *, vocab_size: int) -> bool:
    """One short request, after the idle baseline was measured with MLX's buffer cache
    cleared: the first real request then finds the buffers a short prompt and a decode
    step use in the cache instead of asking the device for each (on the H200 a fresh
    worker's first short request took 100 ms to its first token in the engine, the next
    one 46 ms, with every kernel already warm). What it leaves is MLX's cache: reclaimable,
    and bounded by the gate like any other. Skipped (False) when the settled budget or the
    context could not hold it, as any warm-up part is."""
    total = REFILL_PROMPT + DECODE_TOKENS
    if total > model.context_length or costmodel.batch_cost_bytes(
            model, 1, total, REFILL_PROMPT, 1, REFILL_PROMPT) > model.budget_bytes:
        log.info("warm start: the refill request does not fit the settled budget; skipped")
        return False
    token = _warm_token(vocab_size)
    engine.add("warmup-refill", [token] * REFILL_PROMPT, max_tokens=DECODE_TOKENS,
               sampling=SamplingParams(temperature=0.0, ignore_eos=True))
    while engine.has_work:
        engine.step()
    return True


def _warm_token(vocab_size: int) -> int:
    """The id the warm-up prompts repeat: any valid one does."""
    return min(17, max(vocab_size - 1, 0))


def _chunk_within_budget(model: CostModel, size: int, max_chunk: int) -> int | None:
    """The chunk a warm-up prompt of ``size`` tokens is prefilled in: as large as the step
    allows while one row's worst case stays within the budget (a 2048-token chunk at
    context 2048 once peaked at 17 GB on the H200 under a 3 GiB budget); None if none fits."""
    total = size + 1 + DECODE_TOKENS
    most = min(size, max_chunk)
    chunk = costmodel.chunk_that_fits(model, 1, total, 1, size + 1, model.budget_bytes, most)
    if costmodel.batch_cost_bytes(model, 1, total, chunk, 1, size + 1) > model.budget_bytes:
        return None
    return chunk


def _prefill(engine: Engine, size: int, token: int, chunk: int, max_chunk: int,
             clock: Callable[[], float], report: WarmupReport) -> None:
    engine.set_prefill_step(chunk)
    engine.add(f"warmup-p{size}", [token] * (size + 1), max_tokens=1,
               sampling=SamplingParams(temperature=0.0, ignore_eos=True))
    while engine.has_work:
        t = clock()
        engine.step()
        if engine.last_prefilled_tokens:  # the chunk's time, not the first token's calls after it
            report.prefill.append((engine.last_prefilled_tokens, clock() - t - engine.last_chained_s))
    engine.set_prefill_step(max_chunk)


def _decode(engine: Engine, rows: int, token: int) -> None:
    for i in range(rows):
        # Greedy, plain sampling and seeded top-p: each sampler path the requests use.
        temperature, top_p, seed = ((0.0, 1.0, None), (0.8, 1.0, None), (0.7, 0.9, i))[i % 3]
        engine.add(f"warmup-d{rows}-{i}", [token + i % 7] * DECODE_PROMPT, max_tokens=DECODE_TOKENS,
                   sampling=SamplingParams(temperature=temperature, top_p=top_p, seed=seed,
                                           ignore_eos=True))
    while engine.has_work:
        engine.step()
