"""Tests for bench/beforequeue.py's pure parts: the sessions it sends and the log line it reads."""

from __future__ import annotations

import logging
import random

from bench.beforequeue import _BEFORE_QUEUE, AGENT_TOOLS, Session
from common.log import TextFormatter, about


def test_a_session_resends_its_chat_and_adds_a_call_and_a_result_each_turn() -> None:
    session = Session(lambda text: text.split(), 0, system_tokens=20, turn_tokens=10, turns=3,
                      rng=random.Random(1))
    turns = [session.messages(t) for t in range(3)]
    assert [len(m) for m in turns] == [2, 4, 6]
    assert turns[2][:4] == turns[1]  # an agent only appends
    call, result = turns[1][2:]
    assert call["tool_calls"][0]["id"] == result["tool_call_id"]
    assert len(AGENT_TOOLS) == 8 and len({t["function"]["name"] for t in AGENT_TOOLS}) == 8


def test_the_routers_info_line_is_read_by_request_id() -> None:
    record = logging.LogRecord("router.http.api", logging.INFO, "", 0,
                               "finished: %s, prompt %d tokens, completion %d tokens, queued %.3fs, ttft %s, "
                               "total %.3fs (HTTP before the queue %s, first token to first byte %s)",
                               ("length", 3000, 1, 0.0, "0.5s", 0.6, "2.04ms", "-"), None)
    record.__dict__.update(about("bq-agent-0-1"))
    line = TextFormatter("%(asctime)s router[%(process)d] %(levelname)s %(name)s: %(message)s").format(record)
    match = _BEFORE_QUEUE.search(line)
    assert match is not None and match["id"] == "bq-agent-0-1" and float(match["ms"]) == 2.04
