"""OpenAI ``stop`` strings over a stream of text deltas.

`StopMatcher` sees the text in the chunks the detokenizer produces and decides what may be
sent. The result does not depend on how the text was chunked: the client receives exactly
``text[:i]``, where ``i`` is the earliest position at which any stop string occurs in the
whole generated text, or all of the text when none does. Nothing from the stop string on
is ever sent. Pure: no I/O, no clock.

Holding back: a suffix that could still grow into a stop string is kept until the next
delta decides it. When a stop string is complete but a longer one might still be matching
from an earlier position, the matcher waits for that one, so "earliest occurrence" means
earliest start, whatever the chunking.
"""

from __future__ import annotations

import logging

from common.errors import BadRequest

__all__ = ["StopMatcher", "MAX_STOPS"]

log = logging.getLogger(__name__)

MAX_STOPS = 4  # OpenAI's limit


class StopMatcher:
    """Cuts a streamed text before the first occurrence of any stop string."""

    __slots__ = ("_stops", "_longest", "_first_chars", "_held", "_is_stopped", "matched")

    def __init__(self, stops: list[str]) -> None:
        if not isinstance(stops, (list, tuple)) or len(stops) > MAX_STOPS:
            raise BadRequest(f"stop must be a list of at most {MAX_STOPS} strings", param="stop")
        if not all(isinstance(s, str) and s for s in stops):
            raise BadRequest("each stop must be a non-empty string", param="stop")
        self._stops = tuple(dict.fromkeys(stops))
        self._longest = max((len(s) for s in self._stops), default=0)
        self._first_chars = frozenset(s[0] for s in self._stops)
        self._held = ""
        self._is_stopped = False
        self.matched: str | None = None  # the stop string that ended the text (Anthropic reports it)

    @property
    def is_stopped(self) -> bool:
        """True once a stop string matched, in `feed` or in the held tail `flush` examined."""
        return self._is_stopped

    def feed(self, delta: str) -> tuple[str, bool]:
        """Return (text safe to send now, whether a stop string matched)."""
        if self._is_stopped:
            return "", True
        if not self._stops:
            return delta, False
        text = self._held + delta
        first = self._first_match(text)
        pending = self._first_partial(text, end=len(text) if first is None else first)
        if first is not None and pending is None:
            self._stop_at(text, first)
            self._held = ""
            return text[:first], True
        cut = len(text) if pending is None else pending
        self._held = text[cut:]
        return text[:cut], False

    def flush(self) -> str:
        """At the end of the stream: the held-back text, cut at a stop string if it holds one."""
        text, self._held = self._held, ""
        if self._is_stopped:
            return ""
        first = self._first_match(text)
        if first is None:
            return text
        self._stop_at(text, first)
        return text[:first]

    def _stop_at(self, text: str, first: int) -> None:
        self._is_stopped = True
        self.matched = min((s for s in self._stops if text.startswith(s, first)), key=len)

    def _first_match(self, text: str) -> int | None:
        """Start of the earliest complete stop string in text."""
        found = [i for s in self._stops if (i := text.find(s)) != -1]
        return min(found, default=None)

    def _first_partial(self, text: str, *, end: int) -> int | None:
        """Earliest start before `end` of a text suffix that is a proper prefix of a stop string.

        Such a suffix could still become an occurrence that starts before any complete one,
        so it has to be held. Only the last (longest stop - 1) characters can qualify.
        """
        for start in range(max(0, len(text) - self._longest + 1), end):
            if text[start] not in self._first_chars:
                continue
            tail = text[start:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self._stops):
                return start
        return None
