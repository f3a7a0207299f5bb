"""The largest prefill chunk by device (worker/boot.py prefill_step) and the warm start's
plan for prompts longer than one chunk (worker/warmup.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from common.costmodel import CostModel
from worker import warmup
from worker.boot import prefill_step


def test_the_flag_wins_and_zero_means_by_device() -> None:
    assert prefill_step(256, "cuda") == 256
    assert prefill_step(0, "cpu") == 512
    assert prefill_step(0, "cuda") == 2048
    assert prefill_step(0, "metal") == 2048


class FakeEngine:
    """Records the chunk each warm-up prefill runs at; one step prefills one chunk."""

    def __init__(self) -> None:
        self.step_size = 0
        self.prompts: list[tuple[int, int]] = []   # (prompt tokens, chunk)
        self.left = 0
        self.last_prefilled_tokens = 0
        self.last_chained_s = 0.0

    def set_prefill_step(self, n: int) -> None:
        self.step_size = n

    def add(self, rid: str, ids: list[int], max_tokens: int, sampling: Any) -> None:
        if rid.startswith("warmup-p"):
            self.prompts.append((len(ids), self.step_size))
            self.left = len(ids)
        else:
            self.left = 1

    @property
    def has_work(self) -> bool:
        return self.left > 0

    def step(self) -> None:
        self.last_prefilled_tokens = min(self.left, self.step_size or 1)
        self.left -= self.last_prefilled_tokens


def model(context: int = 8192) -> CostModel:
    return CostModel(kv_bytes_per_token=1024, num_layers=4, prefill_a_bytes=10.0, prefill_c_bytes=0.0,
                     prefill_b_bytes=0.0, budget_bytes=1 << 40, context_length=context,
                     prefill_step_tokens=512, prefill_batch_size=8)


def test_prompts_longer_than_a_chunk_are_warmed_in_chunks_over_a_growing_context() -> None:
    engine = FakeEngine()
    clock = iter(range(10_000)).__next__
    report = warmup.warm_up(engine, model(), vocab_size=1000, max_chunk=512, max_batch=32,
                            budget_s=1e9, clock=lambda: clock() * 1e-3)
    assert (1025, 512) in engine.prompts and (2049, 512) in engine.prompts
    assert all(chunk <= 512 for _, chunk in engine.prompts)
    assert engine.step_size == 512 and not report.skipped


def test_nothing_longer_than_the_context_is_warmed() -> None:
    engine = FakeEngine()
    report = warmup.warm_up(engine, model(context=1024), vocab_size=1000, max_chunk=512, max_batch=1,
                            budget_s=1e9)
    assert max(n for n, _ in engine.prompts) <= 1024
    assert "prefill 1024" in report.skipped and "prefill 2048" in report.skipped


def test_warm_up_chunks_stay_within_the_budget() -> None:
    # Attention over chunk x context dominates: a budget of 64 MiB holds a 512-token chunk
    # at short contexts but not at 2048 (c = 2 KB per token x context, as on the H200).
    tight = CostModel(kv_bytes_per_token=1024, num_layers=4, prefill_a_bytes=0.0, prefill_c_bytes=2000.0,
                      prefill_b_bytes=0.0, budget_bytes=64 << 20, context_length=8192,
                      prefill_step_tokens=2048, prefill_batch_size=8)
    engine = FakeEngine()
    warmup.warm_up(engine, tight, vocab_size=1000, max_chunk=2048, max_batch=1, budget_s=1e9)
    from common import costmodel
    for prompt, chunk in engine.prompts:
        assert costmodel.batch_cost_bytes(tight, 1, prompt + warmup.DECODE_TOKENS, chunk, 1, prompt) \
            <= tight.budget_bytes
    assert any(chunk < min(prompt - 1, 2048) for prompt, chunk in engine.prompts)


def test_memory_held_after_the_warm_start_comes_off_the_budget() -> None:
    from tests.fakes import FakeProbe
    from worker.boot import settle_baseline
    from worker.memory import MemoryState

    mib = 1 << 20
    probe = FakeProbe(limit_bytes=1024 * mib, active_bytes=100 * mib)
    base = model()
    memory = MemoryState(probe=probe, model=base, weights_bytes=100 * mib, baseline_bytes=0)
    assert settle_baseline(probe, memory, base, 100 * mib) is base          # nothing grew
    probe.active_bytes = 150 * mib                                          # 50 MiB more, idle
    settled = settle_baseline(probe, memory, base, 100 * mib)
    assert settled.budget_bytes == base.budget_bytes - 50 * mib
    assert memory.model is settled and memory.baseline_bytes == 50 * mib
    assert probe.invalidated >= 1                                           # a fresh reading


def test_warm_up_steps_are_sized_by_the_calibrations_held_out_error() -> None:
    # The first fit under-predicted steps it never saw by 1.5x: the warm start, which runs
    # before any step is measured, keeps each step's worst case that much (less the applied
    # fit's own margin) within the budget.
    from common import costmodel
    from worker.calibrate import FIT_MARGIN
    tight = CostModel(kv_bytes_per_token=1024, num_layers=4, prefill_a_bytes=0.0, prefill_c_bytes=2000.0,
                      prefill_b_bytes=0.0, budget_bytes=64 << 20, context_length=8192,
                      prefill_step_tokens=2048, prefill_batch_size=8)
    plain, wary = FakeEngine(), FakeEngine()
    warmup.warm_up(plain, tight, vocab_size=1000, max_chunk=2048, max_batch=1, budget_s=1e9)
    warmup.warm_up(wary, tight, vocab_size=1000, max_chunk=2048, max_batch=1, budget_s=1e9,
                   holdout_ratio=1.5)
    for prompt, chunk in wary.prompts:
        assert 1.5 / FIT_MARGIN * costmodel.batch_cost_bytes(tight, 1, prompt + warmup.DECODE_TOKENS, chunk, 1,
                                                             prompt) <= tight.budget_bytes
    assert sum(c for _, c in wary.prompts) < sum(c for _, c in plain.prompts)


def test_the_refill_runs_one_short_request_only_when_the_settled_budget_holds_it() -> None:
    from worker.warmup import REFILL_PROMPT, refill

    class Counting(FakeEngine):
        def __init__(self) -> None:
            super().__init__()
            self.added: list[tuple[str, int]] = []

        def add(self, rid: str, ids: list[int], max_tokens: int, sampling: Any) -> None:
            self.added.append((rid, len(ids)))
            super().add(rid, ids, max_tokens, sampling)

    engine = Counting()
    assert refill(engine, model(), vocab_size=100)  # type: ignore[arg-type]
    assert engine.added == [("warmup-refill", REFILL_PROMPT)] and not engine.has_work
    tight = dataclasses.replace(model(), budget_bytes=REFILL_PROMPT * 1024)  # less than its KV
    for skipped in (tight, model(context=REFILL_PROMPT)):
        engine = Counting()
        assert not refill(engine, skipped, vocab_size=100)  # type: ignore[arg-type]
        assert engine.added == []


def test_a_gpu_that_ran_the_model_before_warms_only_what_first_requests_need() -> None:
    from worker.boot import warmup_plan

    # Its calibration came from the cache: the kernels are in MLX's disk cache (a restart).
    assert warmup_plan("cuda", "cache") == warmup.CACHED_KERNELS_PLAN
    assert warmup_plan("metal", "cache") == warmup.CACHED_KERNELS_PLAN
    # A first run on this machine, and the CPU (no kernels to compile), warm the whole plan.
    assert warmup_plan("cuda", "probe") == warmup.PLAN
    assert warmup_plan("cpu", "cache") == warmup.PLAN
    engine = FakeEngine()
    report = warmup.warm_up(engine, model(), vocab_size=1000, max_chunk=2048, max_batch=32, budget_s=1e9,
                            plan=warmup.CACHED_KERNELS_PLAN)
    assert [n - 1 for n, _ in engine.prompts] == [16, 512]   # each prompt is n + 1 tokens
    assert report.batches == [1] and not report.skipped
    # Its largest chunk's time is in what seeds the pacer (worker/boot.py).
    assert max(n for n, _ in report.prefill) == 512


def test_after_the_short_plan_the_pacer_starts_from_its_largest_chunk() -> None:
    from worker.boot import pacer_seeds
    from worker.pacer import ChunkPacer

    steps = [(16, 0.6), (512, 0.17)]  # a restart on the H200: kernel loads, then a real chunk
    assert pacer_seeds(steps, warmup.CACHED_KERNELS_PLAN) == [(512, 0.17)]
    assert pacer_seeds(steps, warmup.PLAN) == steps
    assert pacer_seeds([], warmup.CACHED_KERNELS_PLAN) == []
    pacer = ChunkPacer(0.5, 2048)
    for tokens, seconds in pacer_seeds(steps, warmup.CACHED_KERNELS_PLAN):
        pacer.observe(tokens, seconds)
    assert pacer.chunk(rows=1) == 1505  # ~3,000 tokens/s for half a second
