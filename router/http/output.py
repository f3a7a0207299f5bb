"""From token events to OpenAI responses: detokenize, apply stop strings, count, format.

One ``Collector`` per choice (each choice is one row in the worker's batch); one
``Formatter`` per request builds the chat or text completion shapes, streamed and not,
with logprobs in OpenAI's shapes when the request asked for them, and what an answer shows
of its prompt (``echo``, its logprobs, vLLM's ``prompt_logprobs``). A ``Presenter`` is one
API's view of the collectors (the OpenAI one, ``ChatPresenter``, is here;
router/http/anthropic_output.py and router/http/responses_output.py hold the others), so one stream
loop in router/http/api.py serves every API.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.errors import HeadroomError
from router.chat.schema import Parsed
from router.chat.stops import StopMatcher
from router.chat.streamparser import Delta, StreamParser, ToolCall
from router.chat.tokenizer import IncrementalDetokenizer
from router.job import TokenEvent

# A worker logprobs row: [logprob, top_ids, top_logprobs] for one generated token; a prompt
# token's row has its rank after those.
LogprobRow = list[Any]


@dataclass(frozen=True, slots=True)
class Shown:
    """What a choice's answer shows of its prompt: its token ids; ``echo``, the text the
    answer starts with; ``offsets``, each token's offset in that text (echo with logprobs);
    ``scored``, whether the worker scores the prompt (its logprobs must then arrive)."""

    ids: list[int]
    echo: str | None = None
    offsets: list[int] = field(default_factory=list)
    scored: bool = False


class Collector:
    """Text, reasoning, tool calls, logprobs and usage of one choice as its tokens arrive.

    With a ``parser`` the text is split into content, reasoning and tool calls; with
    ``inline_reasoning`` the reasoning stays in the content, where the model wrote it.
    """

    def __init__(self, detokenizer: IncrementalDetokenizer, stops: list[str], prompt_tokens: int,
                 index: int = 0, parser: StreamParser | None = None,
                 inline_reasoning: bool = False, shown: Shown | None = None) -> None:
        self.index = index
        self.shown = shown
        self.prompt_logprobs: list[LogprobRow] | None = None   # from the worker, when scored
        self.parser = parser
        self.inline_reasoning = inline_reasoning
        self.reasoning_parts: list[str] = []
        self.calls: list[ToolCall] = []
        self._delta_parsed = Delta()
        self.detokenizer = detokenizer
        self.stops = StopMatcher(stops) if stops else None
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0          # prompt tokens the worker's prefix cache supplied
        self.completion_tokens = 0
        self.finished = False
        self.finish_reason: str | None = None
        self.parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[LogprobRow] = []
        self.token_offsets: list[int] = []   # where each token's text starts in ``text``
        self._delta_logprobs: list[tuple[int, LogprobRow]] = []
        # The echoed prompt is text the answer starts with, before any stop string or parser.
        self._echo_unsent = shown is not None and shown.echo is not None
        self._chars = 0                 # characters the detokenizer gave, and the echo
        if shown is not None and shown.echo is not None:
            self.parts.append(shown.echo)
            self._delta_parsed.content = shown.echo
            self._chars = len(shown.echo)

    def feed(self, event: TokenEvent) -> None:
        if self.finished:
            return
        if event.cached_tokens > 0:
            self.cached_tokens = min(event.cached_tokens, self.prompt_tokens)
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.finish_reason is not None and self.shown is not None and self.shown.scored \
                and self.prompt_logprobs is None:
            raise ValueError("the worker sent no prompt logprobs (a worker older than this router?)")
        self.completion_tokens += len(event.token_ids)
        if event.logprobs is not None:
            # One token at a time, for each one's text_offset: a token that is a piece of
            # a character starts where the character does (its text comes with the last piece).
            text = ""
            for token, row in zip(event.token_ids, event.logprobs):
                self.token_ids.append(token)
                self.logprobs.append(row)
                self._delta_logprobs.append((token, row))
                self.token_offsets.append(self._chars + len(text))
                text += self.detokenizer.add([token])
        else:
            text = self.detokenizer.add(event.token_ids)
        if event.finish_reason is not None:
            text += self.detokenizer.flush()
        self._chars += len(text)
        stopped = False
        if self.stops is not None:
            text, stopped = self.stops.feed(text)
            if event.finish_reason is not None and not stopped:
                text += self.stops.flush()
                stopped = self.stops.is_stopped
        ending = stopped or event.finish_reason is not None
        self._add(self._split(text, ending, stopped))
        if stopped:
            self.finished, self.finish_reason = True, "stop"
        elif event.finish_reason is not None:
            self.finished = True
            self.finish_reason = "length" if event.finish_reason == "length" else "stop"
        if self.finished and self.calls and self.finish_reason == "stop" \
                and all(c.complete for c in self.calls):  # a stop string may cut a call
            self.finish_reason = "tool_calls"

    def _split(self, text: str, ending: bool, stopped: bool = False) -> Delta:
        if self.parser is None:
            return Delta(content=text)
        d = self.parser.feed(text)
        if ending:
            last = self.parser.finish()
            if stopped:  # a call still open when a stop string ended the output is cut
                for call in last.calls:
                    call.complete = False
            d.add(last)
        if self.inline_reasoning and d.reasoning:
            d.content, d.reasoning = d.reasoning + d.content, ""
        return d

    def _add(self, d: Delta) -> None:
        if d.content:
            self.parts.append(d.content)
        if d.reasoning:
            self.reasoning_parts.append(d.reasoning)
        self.calls.extend(d.calls)
        self._delta_parsed.add(d)

    def take_delta(self) -> tuple[Delta, list[tuple[int, LogprobRow]]]:
        delta, self._delta_parsed = self._delta_parsed, Delta()
        logprobs, self._delta_logprobs = self._delta_logprobs, []
        return delta, logprobs

    def take_echo(self) -> bool:
        """True once: the delta just taken starts with the echoed prompt."""
        unsent, self._echo_unsent = self._echo_unsent, False
        return unsent

    def take_chat_delta(self) -> dict[str, Any]:
        """What was gathered since the last take, as a chat completion's stream delta carries it
        (whole tool calls, numbered across the choice); the other APIs' presenters build on it."""
        delta, _ = self.take_delta()
        first = len(self.calls) - len(delta.calls)
        return {"content": delta.content, "reasoning_content": delta.reasoning, "tool_calls": [
            {"index": n, "id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
            for n, call in enumerate(delta.calls, start=first)]}

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self.stops.matched if self.stops is not None else None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_parts)


def token_text(raw: bytes) -> str:
    """A token as text; a piece of a character is spelled ``bytes:\\xe2\\x80`` as OpenAI does,
    so distinct byte tokens stay distinct keys in the legacy ``top_logprobs`` dicts."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def cached_tokens(collectors: list[Collector], prompt_tokens: int) -> int:
    """Prompt tokens served from the prefix cache: each row's share, so n choices of one
    prompt count it once (as ``prompt_tokens`` does)."""
    rows_prompt = sum(c.prompt_tokens for c in collectors)
    return sum(c.cached_tokens for c in collectors) * prompt_tokens // max(rows_prompt, 1)


def usage(collectors: list[Collector], prompt_tokens: int) -> dict[str, Any]:
    completion = sum(c.completion_tokens for c in collectors)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached_tokens(collectors, prompt_tokens)}}


class Formatter:
    """The OpenAI shapes for chat and text completions, streamed and not."""

    def __init__(self, parsed: Parsed, request_id: str, model_id: str,
                 token_bytes: Callable[[int], bytes]) -> None:
        self.chat = parsed.kind == "chat"
        self.include_usage = parsed.include_usage
        self.num_logprobs = parsed.sampling.params.num_logprobs
        self.wants_logprobs = self.num_logprobs is not None
        self.prompt_top = parsed.prompt_logprobs      # vLLM's prompt_logprobs: shown when set
        self.request_id = request_id
        self.model_id = model_id
        self.token_bytes = token_bytes
        self.created = int(time.time())
        self._role_sent: set[int] = set()

    def _envelope(self, choices: list[dict[str, Any]], *, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        body: dict[str, Any] = {"id": self.request_id, "object": kind, "created": self.created,
                                "model": self.model_id, "choices": choices}
        if chunk and self.include_usage:
            body["usage"] = None
        return body

    def chunks(self, c: Collector, delta: Delta, logprobs: list[tuple[int, LogprobRow]],
               echo: bool = False) -> list[dict[str, Any]]:
        """The stream chunks for what one choice added: its text (and reasoning) first,
        then each new tool call as two chunks, its id and name, then its arguments.
        ``logprobs``: the newest tokens' rows. ``echo``: the text starts with the echoed
        prompt (its logprobs go first)."""
        index = c.index
        offsets = c.token_offsets[len(c.token_offsets) - len(logprobs):]
        lp = self._logprobs(c, logprobs, offsets, echo) if self.wants_logprobs else None
        if not self.chat:
            if not delta.content and not logprobs and not echo:
                return []
            return [self._envelope([{"index": index, "text": delta.content, "logprobs": lp,
                                     "finish_reason": None}], chunk=True)]
        out = []
        if delta.content or delta.reasoning or lp is not None or index not in self._role_sent:
            body: dict[str, Any] = {"content": delta.content}
            if delta.reasoning:
                body["reasoning_content"] = delta.reasoning
            out.append(self._delta_chunk(index, body, lp))
        first = len(c.calls) - len(delta.calls)
        for n, call in enumerate(delta.calls, start=first):
            head = {"index": n, "id": call.id, "type": "function",
                    "function": {"name": call.name, "arguments": ""}}
            out.append(self._delta_chunk(index, {"tool_calls": [head]}, None))
            args = {"index": n, "function": {"arguments": call.arguments}}
            out.append(self._delta_chunk(index, {"tool_calls": [args]}, None))
        return out

    def _delta_chunk(self, index: int, body: dict[str, Any], lp: Any) -> dict[str, Any]:
        if index not in self._role_sent:
            body = {"role": "assistant", **body}
            self._role_sent.add(index)
        return self._envelope([{"index": index, "delta": body, "logprobs": lp,
                                "finish_reason": None}], chunk=True)

    def final_chunk(self, c: Collector) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": c.index, "delta": {}, "logprobs": None,
                                      "finish_reason": c.finish_reason}
        else:
            choice = {"index": c.index, "text": "", "logprobs": None,
                      "finish_reason": c.finish_reason}
        return self._envelope([choice], chunk=True)

    def usage_chunk(self, collectors: list[Collector], prompt_tokens: int) -> dict[str, Any]:
        body = self._envelope([], chunk=True)
        body["usage"] = usage(collectors, prompt_tokens)
        return body

    def full(self, collectors: list[Collector], prompt_tokens: int) -> dict[str, Any]:
        choices = []
        for c in collectors:
            echo = c.shown is not None and c.shown.echo is not None
            lp = self._logprobs(c, list(zip(c.token_ids, c.logprobs)), c.token_offsets, echo) \
                if self.wants_logprobs else None
            if self.chat:
                choices.append({"index": c.index, "message": self._message(c), "logprobs": lp,
                                "finish_reason": c.finish_reason})
            else:
                choices.append({"index": c.index, "text": c.text, "logprobs": lp,
                                "finish_reason": c.finish_reason})
                if self.prompt_top is not None:  # vLLM's shape: per choice on completions
                    choices[-1]["prompt_logprobs"] = self._prompt_logprobs(c)
        body = self._envelope(choices, chunk=False)
        if self.chat and self.prompt_top is not None and collectors:  # and once on a chat
            body["prompt_logprobs"] = self._prompt_logprobs(collectors[0])
        body["usage"] = usage(collectors, prompt_tokens)
        return body

    def _message(self, c: Collector) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant",
                                   "content": c.text if c.text or not c.calls else None}
        if c.reasoning_parts:
            message["reasoning_content"] = c.reasoning
        if c.calls:
            message["tool_calls"] = [
                {"id": t.id, "type": "function",
                 "function": {"name": t.name, "arguments": t.arguments}} for t in c.calls]
        return message

    def _logprobs(self, c: Collector, rows: list[tuple[int, LogprobRow]], offsets: list[int],
                  echo: bool = False) -> dict[str, Any]:
        if self.chat:
            return {"content": [self._chat_entry(token, row) for token, row in rows], "refusal": None}
        if echo:
            return self._with_echo(c, rows, offsets)
        return self._completion_logprobs(rows, offsets)

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        raw = self.token_bytes(token)
        return {"token": token_text(raw), "logprob": logprob, "bytes": list(raw)}

    def _chat_entry(self, token: int, row: LogprobRow) -> dict[str, Any]:
        logprob, top_ids, top_lps = row
        entry = self._entry(token, logprob)
        entry["top_logprobs"] = [self._entry(t, v) for t, v in zip(top_ids, top_lps)]
        return entry

    def _completion_logprobs(self, rows: list[tuple[int, LogprobRow]], offsets: list[int]) -> dict[str, Any]:
        """Legacy shape: the top dict holds the k most likely and always the sampled token;
        ``offsets``: where each token starts in the choice's text."""
        tokens, token_logprobs, tops = [], [], []
        for token, (logprob, top_ids, top_lps) in rows:
            text = self._text(token)
            tokens.append(text)
            token_logprobs.append(logprob)
            tops.append(self._top(text, logprob, top_ids, top_lps))
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": list(offsets)}

    def _text(self, token: int) -> str:
        return token_text(self.token_bytes(token))

    def _top(self, text: str, logprob: float, top_ids: list[int], top_lps: list[float]) -> dict[str, float]:
        top = {self._text(t): v for t, v in zip(top_ids, top_lps)}
        top.setdefault(text, logprob)
        return top

    def _with_echo(self, c: Collector, rows: list[tuple[int, LogprobRow]], offsets: list[int]) -> dict[str, Any]:
        """A completion's logprobs whose text starts with the echoed prompt: the prompt's
        tokens (the first has no logprob: ``null``), at their offsets in the echoed text,
        then the new ones after it."""
        assert c.shown is not None and c.shown.echo is not None
        k = self.num_logprobs or 0
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                     "text_offset": list(c.shown.offsets)}
        for i, token in enumerate(c.shown.ids):
            text = self._text(token)
            row = c.prompt_logprobs[i - 1] if i and c.prompt_logprobs is not None else None
            out["tokens"].append(text)
            out["token_logprobs"].append(row[0] if row else None)
            out["top_logprobs"].append(self._top(text, row[0], row[1][:k], row[2][:k]) if row else None)
        new = self._completion_logprobs(rows, offsets)
        return {key: out[key] + new[key] for key in out}

    def _prompt_logprobs(self, c: Collector) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs``: per prompt token (the first has none: ``null``) its
        own and the k most likely, each ``{"logprob", "rank", "decoded_token"}`` by id."""
        assert c.shown is not None
        k = self.prompt_top or 0
        out: list[dict[str, Any] | None] = [None]
        for token, (logprob, top_ids, top_lps, rank) in zip(c.shown.ids[1:], c.prompt_logprobs or []):
            entry = {str(t): {"logprob": v, "rank": n, "decoded_token": self._text(t)}
                     for n, (t, v) in enumerate(zip(top_ids[:k], top_lps[:k]), start=1)}
            entry.setdefault(str(token), {"logprob": logprob, "rank": rank, "decoded_token": self._text(token)})
            out.append(entry)
        return out


def sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class Presenter(Protocol):
    """One API's shapes for a request's output; router/http/api.py's loop calls these.

    Stream methods return the bytes to write, b"" for nothing. A presenter keeps what it has
    sent, so it opens its stream (the message's head, the first block) when it first has
    something to say, and closes what it opened.
    """

    def body(self, collectors: list[Collector], prompt_tokens: int) -> dict[str, Any]:
        """The whole response of a request that does not stream."""
        ...

    def delta(self, c: Collector) -> bytes:
        """What one choice gathered since the last call (and its end, once it finished)."""
        ...

    def keepalive(self) -> bytes:
        """Something to send while a started stream has nothing to say, so a vanished client
        is noticed (router/http/sse.py sends nothing before the first token)."""
        ...

    def tail(self, collectors: list[Collector], prompt_tokens: int) -> bytes:
        """The end of a stream whose choices all finished."""
        ...

    def error(self, exc: HeadroomError) -> bytes:
        """The end of a stream that failed after it had started."""
        ...


class ChatPresenter:
    """The OpenAI shapes (chat and text completions) as a `Presenter`."""

    def __init__(self, fmt: Formatter) -> None:
        self.fmt = fmt

    def body(self, collectors: list[Collector], prompt_tokens: int) -> dict[str, Any]:
        return self.fmt.full(collectors, prompt_tokens)

    def delta(self, c: Collector) -> bytes:
        delta, logprobs = c.take_delta()
        out = b"".join(sse(chunk) for chunk in
                       self.fmt.chunks(c, delta, logprobs, c.take_echo()))
        return out + sse(self.fmt.final_chunk(c)) if c.finished else out

    def keepalive(self) -> bytes:
        return b": keepalive\n\n"

    def tail(self, collectors: list[Collector], prompt_tokens: int) -> bytes:
        usage_chunk = sse(self.fmt.usage_chunk(collectors, prompt_tokens)) if self.fmt.include_usage else b""
        return usage_chunk + b"data: [DONE]\n\n"

    def error(self, exc: HeadroomError) -> bytes:
        return sse(exc.to_body(), event="error") + b"data: [DONE]\n\n"
