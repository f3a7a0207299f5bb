"""The worker's core (``WorkerCore``) around the gate, on the demo model with scripted
memory readings, and with no socket: what it would publish is what its calls return.

The engine is real (mlx-lm's BatchGenerator on the demo model); only the device readings
are fake, because the process footprint that the runtime set-aside reacts to (NVML's
per-process bytes on CUDA) does not exist on Linux's CPU backend.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from common import costmodel
from common.protocol import Generate, Message, SamplingParams
from tests.fakes import FakeProbe
from worker.engine import Engine, Output
from worker.loader import load_model
from worker.memory import MemoryState
from worker.prefix_cache import PrefixCache
from worker.core import CoreOptions, WorkerCore

MIB = 1 << 20
WEIGHTS = 10 * MIB
OUTSIDE = 50 * MIB           # the runtime's idle memory MLX does not count
LIMIT = 1024 * MIB


@pytest.fixture(scope="module")
def loaded(cache_home: Path) -> object:
    return load_model("demo", {"XDG_CACHE_HOME": str(cache_home)})


def make_core(loaded: object, clock: Any = time.monotonic, cache_type: type[PrefixCache] = PrefixCache,
              kv_bytes_per_token: int = MIB) -> tuple[WorkerCore, FakeProbe, PrefixCache]:
    engine = Engine(loaded.model, list(loaded.eos_token_ids), prefill_step_size=64,  # type: ignore[attr-defined]
                    prefill_batch_size=8, max_batch_size=8)
    probe = FakeProbe(limit_bytes=LIMIT, active_bytes=WEIGHTS, footprint_bytes=WEIGHTS + OUTSIDE)
    # A large KV per token: a short request (fast on the CPU) is a large promise.
    model = costmodel.CostModel(kv_bytes_per_token=kv_bytes_per_token, num_layers=4, prefill_a_bytes=20_000.0,
                                prefill_c_bytes=8.0, prefill_b_bytes=MIB,
                                budget_bytes=LIMIT - WEIGHTS - OUTSIDE - 16 * MIB, context_length=4096,
                                prefill_step_tokens=64, prefill_batch_size=8)
    memory = MemoryState(probe=probe, model=model, weights_bytes=WEIGHTS, baseline_bytes=OUTSIDE,
                         active_baseline_bytes=0)
    cache = cache_type(max_bytes=model.budget_bytes // 2, max_entries=8, budget_share=0.5)
    opts = CoreOptions(incarnation=1, oom_guard="off", admission=True, max_running=8, vocab_size=512)
    return WorkerCore(opts, engine, memory, clock=clock, cache=cache), probe, cache


def types(messages: list[Message]) -> list[str]:
    return [m.type for m in messages]


def test_the_runtimes_excess_moves_the_budget_the_cache_bound_and_the_published_model(loaded: object) -> None:
    core, probe, cache = make_core(loaded)
    assert core.handle(Generate(incarnation=1, request_id="r1", prompt_ids=[3 + i % 500 for i in range(200)],
                                max_tokens=20, sampling=SamplingParams(temperature=0, ignore_eos=True))) == []
    assert core.engine.running and core.memory.reserved_bytes > 0
    budget = core.gate.model.budget_bytes
    core._changed = False
    # While the step runs the process holds far more than MLX counts: counted as used,
    # that is less than the running request was promised.
    probe.footprint_bytes = probe.active_bytes + OUTSIDE + 750 * MIB
    core.memory.refresh()
    assert core.memory.headroom_bytes() < core.memory.reserved_bytes
    outputs = core._apply(core.schedule())                        # the schedule's pressure relief
    assert outputs == [] and not core.gate.under_pressure          # nothing stopped
    assert core.memory.runtime_bytes > 0
    assert core.gate.model.budget_bytes == budget - core.memory.runtime_bytes
    assert cache.max_bytes == int(core.gate.model.budget_bytes * 0.5)  # the RAM tier follows
    assert core._changed                                              # the router hears of it
    report = core.memory.report(running=1, max_running=8)
    assert report.cost_model["budget_bytes"] == core.gate.model.budget_bytes
    assert report.runtime_transient_bytes == core.memory.runtime_bytes
    # The request still runs to its end.
    done: list[str] = []
    for _ in range(400):
        done += [row.request_id for m in core.step() if m.type == "tokens"
                 for row in m.outputs if row.finish_reason is not None]  # type: ignore[attr-defined]
        if done:
            break
    assert done == ["r1"]


def test_a_first_tokens_status_waits_one_iteration_and_never_two(loaded: object) -> None:
    """The status that an admission changed goes out after the first token, one iteration
    later (read before the token, it would delay the token's stream in the router), held
    at most once in a row, and not at all when the engine is left idle."""
    core, _, _ = make_core(loaded)
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    core.status(force=True)
    assert core.handle(Generate(incarnation=1, request_id="a", prompt_ids=[5 + i for i in range(12)],
                                max_tokens=8, sampling=greedy)) == []
    assert types(core.step()) == ["tokens"]              # its chunk and first token, in one step
    assert types(core.step()) == ["tokens", "status"]    # decoding: the held status goes now
    # First tokens in every step (arrivals one after another) hold it only once.
    core._changed = True
    core._publish([Output("x", [1], None, None, 0)])
    core._publish([Output("y", [1], None, None, 0)])
    assert types(core._take()) == ["tokens", "tokens", "status"]
    while core.engine.has_work:
        core.step()
    # A request answered in one step leaves the engine idle: its status goes at once
    # (the idle loop's next iteration first waits for a message).
    core.handle(Generate(incarnation=1, request_id="c", prompt_ids=[7 + i for i in range(12)],
                         max_tokens=1, sampling=greedy))
    assert types(core.step()) == ["tokens", "status"] and not core.engine.has_work


class _StopBoot(Exception):
    """Ends a boot at its calibration: what is checked happened before it."""


@pytest.mark.parametrize("admission", [True, False])
def test_mlx_memory_limit_is_set_before_the_first_forward(
        loaded: object, monkeypatch: pytest.MonkeyPatch, admission: bool) -> None:
    """The calibration probe's forwards already run under MLX's limit: from the first
    forward, kernels queued ahead of the device wait at the worker's limit instead of
    passing it (MLX's own default is far above it). Without admission it is left alone."""
    import mlx.core as mx

    from common.config import WorkerConfig
    from worker import boot
    from worker.memory import MlxProbe

    probes: list[MlxProbe] = []
    seen: list[tuple[int | None, int]] = []

    def make_probe(limit_mb: int | None) -> MlxProbe:
        probes.append(MlxProbe(limit_mb))
        return probes[-1]

    def calibrate(model: object, static: costmodel.CostModel, **_: object) -> None:
        seen.append((probes[0]._active_limit, static.budget_bytes))
        raise _StopBoot

    monkeypatch.setattr(boot, "make_probe", make_probe)
    monkeypatch.setattr(boot, "calibrate", calibrate)
    before = mx.set_memory_limit(1 << 40)
    mx.set_memory_limit(before)
    cfg = WorkerConfig(model="demo", router="ipc:///tmp/nobody", memory_limit_mb=512,
                       unsafe_no_admission=not admission)
    try:
        with pytest.raises(_StopBoot):
            boot.build_server(cfg, loaded, 1, None)  # type: ignore[arg-type]
    finally:
        mx.set_memory_limit(before)
    limit, budget = seen[0]
    if admission:
        assert limit is not None and budget < limit <= 512 * MIB
    else:
        assert limit is None


class StuckGrammars:
    """A grammar compiler whose compile never finishes (a pathological grammar)."""

    def compile(self, grammar: str) -> Future[Any]:
        return Future()


def test_a_grammar_that_never_compiles_is_refused_after_its_deadline(loaded: object) -> None:
    """A request waits for its grammar outside the steps, where no stall check sees it: a
    compile that outlasts COMPILE_TIMEOUT_S ends its wait with a refusal."""
    from worker.core import COMPILE_TIMEOUT_S

    now = [100.0]
    core, _, _ = make_core(loaded, clock=lambda: now[0])
    core.engine.grammars = StuckGrammars()  # type: ignore[assignment]
    msg = Generate(incarnation=1, request_id="g", prompt_ids=[5, 6, 7], max_tokens=4,
                   sampling=SamplingParams(grammar='{"grammars": []}'))
    assert core.handle(msg) == [] and core.is_compiling
    assert [m for m in core.step() if m.type == "reject"] == []
    now[0] += COMPILE_TIMEOUT_S + 1
    (reject,) = [m for m in core.step() if m.type == "reject"]
    assert reject.request_id == "g" and reject.reason == "bad_grammar"  # type: ignore[attr-defined]
    assert not core.is_compiling and not core.engine.has_work


class FaultyCache(PrefixCache):
    """A prompt cache whose lookup and store raise for prompts that begin with POISON (a
    bug in the cache, as an assertion inside the block store once was)."""

    POISON = 499

    def lookup(self, prompt: Any, restore_room: Any = None) -> Any:
        if prompt[0] == self.POISON:
            raise AssertionError("a block in neither tier")
        return super().lookup(prompt, restore_room)

    def store(self, tokens: Any, cache: Any, *, keep: bool = False) -> bool:
        if tokens[0] == self.POISON:
            raise AssertionError("a parent that is not the chain's")
        return super().store(tokens, cache, keep=keep)


def test_a_fault_inside_the_prompt_cache_costs_that_request_its_reuse_and_nothing_else(
        loaded: object, caplog: pytest.LogCaptureFixture) -> None:
    core, _, faulty = make_core(loaded, cache_type=FaultyCache, kv_bytes_per_token=64 * 1024)
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    beside = Generate(incarnation=1, request_id="beside", prompt_ids=[5 + i for i in range(12)],
                      max_tokens=6, sampling=greedy)
    poisoned = Generate(incarnation=1, request_id="poisoned",
                        prompt_ids=[FaultyCache.POISON] + [6 + i for i in range(11)], max_tokens=6,
                        sampling=greedy)
    assert core.handle(beside) == []
    with caplog.at_level("ERROR", logger="worker.prefix_cache"):
        assert core.handle(poisoned) == []  # admitted, cold: no refusal
    assert "prompt cache lookup failed" in caplog.text
    done: dict[str, int] = {}
    for _ in range(200):
        for m in core.step():
            for row in getattr(m, "outputs", []):
                done[row.request_id] = done.get(row.request_id, 0) + len(row.token_ids)
        if not core.engine.has_work:
            break
    assert done == {"beside": 6, "poisoned": 6} and not core.broken
    # Its lookup and its store failed; the row beside it was stored as usual.
    assert faulty.report()["faults"] == 2 and faulty.report()["stores"] == 1


def finishes(messages: list[Message]) -> dict[str, str]:
    return {row.request_id: str(row.finish_reason) for m in messages if m.type == "tokens"
            for row in m.outputs if row.finish_reason is not None}  # type: ignore[attr-defined]


def test_a_row_that_finishes_in_a_step_the_oom_guard_fails_still_ends(loaded: object,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The step in which "short" reaches max_tokens peaks above the limit (--oom-guard
    raise): the running rows fail, and "short" ends as it finished. Its end was once thrown
    away with the step's outputs, after it had left the batch: its client waited for good."""
    from dataclasses import replace

    core, probe, _ = make_core(loaded, kv_bytes_per_token=4096)
    core.opts = replace(core.opts, oom_guard="raise")
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    core.handle(Generate(incarnation=1, request_id="short", prompt_ids=[5 + i for i in range(12)],
                         max_tokens=2, sampling=greedy))
    core.handle(Generate(incarnation=1, request_id="long", prompt_ids=[5 + i for i in range(20)],
                         max_tokens=50, sampling=greedy))
    ended: dict[str, str] = {}
    for _ in range(20):
        run = core.engine.running.get("short")
        if run is not None and run.decoding and run.generated + 1 >= run.max_tokens:
            monkeypatch.setattr(FakeProbe, "step_peak", lambda self: self.limit_bytes + 1)
        ended.update(finishes(core.step()))
        monkeypatch.undo()
        if ended:
            break
    assert ended == {"short": "length", "long": "error"} and not core.engine.running


def test_an_admitted_grammar_is_the_compile_its_admission_waited_for(loaded: object) -> None:
    """A's grammar waits to compile behind a slow one; meanwhile other grammars push it out
    of the compiler's cache. Once it compiled, A is admitted with that compile: looked up
    again it was compiled anew, queued behind whatever else was compiling, and waited for
    inside the step, the whole batch with it."""
    import json
    import threading

    from worker.shape import make_grammars

    core, _, _ = make_core(loaded, kv_bytes_per_token=4096)
    core.engine.grammars = grammars = make_grammars(loaded)  # type: ignore[arg-type]
    ahead = threading.Event()
    grammars._pool.submit(ahead.wait, 30)
    grammar = json.dumps({"grammars": [{"json_schema": {
        "type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}}]})
    core.handle(Generate(incarnation=1, request_id="A", prompt_ids=[5 + i for i in range(12)], max_tokens=3,
                         sampling=SamplingParams(temperature=0, grammar=grammar)))
    checked = core._compiling["A"][1]
    grammars._compiled.clear()  # as 64 other grammars would
    ahead.set()
    checked.result(timeout=30)
    behind = threading.Event()
    grammars._pool.submit(behind.wait, 5)  # another slow compile, queued after A's
    try:
        first = [row.request_id for m in core.step() if m.type == "tokens"
                 for row in m.outputs if row.token_ids]  # type: ignore[attr-defined]
        assert first == ["A"] and grammar not in grammars._compiled  # not compiled again
    finally:
        behind.set()
        grammars.close()


def run_to_end(core: WorkerCore, request_id: str) -> str | None:
    ended: dict[str, str] = {}
    for _ in range(50):
        ended.update(finishes(core.step()))
        if request_id in ended:
            break
    return ended.get(request_id)


@pytest.mark.parametrize("sampling", [
    {"logit_bias": [[5.0]]}, {"logit_bias": [[5, 1, 2]]}, {"temperature": 1.0, "min_p": 2.0},
    {"temperature": 1.0, "top_p": 0.0}, {"temperature": float("nan")}, {"top_k": -1},
])
def test_values_the_router_never_sends_are_refused_and_cost_no_one(loaded: object, sampling: dict[str, Any]) -> None:
    """Frames pass the decoder's type checks with values out of range: refused as bad
    requests. A logit_bias pair of one value once raised out of the socket loop (the worker
    exited), and a min_p above 1 left MLX's random state unusable for every later row."""
    from common.protocol import RejectReason

    core, _, _ = make_core(loaded)
    out = core.handle(Generate(incarnation=1, request_id="odd", prompt_ids=[5, 6, 7], max_tokens=3,
                               sampling=SamplingParams(**sampling)))
    assert [(m.type, m.reason) for m in out] == [("reject", RejectReason.BAD_REQUEST)]  # type: ignore[attr-defined]
    core.handle(Generate(incarnation=1, request_id="next", prompt_ids=[5, 6, 7], max_tokens=3,
                         sampling=SamplingParams(temperature=1.0, ignore_eos=True)))
    assert run_to_end(core, "next") == "length" and not core.broken


def test_an_admission_that_raises_refuses_that_request_alone(loaded: object,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from common.protocol import RejectReason

    core, _, _ = make_core(loaded)
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    core.handle(Generate(incarnation=1, request_id="running", prompt_ids=[5, 6, 7], max_tokens=4, sampling=greedy))
    real = core.gate.can_admit

    def fails_once(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(core.gate, "can_admit", real)
        raise RuntimeError("a bug in one admission")

    monkeypatch.setattr(core.gate, "can_admit", fails_once)
    out = core.handle(Generate(incarnation=1, request_id="bad", prompt_ids=[8, 9], max_tokens=4, sampling=greedy))
    assert [(m.type, m.reason) for m in out] == [("reject", RejectReason.REQUEST_FAILED)]  # type: ignore[attr-defined]
    assert "bad" not in core.engine.running
    assert run_to_end(core, "running") == "length" and not core.broken
