"""router/http/reqid.py: which client ids are honoured, and that live ids stay unique."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.http.reqid import ROW_SEP, RequestIds, is_sane, make_request_id


def test_our_ids_are_sane() -> None:
    assert is_sane(make_request_id())


@pytest.mark.parametrize("value", ["abc", "A1", "0f3e-4c2a-9b1d", "trace:1234.5_6=+", "x" * 128,
                                   "627bc797874215bb63aef02c"])
def test_sane_ids_are_honoured(value: str) -> None:
    assert is_sane(value)
    assert RequestIds().claim(value) == value


@pytest.mark.parametrize("value", ["", "x" * 129, "has space", "a/b", "quote\"", "new\nline",
                                   "-leading-dash", ".dot", "ünïcode", "<script>"])
def test_insane_ids_are_replaced_by_ours(value: str) -> None:
    assert not is_sane(value)
    got = RequestIds().claim(value)
    assert got != value and is_sane(got) and len(got) == 24


def test_a_live_id_is_not_given_twice() -> None:
    ids = RequestIds()
    first, second, third = ids.claim("dup"), ids.claim("dup"), ids.claim("dup")
    assert (first, second, third) == ("dup", "dup.2", "dup.3")
    ids.live.discard("dup")
    assert ids.claim("dup") == "dup"  # free again once its request is over
    assert ids.claim(None) != ids.claim(None)


@settings(deadline=None)  # a descheduled example is not a failure
@given(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.:=+-]{0,20}-[0-9]", fullmatch=True))
def test_no_client_id_is_another_requests_row(value: str) -> None:
    # A choice's row id is "<request id>#<index>": a client id such as "abc-0" is honoured
    # and can never equal the row of a live request "abc" with n > 1.
    assert is_sane(value) and ROW_SEP not in value
    assert not is_sane(f"abc{ROW_SEP}0")
