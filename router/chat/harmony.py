"""GPT-OSS's harmony output: channels → reasoning, content and tool calls. Pure, streaming.

An assistant turn is a run of messages, each ``[<|start|>assistant]<|channel|>NAME
[ to=functions.F][ <|constrain|>json]<|message|>BODY`` ended by ``<|end|>``, ``<|call|>`` or
``<|return|>`` (the last two are end-of-sequence tokens the worker does not send, so the
end of the output also ends a message). ``analysis`` is reasoning, ``final`` (and a
``commentary`` preamble) is content, and a message addressed ``to=functions.F`` is a call.
"""

from __future__ import annotations

import re

from router.chat.streamparser import Delta, StreamParser, ToolCall, held_back, new_call_id

__all__ = ["HarmonyParser"]

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


class HarmonyParser(StreamParser):
    """GPT-OSS's channels; the same interface as ``router.chat.tools.OutputParser``."""

    def __init__(self) -> None:
        self.buf = ""
        self.kind: str | None = None     # None: reading a header; else reasoning|content|call
        self.name = ""
        self.body = ""                   # a call's arguments so far

    def finish(self) -> Delta:
        out = self.feed("")
        rest, self.buf = self.buf, ""
        if self.kind is None:
            # No header at all: the model did not speak harmony; show what it wrote
            if "<|channel|>" not in rest:
                out.content += rest
        else:
            self._emit(out, rest, final=True)
        return out

    def _step(self, out: Delta) -> bool:
        if self.kind is None:
            i = self.buf.find(MESSAGE)
            if i < 0:
                return False
            header, self.buf = self.buf[:i], self.buf[i + len(MESSAGE):]
            channel = _CHANNEL.search(header)
            recipient = _RECIPIENT.search(header)
            if recipient:
                self.kind, self.name, self.body = "call", recipient.group(1), ""
            elif channel and channel.group(1) == "analysis":
                self.kind = "reasoning"
            else:
                self.kind = "content"
            return True
        hits = [(self.buf.find(e), e) for e in ENDS if e in self.buf]
        if hits:
            i, end = min(hits)
            body, self.buf = self.buf[:i], self.buf[i + len(end):]
            self._emit(out, body, final=True)
            return True
        hold = max(held_back(self.buf, e) for e in ENDS)
        safe, self.buf = self.buf[:len(self.buf) - hold], self.buf[len(self.buf) - hold:]
        self._emit(out, safe, final=False)
        return False

    def _emit(self, out: Delta, text: str, *, final: bool) -> None:
        if self.kind == "reasoning":
            out.reasoning += text
        elif self.kind == "content":
            out.content += text
        elif self.kind == "call":
            self.body += text
            if final:
                out.calls.append(ToolCall(new_call_id(), self.name, self.body.strip() or "{}"))
        if final:
            self.kind = None
