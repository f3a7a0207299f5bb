"""Tests for router/chat/stops.py: stop strings over arbitrarily chunked text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import BadRequest
from router.chat.stops import StopMatcher


def expected_output(text: str, stops: list[str]) -> tuple[str, bool]:
    """The specification: text up to the earliest occurrence of any stop string."""
    found = [i for s in stops if (i := text.find(s)) != -1]
    return (text[: min(found)], True) if found else (text, False)


def run(stops: list[str], chunks: list[str]) -> tuple[str, bool, list[str]]:
    """Feed chunks until a stop; return (all sent text, stopped, the pieces sent)."""
    matcher = StopMatcher(stops)
    pieces: list[str] = []
    stopped = False
    for chunk in chunks:
        piece, stopped = matcher.feed(chunk)
        pieces.append(piece)
        if stopped:
            break
    if not stopped:
        pieces.append(matcher.flush())
        stopped = matcher.is_stopped
    return "".join(pieces), stopped, pieces


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


# A small alphabet makes overlapping and partial matches frequent
small_text = st.text(alphabet="ab\nxé🙂", max_size=40)
stop_lists = st.lists(st.text(alphabet="ab\nxé🙂", min_size=1, max_size=4), max_size=4)


@settings(max_examples=300, deadline=None)
@given(text=small_text, stops=stop_lists, cuts=st.lists(st.integers(0, 60), max_size=12))
def test_any_chunking_gives_text_before_first_stop(text: str, stops: list[str], cuts: list[int]) -> None:
    sent, stopped, _ = run(stops, split(text, cuts))
    assert (sent, stopped) == expected_output(text, stops)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=60), stops=st.lists(st.text(min_size=1, max_size=6), max_size=4),
       cuts=st.lists(st.integers(0, 80), max_size=10))
def test_arbitrary_unicode(text: str, stops: list[str], cuts: list[int]) -> None:
    sent, stopped, _ = run(stops, split(text, cuts))
    assert (sent, stopped) == expected_output(text, stops)


@settings(max_examples=200, deadline=None)
@given(text=small_text, stops=stop_lists)
def test_one_character_at_a_time_sends_only_prefixes_of_the_result(text: str, stops: list[str]) -> None:
    _, _, pieces = run(stops, list(text))
    sent_so_far = ""
    want, _ = expected_output(text, stops)
    for piece in pieces:
        sent_so_far += piece
        assert want.startswith(sent_so_far)


def test_stop_split_across_chunks() -> None:
    m = StopMatcher(["</end>"])
    assert m.feed("hello </") == ("hello ", False)
    assert m.feed("en") == ("", False)
    assert m.feed("d> and more") == ("", True)
    assert m.feed("anything") == ("", True)
    assert m.flush() == ""


def test_partial_prefix_released_when_it_does_not_complete() -> None:
    m = StopMatcher(["</end>"])
    assert m.feed("a </e") == ("a ", False)
    assert m.feed("x") == ("</ex", False)
    assert m.feed("</") == ("", False)
    assert m.flush() == "</"
    assert not m.is_stopped


def test_stop_at_very_start() -> None:
    assert StopMatcher(["Hi"]).feed("Hi there") == ("", True)


def test_stop_inside_one_chunk_cuts_the_rest() -> None:
    assert StopMatcher(["\n\n"]).feed("one\n\ntwo") == ("one", True)


def test_earliest_stop_wins_regardless_of_list_order() -> None:
    assert StopMatcher(["c", "b"]).feed("abc") == ("a", True)


def test_longer_stop_starting_earlier_wins_over_shorter_completed_first() -> None:
    # "abcd" starts before "c": with any chunking the output is text[:0]
    m = StopMatcher(["abcd", "c"])
    assert m.feed("abc") == ("", False)
    assert m.feed("d") == ("", True)
    m = StopMatcher(["abcd", "c"])
    assert m.feed("abc") == ("", False)
    assert m.feed("x") == ("ab", True)


def test_flush_cuts_at_a_stop_found_in_the_held_tail() -> None:
    m = StopMatcher(["abcd", "c"])
    assert m.feed("zabc") == ("z", False)
    assert m.flush() == "ab"
    assert m.is_stopped


def test_no_stops_passes_text_through() -> None:
    m = StopMatcher([])
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""


def test_emoji_and_cjk_stops() -> None:
    m = StopMatcher(["日本", "🙂"])
    assert m.feed("café 日") == ("café ", False)
    assert m.feed("本語") == ("", True)


@pytest.mark.parametrize("stops", [["a", "b", "c", "d", "e"], [""], ["ok", ""], "stop", [1]])
def test_invalid_stops_are_bad_requests(stops: object) -> None:
    with pytest.raises(BadRequest) as info:
        StopMatcher(stops)  # type: ignore[arg-type]
    assert info.value.param == "stop"
