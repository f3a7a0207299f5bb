"""Test doubles shared by unit and integration tests."""

from __future__ import annotations

from dataclasses import dataclass

from worker.memory import Reading


@dataclass(slots=True)
class FakeProbe:
    """A ``DeviceProbe`` with scripted readings, for tests of the memory logic (no MLX)."""

    device: str = "fake"
    limit_bytes: int = 1 << 30
    active_bytes: int = 0
    cache_bytes: int = 0
    system_available_bytes: int = 1 << 40
    peak_bytes: int = 0
    cleared: int = 0
    invalidated: int = 0
    pool_limit: int | None = None
    active_limit: int | None = None
    footprint_bytes: int = 0

    def read(self) -> Reading:
        self.peak_bytes = max(self.peak_bytes, self.active_bytes + self.cache_bytes)
        return Reading(self.active_bytes, self.cache_bytes, self.peak_bytes, self.footprint_bytes,
                       self.system_available_bytes)

    def step_peak(self) -> int:
        return self.active_bytes + self.cache_bytes

    def clear_cache(self) -> None:
        self.cleared += 1
        self.cache_bytes = 0

    def invalidate(self) -> None:
        self.invalidated += 1

    def bound_cache(self, nbytes: int) -> None:
        self.pool_limit = max(0, nbytes)

    def bound_active(self, nbytes: int) -> None:
        self.active_limit = max(1, nbytes)

    def memory_limit(self) -> int | None:
        return self.active_limit

    def reset_peak(self) -> None:
        pass
