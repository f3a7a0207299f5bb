"""A row's own output processing (detokenizer, stop strings, parser) failing is that
request's error (500 request_failed, with the cause), never an unhandled exception."""

from __future__ import annotations

from typing import Any

import pytest

from common.errors import RequestFailed
from common.protocol import SamplingParams
from router.http.limits import Limits
from router.http.rows import Rows
from router.http.sse import Responder
from router.job import ChoiceEvents, Job, Sampling, TokenEvent


class BrokenCollector:
    finished = False

    def feed(self, event: TokenEvent) -> None:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")


async def test_a_collector_that_raises_fails_its_request_with_the_cause() -> None:
    cancelled: list[Job] = []
    responder = Responder(cancel=cancelled.append, limits=Limits(), metrics=None)
    rows = Rows("r1", prompt_tokens=3)
    rows.jobs.append(Job(request_id="r1", prompt_ids=[1, 2, 3], sampling=Sampling(4, SamplingParams()),
                         deadline=1e9, enqueued_at=0.0, events=ChoiceEvents(rows.events, 0)))
    rows.events.put_nowait((0, TokenEvent([5], None)))
    present: Any = None
    with pytest.raises(RequestFailed) as info:
        await responder.collect(rows, [BrokenCollector()], present)  # type: ignore[list-item]
    body = info.value.to_body()["error"]
    assert info.value.status == 500 and body["code"] == "request_failed"
    assert "UnicodeDecodeError" in body["message"]
