"""Poison-prompt quarantine: a request fingerprint in flight at two worker deaths.

Pure bookkeeping with an explicit ``now``, so a client that keeps retrying a prompt that
kills the worker cannot make a crash loop.
"""

from __future__ import annotations

from collections.abc import Callable

# A suspect is forgotten after this long without another death.
SUSPECT_TTL_S = 600.0
# A quarantined fingerprint is refused for this long.
QUARANTINE_S = 600.0
# In flight at this many deaths → quarantined.
DEATHS_TO_QUARANTINE = 2


class Quarantine:
    def __init__(self) -> None:
        self.suspects: dict[str, tuple[int, float]] = {}   # fingerprint → (deaths, last seen)
        self.quarantined: dict[str, float] = {}            # fingerprint → until

    def is_quarantined(self, fingerprint: str | Callable[[], str], now: float) -> bool:
        """``fingerprint`` may be a callable, called only while something is quarantined: a
        job's costs ~0.9 ms for an 8k-token prompt, and nearly always nothing is."""
        if not self.quarantined:
            return False
        if callable(fingerprint):
            fingerprint = fingerprint()
        until = self.quarantined.get(fingerprint)
        if until is None:
            return False
        if until <= now:
            del self.quarantined[fingerprint]
            return False
        return True

    def record_death(self, fingerprints: set[str], now: float) -> set[str]:
        """Count a death against every in-flight fingerprint; return the newly quarantined."""
        self._expire(now)
        newly: set[str] = set()
        for fp in fingerprints:
            deaths = self.suspects.get(fp, (0, now))[0] + 1
            self.suspects[fp] = (deaths, now)
            if deaths >= DEATHS_TO_QUARANTINE:
                self.quarantined[fp] = now + QUARANTINE_S
                del self.suspects[fp]
                newly.add(fp)
        return newly

    def _expire(self, now: float) -> None:
        for fp, (_, seen) in list(self.suspects.items()):
            if now - seen > SUSPECT_TTL_S:
                del self.suspects[fp]
