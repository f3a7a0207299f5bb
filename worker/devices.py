"""Which device this worker runs on, and the probe for MLX's CUDA backend.

`make_probe` picks the probe for the backend MLX uses in this process: Metal, then CUDA,
then the CPU. Metal and the CPU use `worker.memory.MlxProbe`; CUDA uses `CudaProbe` here.

On CUDA the memory that matters is the GPU's, not the host's: the limit is
min(`--memory-limit-mb`, the GPU's total memory) and `Reading.system_available_bytes` is
the GPU's free memory (what every process on the card leaves), so host RAM never caps GPU
headroom. Both come from `mx.device_info()`, whose CUDA backend reports `total_memory` and
`free_memory` (through NVML, else cudaMemGetInfo), and, where an MLX build does not,
from NVML through `nvidia-ml-py` (`pip install 'mlx-headroom[cuda]'`), an optional import.
When NVML is there it also gives this process's own GPU memory (CUDA context, cuBLAS
workspaces: memory MLX's allocator never counts) as `footprint_bytes`, the CUDA twin of
macOS's phys_footprint.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

from worker.memory import SYSTEM_READ_INTERVAL_S, DeviceProbe, MlxProbe, Reading, _cache_limit

log = logging.getLogger(__name__)

# Marks "import it yourself" for CudaProbe's injectable modules (None means absent).
AUTO: Any = object()


class NoGpuMemoryInfo(RuntimeError):
    """Neither MLX nor NVML says how much memory the GPU has, and no limit was given."""


class CudaProbe:
    """Live readings for MLX's CUDA backend: MLX's allocator plus the GPU's own memory."""

    def __init__(self, memory_limit_mb: int | None, *, mx: Any = AUTO, nvml: Any = AUTO,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._mx = importlib.import_module("mlx.core") if mx is AUTO else mx
        self._clock = clock
        self.device = "cuda"
        info = dict(self._mx.device_info())
        self._nvml, self._handle = _open_nvml(_import_nvml() if nvml is AUTO else nvml, info)
        # MLX's own reading first (it is what the allocator sees); NVML where MLX is silent.
        self._free_from_mlx = "free_memory" in info
        total = info.get("total_memory")
        if total is None and self._handle is not None:
            total = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).total
        name = info.get("device_name") or (self._nvml_name() if self._handle is not None else None)
        self.device_name = str(name or "cuda")
        limit_bytes = memory_limit_mb * 2**20 if memory_limit_mb else None
        if total is None:
            if limit_bytes is None:
                raise NoGpuMemoryInfo(
                    "cannot read the GPU's memory (MLX's device_info has no total_memory and "
                    "NVML is unavailable): install nvidia-ml-py or pass --memory-limit-mb")
            log.warning("GPU memory unknown (no total_memory from MLX, no NVML): trusting "
                        "--memory-limit-mb=%d and treating the rest of it as free", memory_limit_mb)
        self.total_bytes: int | None = int(total) if total is not None else None
        self.limit_bytes = min(x for x in (limit_bytes, self.total_bytes) if x is not None)
        self._peak_bytes = 0
        self._pool_default = self._pool_limit = _cache_limit(self._mx)
        self._active_limit: int | None = None
        self._free_bytes, self._footprint_bytes = self._read_device()
        self._read_at = clock()
        log.info("device cuda: %s, %d MiB total, %d MiB free, limit %d MiB (memory read from %s)",
                 self.device_name, (self.total_bytes or 0) >> 20, self._free_bytes >> 20,
                 self.limit_bytes >> 20, "MLX" if self._free_from_mlx else
                 "NVML" if self._handle is not None else "the limit")

    def read(self) -> Reading:
        mx = self._mx
        now = self._clock()
        # The device read is a driver call (NVML); the allocator counters are cheap.
        if now - self._read_at >= SYSTEM_READ_INTERVAL_S:
            self._free_bytes, self._footprint_bytes = self._read_device()
            self._read_at = now
        self._peak_bytes = max(self._peak_bytes, mx.get_peak_memory())
        return Reading(
            active_bytes=mx.get_active_memory(),
            cache_bytes=mx.get_cache_memory(),
            peak_bytes=self._peak_bytes,
            footprint_bytes=self._footprint_bytes,
            system_available_bytes=self._free_bytes,
        )

    # MLX's allocator calls are the same on every backend (they read self._mx and keep
    # self._peak_bytes, as MlxProbe does); tests/unit/test_devices.py checks them here.
    step_peak = MlxProbe.step_peak
    reset_peak = MlxProbe.reset_peak
    bound_cache = MlxProbe.bound_cache
    bound_active = MlxProbe.bound_active
    memory_limit = MlxProbe.memory_limit

    def clear_cache(self) -> None:
        self._mx.clear_cache()
        self.invalidate()  # what MLX gave back shows in the GPU's figures: read them again

    def invalidate(self) -> None:
        self._read_at = -math.inf

    def _read_device(self) -> tuple[int, int]:
        """(the GPU's free bytes, this process's GPU bytes or 0 when NVML cannot say)."""
        footprint = self._nvml_process_bytes() if self._handle is not None else 0
        if self._free_from_mlx:
            return int(self._mx.device_info()["free_memory"]), footprint
        if self._handle is not None:
            return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).free), footprint
        used = self._mx.get_active_memory() + self._mx.get_cache_memory()
        return max(0, self.limit_bytes - used), footprint

    def _nvml_process_bytes(self) -> int:
        pid = os.getpid()
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except Exception:  # noqa: BLE001 - NVML raises its own NVMLError tree; a missing figure is 0
            return 0
        # usedGpuMemory is None where the driver hides per-process figures (some VMs).
        return sum(int(p.usedGpuMemory or 0) for p in procs if p.pid == pid)

    def _nvml_name(self) -> str:
        name = self._nvml.nvmlDeviceGetName(self._handle)
        return name.decode() if isinstance(name, bytes) else str(name)


def make_probe(memory_limit_mb: int | None, *, mx: Any = AUTO) -> DeviceProbe:
    """The probe for the backend MLX runs on here: metal | cuda | cpu."""
    mx = importlib.import_module("mlx.core") if mx is AUTO else mx
    cuda = getattr(mx, "cuda", None)
    if not mx.metal.is_available() and cuda is not None and cuda.is_available():
        return CudaProbe(memory_limit_mb, mx=mx)
    return MlxProbe(memory_limit_mb)


def _import_nvml() -> Any:
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        return None


def _open_nvml(nvml: Any, info: dict[str, Any]) -> tuple[Any, Any]:
    """(the module, the handle of MLX's GPU), or (None, None) where NVML cannot be used."""
    if nvml is None:
        return None, None
    try:
        nvml.nvmlInit()
        uuid = info.get("uuid") or _visible_uuid()
        if uuid:
            return nvml, nvml.nvmlDeviceGetHandleByUUID(uuid)
        # No UUID: MLX uses the first visible device, whose NVML index the mask names.
        return nvml, nvml.nvmlDeviceGetHandleByIndex(_visible_index())
    except Exception as exc:  # noqa: BLE001 - no driver, no device: NVML is then simply absent
        log.warning("NVML unavailable (%s); GPU memory from MLX only", exc)
        return None, None


def _visible_mask() -> str:
    return os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()


def _visible_uuid() -> str | None:
    first = _visible_mask()
    return first if first.startswith(("GPU-", "MIG-")) else None


def _visible_index() -> int:
    first = _visible_mask()
    return int(first) if first.isdigit() else 0
