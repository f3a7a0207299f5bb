"""The output parsers' common ground: a state machine over a text stream, what it yields
(``Delta``: content, reasoning, whole ``ToolCall``s) and the marker scanning both parsers use.

Its own module so that ``router/chat/tools.py`` (the families' parser and its factory) and
``router/chat/harmony.py`` (GPT-OSS's channels) both build on it without importing each other.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

__all__ = ["ToolCall", "Delta", "StreamParser", "new_call_id", "held_back", "scan"]


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str          # JSON text, as OpenAI sends it
    complete: bool = True   # False: the output ended inside the call (its arguments are cut)


@dataclass(slots=True)
class Delta:
    """What one chunk of text added: content, reasoning and whole tool calls."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)

    def add(self, other: Delta) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.calls.extend(other.calls)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def held_back(buf: str, marker: str) -> int:
    """Length of the longest end of ``buf`` that could be the start of ``marker``."""
    for n in range(min(len(buf), len(marker) - 1), 0, -1):
        if marker.startswith(buf[-n:]):
            return n
    return 0


def scan(buf: str, marker: str) -> tuple[str, str, bool]:
    """(safe text before the marker, the rest, whether the marker was found)."""
    i = buf.find(marker)
    if i >= 0:
        return buf[:i], buf[i + len(marker):], True
    n = held_back(buf, marker)
    return buf[:len(buf) - n], buf[len(buf) - n:], False


class StreamParser:
    """A state machine over a text buffer: ``feed`` steps it until it needs more text."""

    buf: str

    def feed(self, text: str) -> Delta:
        self.buf += text
        out = Delta()
        while self._step(out):
            pass
        return out

    def finish(self) -> Delta:
        """The end of the output: whatever is held back, as what it is."""
        raise NotImplementedError

    def _step(self, out: Delta) -> bool:
        """One move; False when it needs more text."""
        raise NotImplementedError
