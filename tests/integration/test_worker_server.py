"""WorkerServer's steps around the gate, on the demo model with scripted memory readings.

The engine is real (mlx-lm's BatchGenerator on the demo model); only the device readings
are fake, because the process footprint that the runtime set-aside reacts to (NVML's
per-process bytes on CUDA) does not exist on Linux's CPU backend. No router: the server's
socket connects to an address nobody binds, and what it would publish is read from it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from common import costmodel
from common.protocol import Generate, Hello, SamplingParams
from tests.fakes import FakeProbe
from worker.engine import Engine, Output
from worker.loader import load_model
from worker.memory import MemoryState
from worker.prefix_cache import PrefixCache
from worker.server import ServerOptions, WorkerServer

MIB = 1 << 20
WEIGHTS = 10 * MIB
OUTSIDE = 50 * MIB           # the runtime's idle memory MLX does not count
LIMIT = 1024 * MIB


@pytest.fixture(scope="module")
def loaded(cache_home: Path) -> object:
    return load_model("demo", {"XDG_CACHE_HOME": str(cache_home)})


def make_server(loaded: object, tmp_path: Path) -> tuple[WorkerServer, FakeProbe, PrefixCache]:
    engine = Engine(loaded.model, list(loaded.tokenizer.eos_token_ids), prefill_step_size=64,  # type: ignore[attr-defined]
                    prefill_batch_size=8, max_batch_size=8)
    probe = FakeProbe(limit_bytes=LIMIT, active_bytes=WEIGHTS, footprint_bytes=WEIGHTS + OUTSIDE)
    # A large KV per token: a short request (fast on the CPU) is a large promise.
    model = costmodel.CostModel(kv_bytes_per_token=MIB, num_layers=4, prefill_a_bytes=20_000.0,
                                prefill_c_bytes=8.0, prefill_b_bytes=MIB,
                                budget_bytes=LIMIT - WEIGHTS - OUTSIDE - 16 * MIB, context_length=4096,
                                prefill_step_tokens=64, prefill_batch_size=8)
    memory = MemoryState(probe=probe, model=model, weights_bytes=WEIGHTS, baseline_bytes=OUTSIDE,
                         active_baseline_bytes=0)
    cache = PrefixCache(max_bytes=model.budget_bytes // 2, max_entries=8, budget_share=0.5)
    hello = Hello(incarnation=1, pid=0, package_version="test", model_id="demo", fingerprint="f",
                  context_length=4096, tokenizer_path="", eos_token_ids=[], admission=True)
    opts = ServerOptions(router_addr=f"ipc://{tmp_path}/nobody.sock", incarnation=1, oom_guard="off",
                         admission=True, max_running=8, vocab_size=512)
    return WorkerServer(opts, engine, memory, hello, cache=cache), probe, cache


def test_the_runtimes_excess_moves_the_budget_the_cache_bound_and_the_published_model(
        loaded: object, tmp_path: Path) -> None:
    server, probe, cache = make_server(loaded, tmp_path)
    try:
        server.admit(Generate(incarnation=1, request_id="r1", prompt_ids=[3 + i % 500 for i in range(200)],
                              max_tokens=20, sampling=SamplingParams(temperature=0, ignore_eos=True)))
        assert server.engine.running and server.memory.reserved_bytes > 0
        budget = server.gate.model.budget_bytes
        server._changed = False
        # While the step runs the process holds far more than MLX counts: counted as used,
        # that is less than the running request was promised.
        probe.footprint_bytes = probe.active_bytes + OUTSIDE + 750 * MIB
        server.memory.refresh()
        assert server.memory.headroom_bytes() < server.memory.reserved_bytes
        outputs = server.relieve_pressure()
        assert outputs == [] and not server.gate.under_pressure          # nothing stopped
        assert server.memory.runtime_bytes > 0
        assert server.gate.model.budget_bytes == budget - server.memory.runtime_bytes
        assert cache.max_bytes == int(server.gate.model.budget_bytes * 0.5)  # the RAM tier follows
        assert server._changed                                              # the router hears of it
        report = server.memory.report(running=1, max_running=8)
        assert report.cost_model["budget_bytes"] == server.gate.model.budget_bytes
        assert report.runtime_transient_bytes == server.memory.runtime_bytes
        # The request still runs to its end.
        done = []
        for _ in range(400):
            done += [o for o in server.step() if o.finish_reason is not None]
            if done:
                break
        assert [o.request_id for o in done] == ["r1"]
    finally:
        server.sock.close(0)
        server.ctx.term()


def test_a_first_tokens_status_waits_one_iteration_and_never_two(loaded: object, tmp_path: Path) -> None:
    """The status that an admission changed goes out after the first token, one iteration
    later (read before the token, it would delay the token's stream in the router), held
    at most once in a row, and not at all when the engine is left idle."""
    server, _, _ = make_server(loaded, tmp_path)
    sent: list[str] = []
    server.send = lambda msg: sent.append(msg.type)  # type: ignore[method-assign]
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    server._router_seen_at = math.inf          # a router that is heard: no hello resent
    try:
        server.publish_status(force=True)
        sent.clear()
        server.handle(Generate(incarnation=1, request_id="a", prompt_ids=[5 + i for i in range(12)],
                               max_tokens=8, sampling=greedy))
        server.loop_once()                      # its chunk and first token, in one step
        assert sent == ["tokens"]
        server.loop_once()                      # decoding: the held status goes now
        assert sent == ["tokens", "tokens", "status"]
        # First tokens in every step (arrivals one after another) hold it only once.
        sent.clear()
        server._changed = True
        server.publish([Output("x", [1], None, None, 0)])
        server.publish([Output("y", [1], None, None, 0)])
        assert sent == ["tokens", "tokens", "status"]
        while server.engine.has_work:
            server.loop_once()
        # A request answered in one step leaves the engine idle: its status goes at once
        # (the idle loop's next iteration first waits for a message).
        sent.clear()
        server.handle(Generate(incarnation=1, request_id="c", prompt_ids=[7 + i for i in range(12)],
                               max_tokens=1, sampling=greedy))
        server.loop_once()
        assert not server.engine.has_work and sent == ["tokens", "status"]
    finally:
        server.sock.close(0)
        server.ctx.term()


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
