"""Compose a worker: probe memory, size the cost model, build the engine and the server."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from common import costmodel
from common.config import WorkerConfig
from common.curve import ClientKeys
from common.protocol import BOUNDARIES_ALL, BOUNDARIES_FIRST, BOUNDARIES_NONE, Hello
from common.version import __version__
from worker.block_disk import BlockDisk
from worker import kvcopy
from worker.block_store import BLOCK_TOKENS, BlockStore, blockable
from worker.calibrate import cache_key, calibrate
from worker.devices import make_probe
from worker.disk_cache import DiskTier, from_options
from worker.distributed import LockstepEngine, lead_probe
from worker.engine import Engine
from worker.loader import LoadedModel
from worker.memory import DeviceProbe, MemoryState, ModelShape, static_cost_model
from worker.prefix_cache import DEFAULT_BUDGET_SHARE, CacheTiers, PrefixCache
from worker.server import ServerOptions, WorkerServer
from worker.shape import make_grammars, model_shape
from worker.warmup import CACHED_KERNELS_PLAN, PLAN, refill, warm_up

log = logging.getLogger(__name__)

# Prompts prefilled together (mlx-lm's default).
PREFILL_BATCH_SIZE = 8
# Warm start's time bound: a CPU backend is slow, and every test router pays it (the CPU
# has no kernels to compile: half a second warms the first chunks and decode batches, and
# the suite's ~90 worker starts spent 45 s more at 1 s); a GPU's first kernels can take
# tens of seconds to compile, better before "ready" than after.
# The largest prefill chunk when --prefill-step-size is 0. A GPU prefills thousands of
# tokens per second (the H200: a 1024-token prompt in ~0.2 s), so a 512 cap cut a 1024-token
# prompt in two passes and its first token came later than on mlx_lm.server (2048); the
# pacer still sizes chunks by measured step time and the gate by memory.
PREFILL_STEP = {"cpu": 512}
PREFILL_STEP_GPU = 2048


def prefill_step(flag: int, device: str) -> int:
    return flag or PREFILL_STEP.get(device, PREFILL_STEP_GPU)


WARMUP_BUDGET_S = {"cpu": 0.5}
WARMUP_BUDGET_DEFAULT_S = 60.0


def warmup_plan(device: str, calibration_source: str) -> tuple[tuple[str, int], ...]:
    """The whole plan, but on a GPU that ran this model before (its calibration came from
    the cache, its kernels are in MLX's disk cache): the first requests' parts only."""
    return CACHED_KERNELS_PLAN if device != "cpu" and calibration_source == "cache" else PLAN


def pacer_seeds(prefill: list[tuple[int, float]], plan: tuple[tuple[str, int], ...]) -> list[tuple[int, float]]:
    """The warm start's prefill steps the chunk pacer starts from: all of them, in order, but
    after the short plan its largest alone. There the 16-token part's time is mostly
    kernel loads (0.5-0.7 s on the H200, ~30 tokens/s): taken first, it would leave the
    pacer's estimate near 600 tokens/s after the 512-token chunk (the pacer grows slowly
    on faster steps), so a restarted worker's first long prompt would go in small chunks."""
    if plan is CACHED_KERNELS_PLAN and prefill:
        return [max(prefill, key=lambda step: step[0])]
    return prefill


class NotEnoughMemory(RuntimeError):
    """Even a minimal request cannot be served. Will fail again: not worth restarting."""


def resolve_oom_guard(cfg: WorkerConfig, device: str) -> str:
    if cfg.oom_guard is not None:
        return cfg.oom_guard
    return "abort" if device != "metal" and cfg.memory_limit_mb is not None else "off"


def build_server(cfg: WorkerConfig, loaded: LoadedModel, incarnation: int,
                 cache_dir: Path | None, curve: ClientKeys | None = None,
                 env: Mapping[str, str] | None = None, group: Any = None) -> WorkerServer:
    """``group``: rank 0 of an ``mx.distributed`` group (``worker/distributed.py``): the
    calibration probe and every engine step run on all ranks in lockstep."""
    probe = make_probe(cfg.memory_limit_mb)
    shape = model_shape(loaded)
    # Everything this process holds beyond the weights (on CUDA the context and library
    # workspaces that MLX's allocator never counts): the budget must not promise it.
    idle = probe.read()
    baseline = max(0, idle.used_bytes - shape.weights_bytes)
    step = prefill_step(cfg.prefill_step_size, probe.device)
    static = static_cost_model(shape, limit_bytes=probe.limit_bytes, baseline_bytes=baseline,
                               prefill_step_tokens=step,
                               prefill_batch_size=PREFILL_BATCH_SIZE,
                               attention_copies=probe.device != "cpu",
                               layerwise_copy_bytes=kvcopy.layerwise_copy_bytes())
    key = cache_key(loaded.fingerprint, mx.__version__, probe.device)
    # On a GPU the probe's chunks reach the full step; on a CPU they stay small (slow).
    stretch = 1 if probe.device == "cpu" else 4
    # The calibrated model replaces the static one below (the budget is the same).
    memory = MemoryState(probe=probe, model=static, weights_bytes=shape.weights_bytes,
                         baseline_bytes=baseline,
                         active_baseline_bytes=max(0, idle.active_bytes - shape.weights_bytes))
    # From the first forward (the probe's, the warm start's) kernels queued ahead of the
    # device wait at the limit rather than pass it; the gate keeps this up to date later.
    mlx_limit = None if cfg.unsafe_no_admission else memory.mlx_limit_bytes
    if mlx_limit is not None:
        probe.bound_active(mlx_limit)
    if group is not None:
        lead_probe(group, stretch, mlx_limit)
        cache_dir = None  # the followers probe too: rank 0 must not skip it from a cache
    model, calibration = calibrate(loaded.model, static, cache_dir=cache_dir, key=key, stretch=stretch)
    max_tokens = costmodel.max_request_tokens(model)
    if max_tokens < min(costmodel.MIN_REQUEST_TOKENS, shape.context_length):
        raise NotEnoughMemory(_breakdown(probe.limit_bytes, shape, model, baseline))
    memory.model = model
    memory.calibration = {
        "source": calibration.source, "seconds": round(calibration.seconds, 3),
        "prefill_b_bytes": round(calibration.prefill_b_bytes), "prefill_a_bytes": round(calibration.prefill_a_bytes),
        "prefill_c_bytes": round(calibration.prefill_c_bytes, 3),
        "prefill_d_bytes": round(calibration.prefill_d_bytes),
        "kv_bytes_per_token": calibration.kv_bytes_per_token,
        "holdout_measured_over_predicted": calibration.holdout_ratio}
    grammars = make_grammars(loaded)
    engine = make_engine(group, loaded.model, list(loaded.eos_token_ids),
                    prefill_step_size=step,
                    prefill_batch_size=PREFILL_BATCH_SIZE, max_batch_size=cfg.max_batch_size,
                    grammars=grammars)
    plan = warmup_plan(probe.device, calibration.source)
    warm = warm_up(engine, model, vocab_size=shape.vocab_size, max_chunk=step,
                   max_batch=cfg.max_batch_size,
                   budget_s=WARMUP_BUDGET_S.get(probe.device, WARMUP_BUDGET_DEFAULT_S),
                   plan=plan,
                   holdout_ratio=calibration.holdout_ratio)
    probe.clear_cache()
    model = settle_baseline(probe, memory, model, shape.weights_bytes)
    if costmodel.max_request_tokens(model) < min(costmodel.MIN_REQUEST_TOKENS, shape.context_length):
        raise NotEnoughMemory(_breakdown(probe.limit_bytes, shape, model, memory.baseline_bytes))
    refill(engine, model, vocab_size=shape.vocab_size)
    max_tokens = costmodel.max_request_tokens(model)
    memory.warmup_s = round(warm.seconds, 3)
    max_running = cfg.max_running_requests or cfg.max_batch_size
    admission = not cfg.unsafe_no_admission
    layers = make_prompt_cache(loaded.model)
    cache = make_prefix_cache(cfg, model, fingerprint=loaded.fingerprint, num_layers=len(layers),
                              blocks=blockable(layers),
                              disk_for=lambda max_pending_bytes, make: from_options(
        disk_bytes=cfg.prompt_cache_disk_bytes, fingerprint=loaded.fingerprint, env=env or {},
        root=Path(cfg.prompt_cache_dir).expanduser() if cfg.prompt_cache_dir else None,
        max_pending_bytes=max_pending_bytes, make=make))
    hello = Hello(
        incarnation=incarnation, pid=os.getpid(), package_version=__version__,
        model_id=loaded.model_id, fingerprint=loaded.fingerprint,
        context_length=shape.context_length, tokenizer_path=str(loaded.path),
        eos_token_ids=list(loaded.eos_token_ids), admission=admission,
        cost_model=model.to_dict(), boundaries=boundaries_used(cache, engine.can_trim),
    )
    opts = ServerOptions(router_addr=cfg.router, incarnation=incarnation,
                         oom_guard=resolve_oom_guard(cfg, probe.device), admission=admission,
                         max_running=max_running, vocab_size=shape.vocab_size,
                         wedge_after_steps=cfg.test_wedge_after_steps,
                         grow_scale_on_signal=cfg.test_grow_scale, curve=curve)
    log.info("device %s, limit %d MiB, weights %d MiB, budget %d MiB, KV %d B/token, "
             "max request %d tokens, oom guard %s, admission %s",
             probe.device, probe.limit_bytes >> 20, shape.weights_bytes >> 20,
             model.budget_bytes >> 20, model.kv_bytes_per_token, max_tokens, opts.oom_guard,
             "on" if admission else "OFF")
    server = WorkerServer(opts, engine, memory, hello, cache=cache)
    for tokens, seconds in pacer_seeds(warm.prefill, plan):  # this device's real prefill speed
        server.core.pacer.observe(tokens, seconds)
    return server


def settle_baseline(probe: DeviceProbe, memory: MemoryState, model: costmodel.CostModel,
                    weights_bytes: int) -> costmodel.CostModel:
    """Measure again, once the warm start has run, what this process holds beyond the
    weights with nothing running, and take any growth off the budget.

    At boot the baseline is only the runtime's start-up memory; kernels loaded and library
    workspaces made by the first forwards come later (on the H200, ~2 GB of GPU memory that
    MLX's allocator never counts appeared after the warm start, and a 3 GiB budget then
    flapped in and out of "pressure" from memory it had never promised)."""
    probe.invalidate()
    idle = probe.read()
    # Only growth counts: memory the runtime gave back since boot may be taken again.
    grown = idle.used_bytes - weights_bytes - memory.baseline_bytes
    if grown <= 0:
        return model
    log.log(logging.INFO if grown >= 1 << 20 else logging.DEBUG, "after the warm start this process holds %d MiB more with nothing running "
             "(kernels, library workspaces): budget %d -> %d MiB", grown >> 20,
             model.budget_bytes >> 20, (model.budget_bytes - grown) >> 20)
    memory.baseline_bytes += grown
    model = dataclasses.replace(model, budget_bytes=max(0, model.budget_bytes - grown))
    memory.model = model
    return model


def make_engine(group: Any, model: Any, eos_token_ids: list[int], **kwargs: Any) -> Engine:
    if group is None:
        return Engine(model, eos_token_ids, **kwargs)
    return LockstepEngine(group, model, eos_token_ids, **kwargs)


def boundaries_used(cache: CacheTiers | None, can_trim: bool) -> str:
    """Which message boundaries this worker's engine cuts a prompt at (``Engine._cuts``),
    told to the router in the hello so that it renders no other prefix."""
    if cache is None:
        return BOUNDARIES_NONE
    return BOUNDARIES_FIRST if can_trim else BOUNDARIES_ALL


def make_prefix_cache(cfg: WorkerConfig, model: costmodel.CostModel, *, fingerprint: str = "",
                      num_layers: int = 0, blocks: bool = False,
                      disk_for: Callable[[int, type], Any] = lambda *_: None) -> CacheTiers | None:
    """The RAM tier, over the disk tier ``disk_for(max_pending_bytes, its class)`` makes, if
    any (``--no-prompt-cache`` turns both off): KV blocks shared across sequences
    (``worker/block_store.py``) where the model's caches can be cut by tokens, else whole
    sequences (``worker/prefix_cache.py``, ``worker/disk_cache.py``). What is queued for
    the disk writer keeps its arrays until written: the gate counts it (``CacheLedger``)
    and the queue holds at most as many bytes as the RAM tier itself."""
    if cfg.no_prompt_cache:
        log.info("prompt cache off")
        return None
    max_bytes, share = cfg.prompt_cache_bytes, None
    if max_bytes is None:
        share = DEFAULT_BUDGET_SHARE
        max_bytes = int(model.budget_bytes * share)
    on = max_bytes > 0 and cfg.prompt_cache_entries > 0
    disk = disk_for(max_bytes, BlockDisk if blocks else DiskTier) if on else None
    log.info("prompt cache (%s): up to %d MiB and %d sequences in RAM%s",
             f"blocks of {BLOCK_TOKENS} tokens" if blocks else "whole sequences", max_bytes >> 20,
             cfg.prompt_cache_entries,
             f", up to {disk.max_bytes >> 20} MiB on disk in {disk.dir}" if disk is not None else ", no disk tier")
    if blocks:
        return BlockStore(fingerprint=fingerprint, num_layers=num_layers, max_bytes=max_bytes,
                          max_entries=cfg.prompt_cache_entries, disk=disk, budget_share=share)
    return PrefixCache(max_bytes=max_bytes, max_entries=cfg.prompt_cache_entries, disk=disk,
                       budget_share=share)


def _breakdown(limit: int, shape: ModelShape, model: Any, baseline: int) -> str:
    mib = 1 << 20
    return (
        f"not enough memory to serve even a {costmodel.MIN_REQUEST_TOKENS}-token request: "
        f"limit {limit} B ({limit // mib} MiB), weights {shape.weights_bytes} B "
        f"({shape.weights_bytes // mib} MiB), runtime baseline {baseline} B ({baseline // mib} MiB: "
        f"what the process holds beyond the weights with nothing running), "
        f"KV {model.kv_bytes_per_token} B/token, "
        f"budget left {model.budget_bytes} B. Remedy: raise --memory-limit-mb, close other "
        f"apps, or use a smaller or more quantized model.")
