"""Memory: the device probe (MLX's metal | cpu), the static cost model, the Status report.

Used = active + cache (and on macOS no less than the process's phys_footprint, because
MLX's counters can undercount it). Headroom = max(0, min(limit − used, system available)).
Readings are cheap counters; the one syscall (system available memory) is rate-limited so
a reading never stalls the engine loop.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import psutil

from common.costmodel import CostModel, max_request_tokens
from common.protocol import MemoryReport

log = logging.getLogger(__name__)

# Without --memory-limit-mb on a CPU box, use this share of RAM: the OS and other apps
# need the rest, and Metal's own recommendation is in the same range (~65-75 %).
CPU_DEFAULT_LIMIT_FRACTION = 0.6
# Reserve this share of the memory above the weights (at least MIN_MARGIN_BYTES) for what
# we do not model. Not of the whole limit: the weights are measured exactly, so a share of
# them only took room from requests (on an 8B 4-bit model with 1 GiB above its weights, 5 %
# of the limit was 285 MB, a quarter of what was left).
MARGIN_FRACTION = 0.05
MIN_MARGIN_BYTES = 16 * 1024 * 1024
# System-available memory is re-read at most this often (it is a syscall).
SYSTEM_READ_INTERVAL_S = 0.25


@dataclass(slots=True)
class Reading:
    active_bytes: int
    cache_bytes: int
    peak_bytes: int
    footprint_bytes: int
    system_available_bytes: int

    @property
    def used_bytes(self) -> int:
        return self.used_beside(0)

    def used_beside(self, set_aside: int) -> int:
        """Used memory when ``set_aside`` bytes of the process's footprint are already taken
        off the budget (the runtime's own, ``MemoryState.runtime_bytes``)."""
        return max(self.active_bytes + self.cache_bytes, self.footprint_bytes - set_aside)


class DeviceProbe(Protocol):
    device: str
    limit_bytes: int

    def read(self) -> Reading: ...
    def step_peak(self) -> int:
        """The allocator's peak since the last ``reset_peak`` (what one step reached)."""
    def clear_cache(self) -> None: ...
    def reset_peak(self) -> None: ...
    def bound_cache(self, nbytes: int) -> None:
        """Let MLX's buffer cache keep at most ``nbytes`` (never more than its default)."""
    def bound_active(self, nbytes: int) -> None:
        """MLX's memory limit: past ``nbytes`` of active memory its evaluation waits for the
        device instead of queueing more kernels (whose buffers would add up)."""
    def memory_limit(self) -> int | None:
        """MLX's memory limit as MLX has it now (None: the probe has no MLX)."""
    def invalidate(self) -> None:
        """The next read asks the system again (figures read through a slow call, such as
        the host's available memory or a GPU's, are otherwise reused for a moment)."""


def _cache_limit(mx: Any) -> int:
    """MLX's buffer cache limit now (it has no getter: setting returns the previous one)."""
    previous = int(mx.set_cache_limit(0))
    mx.set_cache_limit(previous)
    return previous


class MlxProbe:
    """Live readings from MLX's allocator, for Metal or the CPU backend."""

    def __init__(self, memory_limit_mb: int | None) -> None:
        import mlx.core as mx

        self._mx = mx
        self.device = "metal" if mx.metal.is_available() else "cpu"
        self.device_name = str(mx.device_info().get("device_name") or self.device)
        total = psutil.virtual_memory().total
        if self.device == "metal":
            info = mx.device_info()
            device_limit = int(info.get("max_recommended_working_set_size", total))
        else:
            device_limit = int(total * CPU_DEFAULT_LIMIT_FRACTION)
        self.limit_bytes = min(device_limit, memory_limit_mb * 2**20) if memory_limit_mb else device_limit
        # On CPU the limit is only advisory, and MLX's own buffer cache limit (32 MiB) is
        # left alone: raising it to the limit (as this probe once did, to make the cache
        # behave as on Metal) made decode steps that follow a batch merge or filter take
        # 0.5-2.8 s instead of 0.1 s, and cost 20-30% of throughput at 32 streams (in-process
        # mlx-lm with the raised limit: 218 -> 157 tok/s on the demo model).
        self._footprint = _phys_footprint_reader() if sys.platform == "darwin" else None
        self._system_available = psutil.virtual_memory().available
        self._system_read_at = time.monotonic()
        self._peak_bytes = 0
        self._pool_default = self._pool_limit = _cache_limit(mx)
        self._active_limit: int | None = None

    def read(self) -> Reading:
        mx = self._mx
        now = time.monotonic()
        if now - self._system_read_at >= SYSTEM_READ_INTERVAL_S:
            self._system_available = psutil.virtual_memory().available
            self._system_read_at = now
        active, cache = mx.get_active_memory(), mx.get_cache_memory()
        self._peak_bytes = max(self._peak_bytes, mx.get_peak_memory())
        return Reading(
            active_bytes=active,
            cache_bytes=cache,
            peak_bytes=self._peak_bytes,
            footprint_bytes=self._footprint() if self._footprint else 0,
            system_available_bytes=self._system_available,
        )

    def step_peak(self) -> int:
        """Peak of MLX's allocator since the last reset_peak()."""
        peak = self._mx.get_peak_memory()
        self._peak_bytes = max(self._peak_bytes, peak)
        return peak

    def clear_cache(self) -> None:
        self._mx.clear_cache()
        self.invalidate()  # what the cache gave back shows in the system's figures

    def reset_peak(self) -> None:
        self._mx.reset_peak_memory()

    def invalidate(self) -> None:
        self._system_read_at = -math.inf

    def bound_cache(self, nbytes: int) -> None:
        # MLX keeps freed buffers up to its cache limit (on Metal and CUDA by default a
        # large share of the device, far above a --memory-limit-mb); the gate bounds it to
        # what no request was promised, so MLX's own pool never eats a promise and the gate
        # never sees its own cache as memory another process took. Never raised above
        # MLX's default (on the CPU backend a larger pool made steps slower).
        limit = max(0, min(self._pool_default, nbytes))
        if limit != self._pool_limit:
            self._mx.set_cache_limit(limit)
            self._pool_limit = limit

    def bound_active(self, nbytes: int) -> None:
        # MLX evaluates a graph by queueing kernels for the device, and each kernel's buffers
        # stay until the device has run it; the host runs ahead, so a forward's buffers add
        # up across layers. On the H200 a 2048-token chunk at a 4k context held 14.5 GB that
        # way, against 1.4 GB run in order, and a decode step of 32 rows at 4k 8.7 GB against
        # 1.2 GB (bench/README.md, "Run-ahead"). Past its memory limit MLX waits for queued
        # kernels before it goes on; that limit defaults to far above ours (Metal: 1.5x the
        # recommended working set; CUDA: most of the card), so the worker sets it to what
        # the gate lets MLX hold. A forward that needs more than that in order still gets it
        # (MLX allocates anyway when nothing is queued): the limit bounds the run-ahead, not
        # the work.
        limit = max(1, int(nbytes))
        if limit != self._active_limit:
            self._mx.set_memory_limit(limit)
            self._active_limit = limit

    def memory_limit(self) -> int | None:
        return int(self._mx.get_memory_limit())


def _phys_footprint_reader() -> Any:
    """macOS: proc_pid_rusage(RUSAGE_INFO_V2).ri_phys_footprint, what Activity Monitor shows."""
    libc_path = ctypes.util.find_library("c")
    if not libc_path:
        return None
    libc = ctypes.CDLL(libc_path)
    pid = ctypes.c_int(psutil.Process().pid)

    class RUsageInfoV2(ctypes.Structure):
        _fields_ = [("uuid", ctypes.c_uint8 * 16)] + [
            (name, ctypes.c_uint64) for name in (
                "user_time", "system_time", "pkg_idle_wkups", "interrupt_wkups", "pageins",
                "wired_size", "resident_size", "phys_footprint", "proc_start_abstime",
                "proc_exit_abstime", "child_user_time", "child_system_time",
                "child_pkg_idle_wkups", "child_interrupt_wkups", "child_pageins",
                "child_elapsed_abstime", "diskio_bytesread", "diskio_byteswritten")]

    def read() -> int:
        info = RUsageInfoV2()
        if libc.proc_pid_rusage(pid, 2, ctypes.byref(info)) != 0:
            return 0
        return int(info.phys_footprint)

    return read


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the cost model needs to know of a loaded model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int
    context_length: int
    weights_bytes: int


def safety_margin(limit_bytes: int, weights_bytes: int) -> int:
    """What the budget leaves unplanned: a share of the memory above the weights."""
    return max(int(max(limit_bytes - weights_bytes, 0) * MARGIN_FRACTION), MIN_MARGIN_BYTES)


def static_cost_model(shape: ModelShape, *, limit_bytes: int, baseline_bytes: int,
                      prefill_step_tokens: int, prefill_batch_size: int,
                      attention_copies: bool = True, layerwise_copy_bytes: int = 0) -> CostModel:
    """The cost model before calibration: sizes from the model's shape alone.
    ``layerwise_copy_bytes``: the engine copies layers this large one at a time (0: never)."""
    from common.costmodel import kv_bytes_per_token

    act = 4  # activations are float32 on CPU and for softmax on any device
    # Per chunk token: residual stream and norms (~6·hidden), q/k/v/o (~4·heads·head_dim),
    # the MLP's three projections, and the logits row mlx-lm computes for every position.
    prefill_a = act * (6 * shape.hidden_size + 4 * shape.num_heads * shape.head_dim
                       + 3 * shape.intermediate_size + shape.vocab_size)
    # Per chunk token per context token: attention scores and their softmax copy.
    prefill_c = 2 * act * shape.num_heads
    kv_per_token = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype_bytes)
    # Per row per context token: on a GPU, attention reads one layer's keys and values
    # through a copy (on the H200, run in order: ~8.5 KB per context token per decode row
    # of an 8B model, 2.1x a layer's KV; charged as 2x). A floor, for the probe's contexts
    # are short. ``attention_copies`` False (MLX's CPU backend, where the probe measures
    # none in order): no floor, the probe's own figure stands.
    prefill_d = 2 * kv_per_token / max(shape.num_layers, 1) if attention_copies else 0.0
    budget = limit_bytes - shape.weights_bytes - baseline_bytes - safety_margin(limit_bytes, shape.weights_bytes)
    return CostModel(
        kv_bytes_per_token=kv_per_token,
        num_layers=shape.num_layers,
        prefill_a_bytes=float(prefill_a),
        prefill_c_bytes=float(prefill_c),
        prefill_d_bytes=float(prefill_d),
        budget_bytes=max(budget, 0),
        context_length=shape.context_length,
        prefill_step_tokens=prefill_step_tokens,
        prefill_batch_size=prefill_batch_size,
        layerwise_copy_bytes=layerwise_copy_bytes,
        vocab_size=shape.vocab_size,
    )


@dataclass(slots=True)
class MemoryState:
    """Facts learned at run time: the live reading, what is reserved, the worst ratio."""

    probe: DeviceProbe
    model: CostModel
    weights_bytes: int
    baseline_bytes: int
    # MLX's own active bytes at idle, beyond the weights (≤ baseline_bytes, which also
    # holds what MLX never counts, e.g. a CUDA context): what allocations are measured from.
    active_baseline_bytes: int | None = None
    reserved_bytes: int = 0
    # What the runtime holds beyond MLX's count and the idle baseline while steps run
    # (``runtime_excess``), learned in service and set aside from the budget: the process's
    # own memory, never another process's, so it is charged, not treated as pressure.
    runtime_bytes: int = 0
    worst_measured_over_predicted: float = 0.0
    last: Reading | None = None
    calibration: dict[str, Any] = field(default_factory=dict)  # the startup fit, as reported
    warmup_s: float | None = None

    @property
    def idle_active_bytes(self) -> int:
        """What MLX's allocator holds with nothing running: weights and its baseline."""
        extra = self.baseline_bytes if self.active_baseline_bytes is None else self.active_baseline_bytes
        return self.weights_bytes + extra

    @property
    def mlx_limit_bytes(self) -> int:
        """What MLX's allocator may hold before its evaluation waits for the device: the
        weights, its idle baseline and the budget (``DeviceProbe.bound_active``)."""
        return self.idle_active_bytes + self.model.budget_bytes

    @property
    def outside_bytes(self) -> int:
        """The idle baseline MLX's allocator does not count (on CUDA: the context, loaded
        kernels, library workspaces)."""
        if self.active_baseline_bytes is None:
            return 0
        return max(0, self.baseline_bytes - self.active_baseline_bytes)

    def refresh(self) -> Reading:
        self.last = self.probe.read()
        return self.last

    def used_bytes(self, r: Reading) -> int:
        # The runtime's learned excess is set aside from the budget, so it is not used
        # memory that anything promised could be short of.
        return r.used_beside(self.runtime_bytes)

    def runtime_excess(self, r: Reading) -> int:
        """What the process holds (its device footprint) beyond MLX's active and cache
        bytes, the idle baseline outside MLX and what was already set aside (0 where the
        probe reads no footprint, as on Linux's CPU backend)."""
        if not r.footprint_bytes:
            return 0
        return max(0, r.footprint_bytes - self.runtime_bytes - r.active_bytes - r.cache_bytes
                   - self.outside_bytes)

    def headroom_bytes(self) -> int:
        r = self.last or self.refresh()
        return max(0, min(self.probe.limit_bytes - self.used_bytes(r), r.system_available_bytes))

    def report(self, *, running: int, max_running: int) -> MemoryReport:
        """The memory part of the Status report (the server adds its loop's figures)."""
        r = self.refresh()
        return MemoryReport(
            device=self.probe.device,
            device_name=getattr(self.probe, "device_name", self.probe.device),
            limit_bytes=int(self.probe.limit_bytes),
            budget_bytes=int(self.model.budget_bytes),
            active_bytes=int(r.active_bytes),
            cache_bytes=int(r.cache_bytes),
            peak_bytes=int(r.peak_bytes),
            headroom_bytes=int(self.headroom_bytes()),
            reserved_bytes=int(self.reserved_bytes),
            weights_bytes=int(self.weights_bytes),
            baseline_bytes=int(self.baseline_bytes),
            runtime_transient_bytes=int(self.runtime_bytes),
            kv_bytes_per_token=int(self.model.kv_bytes_per_token),
            safe_prefill_chunk=int(self.model.prefill_step_tokens),
            max_running_requests=max_running,
            context_length=int(self.model.context_length),
            max_request_tokens=int(max_request_tokens(self.model)),
            running=running,
            system_available_bytes=int(r.system_available_bytes),
            worst_measured_over_predicted=round(self.worst_measured_over_predicted, 4),
            reported_at=time.time(),
            cost_model=self.model.to_dict(),
            calibration=self.calibration,
            warmup_s=self.warmup_s,
        )


@dataclass(frozen=True, slots=True)
class PressureAction:
    """What to do when memory shrank under running work (another app took it)."""

    admit: bool            # False: take nothing new until the shortage ends
    chunk_tokens: int      # the prefill chunk to use now
    evict: int             # how many of the newest running requests to cancel (503, retryable)


def pressure_action(m: CostModel, *, headroom_bytes: int, reserved_bytes: int,
                    allocated_bytes: int, running_totals: list[int], chunk_tokens: int) -> PressureAction:
    """Stop admitting, then shrink the chunk, and only then evict the newest requests.

    ``running_totals`` is oldest first. ``reserved - allocated`` is what running requests
    were promised but have not used yet; while headroom covers it there is no pressure.
    """
    from common.costmodel import MIN_CHUNK_TOKENS, batch_cost_bytes, safe_prefill_chunk

    promised = max(0, reserved_bytes - allocated_bytes)
    if headroom_bytes >= promised:
        return PressureAction(admit=True, chunk_tokens=chunk_tokens, evict=0)
    longest = max(running_totals, default=0)
    chunk = min(chunk_tokens, safe_prefill_chunk(m, max(0, headroom_bytes - promised), longest or 1))
    # Evict newest first until what the rest were promised fits in what is left.
    totals = list(running_totals)
    evict = 0
    while len(totals) > 1:
        need = batch_cost_bytes(m, len(totals), max(totals), MIN_CHUNK_TOKENS, 0, max(totals))
        if need - allocated_bytes <= headroom_bytes:
            break
        totals.pop()
        evict += 1
    return PressureAction(admit=False, chunk_tokens=chunk, evict=evict)


def wait_for_memory(read_available: Any, needed_bytes: int, timeout_s: float,
                    sleep: Any = time.sleep, clock: Any = time.monotonic) -> bool:
    """A restarted worker waits (bounded) for memory its dead predecessor still held.

    The OS frees a killed process's memory asynchronously (and on macOS, Metal's wired
    memory a little later); loading into it at once would undercount headroom.
    """
    deadline = clock() + timeout_s
    while True:
        available = read_available()
        if available >= needed_bytes:
            return True
        if clock() >= deadline:
            return False
        sleep(min(0.25, max(0.0, deadline - clock())))
