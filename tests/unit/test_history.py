"""router/ops/history.py: the recent past for the status page, with times given by the caller."""

from __future__ import annotations

from common.errors import BadRequest, InsufficientMemory, QueueFull
from router.ops.history import SAMPLE_INTERVAL_S, History, Sample


def test_tokens_per_s_is_the_rate_since_the_previous_sample() -> None:
    h = History()
    assert h.tokens_per_s(100.0, 0) == 0.0          # nothing to compare with yet
    assert h.tokens_per_s(101.0, 50) == 50.0
    assert h.tokens_per_s(103.0, 150) == 50.0
    assert h.tokens_per_s(103.0, 200) == 0.0        # no time passed: no rate, not a division by zero


def test_samples_are_bounded_to_the_window_and_filtered_by_since() -> None:
    h = History(window_s=10.0)
    for t in range(100):
        h.add(Sample(at=float(t), queued=0, running=0, tokens_per_s=0.0))
    assert len(h.samples) == int(10.0 / SAMPLE_INTERVAL_S) + 1
    assert [s["at"] for s in h.samples_since(97.0)] == [98.0, 99.0]
    assert h.samples_since(None)[-1]["at"] == 99.0


def test_ttft_summary_uses_nearest_rank_within_the_window() -> None:
    h = History(window_s=60.0)
    assert h.ttft_summary(0.0) == {"count": 0, "last_s": None, "p50_s": None, "p95_s": None}
    h.note_ttft(0.0, 99.0)                            # outside the window at now=100
    for i in range(1, 21):
        h.note_ttft(50.0 + i, i / 10)
    summary = h.ttft_summary(100.0)
    assert summary == {"count": 20, "last_s": 2.0, "p50_s": 1.0, "p95_s": 1.9}


def test_rejections_keep_server_text_but_not_text_that_may_quote_the_client() -> None:
    h = History()
    h.note_rejection(1.0, "a", "chat", BadRequest("messages[0].role must be one of ..., got 'SECRET'",
                                                  param="messages[0]"))
    h.note_rejection(2.0, "b", "chat", InsufficientMemory("needs 3 GiB, the budget is 1 GiB",
                                                          param="max_tokens"))
    h.note_rejection(3.0, None, "completions", QueueFull("the queue is full"))
    newest, memory, bad = h.recent_rejections()
    assert newest["code"] == "queue_full" and newest["status"] == 429 and newest["request_id"] is None
    assert memory["message"] == "needs 3 GiB, the budget is 1 GiB" and memory["status"] == 400
    assert bad["message"] is None and bad["param"] == "messages[0]" and bad["code"] == "invalid_request"


def test_rejections_are_bounded() -> None:
    h = History()
    for i in range(100):
        h.note_rejection(float(i), str(i), "chat", QueueFull("full"))
    got = h.recent_rejections()
    assert len(got) < 100 and got[0]["request_id"] == "99"
