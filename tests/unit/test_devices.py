"""Tests for worker/devices.py: the CUDA probe on fake device readings, and make_probe.

A fake `mx` (MLX's allocator counters and `device_info()`) and a fake `pynvml` stand in
for a GPU; the CPU case uses the real MLX CPU backend of this machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from worker.devices import CudaProbe, NoGpuMemoryInfo, make_probe
from worker.memory import CPU_DEFAULT_LIMIT_FRACTION, SYSTEM_READ_INTERVAL_S, MlxProbe

MIB = 1 << 20
GIB = 1 << 30
H200_TOTAL = 143_771 * MIB
UUID = "GPU-0123abcd-0000-1111-2222-333344445555"


class FakeMx:
    """The parts of mlx.core a probe reads; device_info() as MLX's CUDA backend gives it."""

    def __init__(self, info: dict[str, Any], *, cuda: bool = True, metal: bool = False) -> None:
        self.info = info
        self.active_bytes = 5 * GIB
        self.cache_bytes = 1 * GIB
        self.peak_bytes = 7 * GIB
        self.info_calls = 0
        self.cache_limit = 112 * GIB  # MLX's default on CUDA: a share of the card
        self.memory_limit = 112 * GIB
        self.memory_limit_calls = 0
        self.metal = SimpleNamespace(is_available=lambda: metal)
        self.cuda = SimpleNamespace(is_available=lambda: cuda)

    def device_info(self) -> dict[str, Any]:
        self.info_calls += 1
        return dict(self.info)

    def get_active_memory(self) -> int:
        return self.active_bytes

    def set_memory_limit(self, limit: int) -> int:
        self.memory_limit_calls += 1
        previous, self.memory_limit = self.memory_limit, limit
        return previous

    def get_cache_memory(self) -> int:
        return self.cache_bytes

    def get_peak_memory(self) -> int:
        return self.peak_bytes

    def reset_peak_memory(self) -> None:
        self.peak_bytes = 0

    def clear_cache(self) -> None:
        self.cache_bytes = 0

    def set_cache_limit(self, limit: int) -> int:
        previous, self.cache_limit = self.cache_limit, limit
        return previous


def cuda_info(free: int = 100 * GIB, total: int = H200_TOTAL) -> dict[str, Any]:
    return {"device_name": "NVIDIA H200", "architecture": "sm_90", "uuid": UUID,
            "free_memory": free, "total_memory": total}


@dataclass
class FakeNvml:
    """nvidia-ml-py's calls used by the probe, for one GPU."""

    total: int = H200_TOTAL
    free: int = 90 * GIB
    name: Any = b"NVIDIA H200"
    procs: list[Any] = field(default_factory=list)
    init_error: Exception | None = None
    handles: list[Any] = field(default_factory=list)

    def nvmlInit(self) -> None:
        if self.init_error:
            raise self.init_error

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self.handles.append(("uuid", uuid))
        return "h"

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        self.handles.append(("index", index))
        return "h"

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any:
        return SimpleNamespace(total=self.total, free=self.free, used=self.total - self.free)

    def nvmlDeviceGetName(self, handle: str) -> Any:
        return self.name

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[Any]:
        return self.procs


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_cuda_probe_is_labelled_cuda_with_the_gpu_name() -> None:
    probe = CudaProbe(8000, mx=FakeMx(cuda_info()), nvml=None)
    assert probe.device == "cuda"
    assert probe.device_name == "NVIDIA H200"
    assert probe.total_bytes == H200_TOTAL


@pytest.mark.parametrize(("flag_mb", "expected"), [
    (8000, 8000 * MIB),                 # the flag is below the card: the flag
    (10_000_000, H200_TOTAL),           # the flag is above the card: the card
    (None, H200_TOTAL),                 # no flag: the whole card
])
def test_limit_is_the_smaller_of_the_flag_and_the_gpu(flag_mb: int | None, expected: int) -> None:
    assert CudaProbe(flag_mb, mx=FakeMx(cuda_info()), nvml=None).limit_bytes == expected


def test_free_memory_comes_from_mlx_when_it_reports_it() -> None:
    mx, nvml, clock = FakeMx(cuda_info(free=100 * GIB)), FakeNvml(free=90 * GIB), Clock()
    probe = CudaProbe(8000, mx=mx, nvml=nvml, clock=clock)
    reading = probe.read()
    assert reading.system_available_bytes == 100 * GIB
    assert (reading.active_bytes, reading.cache_bytes, reading.peak_bytes) == (5 * GIB, 1 * GIB, 7 * GIB)
    assert nvml.handles == [("uuid", UUID)]  # NVML opened on MLX's own GPU, by UUID


def test_free_memory_is_rate_limited_and_then_refreshed() -> None:
    mx, clock = FakeMx(cuda_info(free=100 * GIB)), Clock()
    probe = CudaProbe(8000, mx=mx, nvml=None, clock=clock)
    mx.info["free_memory"] = 40 * GIB  # another process took 60 GiB of the card
    calls = mx.info_calls
    assert probe.read().system_available_bytes == 100 * GIB  # not re-read yet
    assert mx.info_calls == calls
    clock.now += SYSTEM_READ_INTERVAL_S
    assert probe.read().system_available_bytes == 40 * GIB


def test_clearing_the_cache_makes_the_next_read_ask_the_gpu_again() -> None:
    # What MLX's cache gives back leaves this process's GPU figure at once; a figure read
    # before the clear (up to 0.25 s old) once made the gate stop its own requests.
    nvml, clock = FakeNvml(free=90 * GIB, procs=[SimpleNamespace(pid=os.getpid(), usedGpuMemory=9 * GIB)]), Clock()
    probe = CudaProbe(20_000, mx=FakeMx(cuda_info()), nvml=nvml, clock=clock)
    assert probe.read().footprint_bytes == 9 * GIB
    nvml.procs = [SimpleNamespace(pid=os.getpid(), usedGpuMemory=6 * GIB)]
    assert probe.read().footprint_bytes == 9 * GIB  # rate-limited: the old figure
    probe.clear_cache()
    assert probe.read().footprint_bytes == 6 * GIB
    nvml.procs = [SimpleNamespace(pid=os.getpid(), usedGpuMemory=5 * GIB)]
    probe.invalidate()
    assert probe.read().footprint_bytes == 5 * GIB


def test_the_gate_bounds_mlx_buffer_cache_but_never_raises_it() -> None:
    mx = FakeMx(cuda_info())
    probe = CudaProbe(20_000, mx=mx, nvml=None)
    probe.bound_cache(3 * GIB)
    assert mx.cache_limit == 3 * GIB
    probe.bound_cache(-5)                     # everything promised: keep nothing
    assert mx.cache_limit == 0
    probe.bound_cache(500 * GIB)              # never above MLX's own default
    assert mx.cache_limit == 112 * GIB


def test_the_gate_sets_mlx_memory_limit_so_queued_kernels_wait_instead_of_passing_it() -> None:
    mx = FakeMx(cuda_info())
    probe = CudaProbe(20_000, mx=mx, nvml=None)
    probe.bound_active(9 * GIB)
    assert mx.memory_limit == 9 * GIB
    probe.bound_active(9 * GIB)               # unchanged: MLX is not called again
    assert mx.memory_limit_calls == 1
    probe.bound_active(-3)                    # everything promised: at least 1 byte, never negative
    assert mx.memory_limit == 1


def test_nvml_gives_memory_and_name_when_mlx_does_not() -> None:
    mx = FakeMx({"device_name": "", "architecture": "sm_90"})
    nvml, clock = FakeNvml(total=80 * GIB, free=70 * GIB, name=b"NVIDIA H100"), Clock()
    probe = CudaProbe(None, mx=mx, nvml=nvml, clock=clock)
    assert (probe.limit_bytes, probe.device_name) == (80 * GIB, "NVIDIA H100")
    assert probe.read().system_available_bytes == 70 * GIB
    nvml.free = 30 * GIB
    clock.now += SYSTEM_READ_INTERVAL_S
    assert probe.read().system_available_bytes == 30 * GIB
    assert nvml.handles == [("index", 0)]  # no UUID from MLX: the first visible device


def test_nvml_index_follows_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    nvml = FakeNvml()
    CudaProbe(None, mx=FakeMx({}), nvml=nvml)
    assert nvml.handles == [("index", 3)]


def test_host_ram_does_not_cap_gpu_headroom(monkeypatch: pytest.MonkeyPatch) -> None:
    # A host with 1 GiB of RAM available and a GPU with 100 GiB free.
    tiny = SimpleNamespace(total=4 * GIB, available=1 * GIB)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: tiny)
    probe = CudaProbe(40_000, mx=FakeMx(cuda_info(free=100 * GIB)), nvml=FakeNvml(free=100 * GIB))
    reading = probe.read()
    assert reading.system_available_bytes == 100 * GIB
    assert probe.limit_bytes == 40_000 * MIB
    # What a gate gives (limit - used, capped by what is available) is the GPU's room.
    headroom = min(probe.limit_bytes - reading.used_bytes, reading.system_available_bytes)
    assert headroom == 40_000 * MIB - 6 * GIB


def test_footprint_is_this_process_s_gpu_memory_from_nvml() -> None:
    procs = [SimpleNamespace(pid=os.getpid(), usedGpuMemory=9 * GIB),
             SimpleNamespace(pid=os.getpid() + 1, usedGpuMemory=50 * GIB)]
    reading = CudaProbe(None, mx=FakeMx(cuda_info()), nvml=FakeNvml(procs=procs)).read()
    assert reading.footprint_bytes == 9 * GIB
    assert reading.used_bytes == 9 * GIB  # above MLX's 6 GiB: the CUDA context counts too


def test_hidden_per_process_figures_count_as_zero() -> None:
    procs = [SimpleNamespace(pid=os.getpid(), usedGpuMemory=None)]
    reading = CudaProbe(None, mx=FakeMx(cuda_info()), nvml=FakeNvml(procs=procs)).read()
    assert reading.footprint_bytes == 0
    assert reading.used_bytes == 6 * GIB


def test_nvml_that_fails_to_start_is_treated_as_absent() -> None:
    nvml = FakeNvml(init_error=RuntimeError("NVML Shared Library Not Found"))
    probe = CudaProbe(8000, mx=FakeMx(cuda_info(free=100 * GIB)), nvml=nvml)
    assert probe.read().system_available_bytes == 100 * GIB
    assert probe.read().footprint_bytes == 0


def test_no_memory_source_trusts_the_flag_or_refuses() -> None:
    probe = CudaProbe(8000, mx=FakeMx({"device_name": "GPU"}), nvml=None)
    assert probe.limit_bytes == 8000 * MIB
    assert probe.read().system_available_bytes == 8000 * MIB - 6 * GIB
    with pytest.raises(NoGpuMemoryInfo, match="--memory-limit-mb"):
        CudaProbe(None, mx=FakeMx({"device_name": "GPU"}), nvml=None)


def test_peak_cache_and_reset_go_to_mlx() -> None:
    mx = FakeMx(cuda_info())
    probe = CudaProbe(None, mx=mx, nvml=None)
    assert probe.step_peak() == 7 * GIB
    probe.reset_peak()
    probe.clear_cache()
    assert (mx.peak_bytes, mx.cache_bytes) == (0, 0)
    assert probe.read().peak_bytes == 7 * GIB  # the lifetime peak stays


def test_make_probe_picks_cuda_when_mlx_runs_on_cuda() -> None:
    probe = make_probe(8000, mx=FakeMx(cuda_info()))
    assert isinstance(probe, CudaProbe)
    assert (probe.device, probe.limit_bytes) == ("cuda", 8000 * MIB)


def test_make_probe_on_cpu_keeps_the_cpu_label_and_limit() -> None:
    import mlx.core as mx

    assert not mx.metal.is_available() and not mx.cuda.is_available()  # this machine
    probe = make_probe(100)
    assert isinstance(probe, MlxProbe)
    assert probe.device == "cpu"
    assert probe.limit_bytes == min(100 * MIB, int(psutil.virtual_memory().total * CPU_DEFAULT_LIMIT_FRACTION))
    assert probe.device_name == mx.device_info()["device_name"]
    unlimited = make_probe(None)
    assert unlimited.limit_bytes == int(psutil.virtual_memory().total * CPU_DEFAULT_LIMIT_FRACTION)
    assert probe.read().system_available_bytes > 0  # host RAM, as before
