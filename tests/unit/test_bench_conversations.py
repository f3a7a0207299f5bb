"""Tests for bench/conversations.py: the multi-turn workload and its figures (pure)."""

from __future__ import annotations

import math

import pytest

from bench.conversations import TOOLS, TurnResult, make_conversations, render, summarize


def encode(text: str) -> list[int]:
    return list(text.encode())


def test_turns_only_append() -> None:
    (conv,) = make_conversations(encode, "t", 1, system_tokens=200, turns=4, turn_tokens=30)
    replies = ["first answer", "second", "third"]
    previous = conv.messages(0, [])
    assert [m["role"] for m in previous] == ["system", "user"]
    for turn in range(1, 4):
        messages = conv.messages(turn, replies[:turn])
        assert messages[:len(previous)] == previous          # the prefix never changes
        assert messages[len(previous)] == {"role": "assistant", "content": replies[turn - 1]}
        assert messages[-1] == {"role": "user", "content": conv.users[turn]}
        previous = messages
    with pytest.raises(ValueError):
        conv.messages(2, replies[:1])


def test_conversations_are_unique_and_sized() -> None:
    convs = make_conversations(encode, "t", 3, system_tokens=200, turns=2, turn_tokens=30, num_tools=2)
    assert len({c.system for c in convs}) == 3 and len({c.tag for c in convs}) == 3
    # The system prompts differ from their first tokens: no conversation reuses another's.
    assert len({c.system[:20] for c in convs}) == 3
    for c in convs:
        assert 150 <= len(encode(c.system)) <= 200
        assert all(len(encode(u)) <= 30 for u in c.users) and c.num_tools == 2
    assert len(TOOLS) == 4


def test_summary_splits_cold_and_cached_turns() -> None:
    def turn(t: int, ttft: float, prompt: int, cached: int | None, restart: bool = False) -> TurnResult:
        return TurnResult("x", 1, 0, t, ok=True, ttft_s=ttft, prompt_tokens=prompt,
                          cached_tokens=cached, after_restart=restart)

    results = [turn(0, 10.0, 500, 0), turn(1, 1.0, 600, 500), turn(2, 2.0, 700, 600),
               turn(3, 5.0, 800, 0, restart=True), TurnResult("x", 1, 1, 0, error="HTTP 500")]
    s = summarize(results)
    assert s["cold_ttft_p50_s"] == 10.0 and s["cached_ttft_p50_s"] == 1.5
    assert s["cached_over_cold"] == 0.15
    assert s["cached_token_ratio"] == 1100 / 1300
    assert s["errors"] == 1 and s["reports_cached_tokens"]
    unreported = summarize([turn(0, 10.0, 500, None), turn(1, 1.0, 600, None)])
    assert unreported["cached_token_ratio"] == 0 and not unreported["reports_cached_tokens"]
    assert math.isnan(summarize([])["cached_over_cold"])
    doc = {"results": {"headroom": {"c1": {**s, "peak_rss_bytes": 2**30},
                                    "restart": {"back_after_s": 3.0, "ok": True, "ttft_s": 2.0,
                                                "cached_tokens": 700, "prompt_tokens": 800}},
                       "mlx_lm_server": {"c1": {**unreported, "peak_rss_bytes": 2**30}}}}
    text = render(doc)
    assert "| headroom | 1 | 10.000 | 1.500 | 0.150 | 0.85 | 1024 | 1 |" in text
    assert "0 (not reported)" in text and "| headroom | 3.0 | 2.000 | 700 / 800 | 0.200 |" in text
    assert "÷ mlx_lm.server's = 1.500" in text
