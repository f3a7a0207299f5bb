"""Tests for router/http/output.py: what an answer shows of its prompt (``echo``, the
prompt's logprobs, vLLM's ``prompt_logprobs``), streamed and not. Pure: no processes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.chat.schema import Parsed, parse_chat, parse_completion
from router.http.output import ChatPresenter, Collector, Formatter, Shown
from router.job import TokenEvent

PROMPT = "abc"                  # token n is the character chr(n): ids 97, 98, 99
IDS = [ord(ch) for ch in PROMPT]
# The worker's scores of "b" and "c": [logprob, top_ids, top_logprobs, rank].
SCORES = [[-1.0, [120, 98], [-0.5, -1.0], 2], [-0.25, [99, 100], [-0.25, -2.0], 1]]
BANG = TokenEvent([ord("!")], "length", [[-0.1, [33], [-0.1]]])


class CharDetokenizer:
    def add(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))

    def flush(self) -> str:
        return ""


def formatter(parsed: Parsed) -> Formatter:
    return Formatter(parsed, "cmpl-1", "demo", lambda t: chr(t).encode())


def collector(parsed: Parsed, stops: list[str] | None = None) -> Collector:
    echo = PROMPT if parsed.echo else None
    shown = Shown(IDS, echo, [0, 1, 2] if echo is not None else [], parsed.sampling.params.prompt_logprobs is not None)
    return Collector(CharDetokenizer(), stops or [], len(IDS), shown=shown)  # type: ignore[arg-type]


def scored(parsed: Parsed, *events: TokenEvent, stops: list[str] | None = None) -> Collector:
    c = collector(parsed, stops)
    c.feed(TokenEvent([], None, prompt_logprobs=SCORES))
    for event in events:
        c.feed(event)
    return c


def completion(**fields: Any) -> Parsed:
    return parse_completion({"prompt": PROMPT, **fields}, 16)


def test_echo_with_logprobs_covers_the_prompt_then_the_new_tokens() -> None:
    parsed = completion(echo=True, logprobs=1, max_tokens=1)
    body = formatter(parsed).full([scored(parsed, BANG)], len(IDS))
    choice = body["choices"][0]
    assert choice["text"] == "abc!"
    assert choice["logprobs"] == {
        "tokens": ["a", "b", "c", "!"],
        "token_logprobs": [None, -1.0, -0.25, -0.1],
        # the k most likely (k = 1) and always the token itself
        "top_logprobs": [None, {"x": -0.5, "b": -1.0}, {"c": -0.25}, {"!": -0.1}],
        "text_offset": [0, 1, 2, 3],
    }
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 1


def test_echo_of_no_tokens_is_the_prompt_alone() -> None:
    parsed = completion(echo=True, logprobs=0, max_tokens=0)
    c = collector(parsed)
    c.feed(TokenEvent([], "length", prompt_logprobs=SCORES))
    choice = formatter(parsed).full([c], len(IDS))["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0, -0.25]
    assert choice["logprobs"]["top_logprobs"] == [None, {"b": -1.0}, {"c": -0.25}]


def test_echo_without_logprobs_is_text_only_and_stop_strings_never_cut_it() -> None:
    parsed = completion(echo=True, max_tokens=2, stop=["b"])
    c = collector(parsed, stops=["b"])
    c.feed(TokenEvent([ord("x"), ord("b")], "length"))
    choice = formatter(parsed).full([c], len(IDS))["choices"][0]
    assert choice["text"] == "abcx" and choice["logprobs"] is None and choice["finish_reason"] == "stop"


def test_a_stream_sends_the_echo_and_its_logprobs_first_then_the_new_tokens() -> None:
    parsed = completion(echo=True, logprobs=1, max_tokens=1, stream=True)
    present = ChatPresenter(formatter(parsed))
    c = collector(parsed)
    c.feed(TokenEvent([], None, prompt_logprobs=SCORES))
    first = chunks(present.delta(c))
    c.feed(BANG)
    rest = chunks(present.delta(c))
    texts = [ch["choices"][0]["text"] for ch in first + rest]
    assert "".join(texts) == "abc!" and texts[0] == PROMPT
    lp = first[0]["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a", "b", "c"] and lp["token_logprobs"] == [None, -1.0, -0.25]
    assert rest[0]["choices"][0]["logprobs"]["text_offset"] == [3]


def test_a_stream_that_reads_both_events_at_once_keeps_the_offsets() -> None:
    parsed = completion(echo=True, logprobs=1, max_tokens=1, stream=True)
    present = ChatPresenter(formatter(parsed))
    c = scored(parsed, BANG)
    (chunk, _final) = chunks(present.delta(c))
    lp = chunk["choices"][0]["logprobs"]
    assert chunk["choices"][0]["text"] == "abc!" and lp["text_offset"] == [0, 1, 2, 3]
    assert lp["tokens"] == ["a", "b", "c", "!"]


def test_vllms_prompt_logprobs_on_a_completion() -> None:
    parsed = completion(prompt_logprobs=1, max_tokens=1)
    choice = formatter(parsed).full([scored(parsed, BANG)], len(IDS))["choices"][0]
    assert choice["text"] == "!"
    assert choice["prompt_logprobs"] == [
        None,
        {"120": {"logprob": -0.5, "rank": 1, "decoded_token": "x"},
         "98": {"logprob": -1.0, "rank": 2, "decoded_token": "b"}},
        {"99": {"logprob": -0.25, "rank": 1, "decoded_token": "c"}},
    ]


def test_vllms_prompt_logprobs_on_a_chat_are_the_responses_own() -> None:
    parsed = parse_chat({"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 0}, 16)
    body = formatter(parsed).full([scored(parsed, BANG)], len(IDS))
    assert body["prompt_logprobs"] == [None, {"98": {"logprob": -1.0, "rank": 2, "decoded_token": "b"}},
                                       {"99": {"logprob": -0.25, "rank": 1, "decoded_token": "c"}}]
    assert "prompt_logprobs" not in body["choices"][0]


def test_an_answer_without_the_scores_it_asked_for_is_the_requests_failure() -> None:
    parsed = completion(echo=True, logprobs=1, max_tokens=1)
    with pytest.raises(ValueError, match="no prompt logprobs"):
        collector(parsed).feed(BANG)


def chunks(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(block.removeprefix("data: ")) for block in raw.decode().split("\n\n") if block]


class Utf8Detokenizer:
    """Token n is the byte n: a character of several bytes comes with its last one."""

    def __init__(self) -> None:
        self.pending = b""

    def add(self, ids: list[int]) -> str:
        self.pending += bytes(ids)
        for cut in range(len(self.pending), -1, -1):
            try:
                text = self.pending[:cut].decode()
            except UnicodeDecodeError:
                continue
            self.pending = self.pending[cut:]
            return text
        return ""

    def flush(self) -> str:
        text, self.pending = self.pending.decode(errors="replace"), b""
        return text


@pytest.mark.parametrize("stream", [False, True])
def test_a_token_that_is_a_piece_of_a_character_starts_where_the_character_does(stream: bool) -> None:
    """Each text_offset is where its token starts in the text, whatever the token's own
    spelling (a byte token's is longer than the character it is part of)."""
    parsed = completion(logprobs=0, max_tokens=5, stream=stream)
    text = "é!日"  # bytes: c3 a9 | 21 | e6 97 a5
    ids = list(text.encode())
    rows = [[-0.1, [t], [-0.1]] for t in ids]
    fmt = Formatter(parsed, "cmpl-1", "demo", lambda t: bytes([t]))
    c = Collector(Utf8Detokenizer(), [], 1)  # type: ignore[arg-type]
    offsets: list[int] = []
    for i in range(0, len(ids), 2):  # events of two tokens, as a batch step may bring
        c.feed(TokenEvent(ids[i:i + 2], "length" if i + 2 >= len(ids) else None, rows[i:i + 2]))
        if stream:
            delta, logprobs = c.take_delta()
            for chunk in fmt.chunks(c, delta, logprobs):
                offsets += chunk["choices"][0]["logprobs"]["text_offset"]
    if not stream:
        offsets = fmt.full([c], 1)["choices"][0]["logprobs"]["text_offset"]
    assert c.text == text
    assert offsets == [0, 0, 1, 2, 2, 2]
