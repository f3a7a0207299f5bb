"""Tests for the agents workload's pure parts: bench/agent_sessions.py (how a session grows,
what every turn sends) and bench/agent_report.py (percentiles, ratios, spread, table)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from bench.agent_report import TurnRecord, derive, figures, ratios, spread, summarize
from bench.agent_report import render as render_report
from bench.agent_sessions import (AGENT_TOOLS, Shape, accounting, make_sessions, num_earlier_exchanges,
                                  template_messages)
from bench.agents import _seconds_range, chat_body, missing
from bench.gpu_run import PARTS, make_parser


def encode(text: str) -> list[int]:
    return list(text.encode())


def render_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
    """ChatML-like, one byte a token: tools in the system turn, then each message, then the
    generation prompt (which the next turn's assistant message starts with)."""
    out = f"<tools>{json.dumps(tools)}</tools>" if tools else ""
    for m in template_messages(messages):
        calls = json.dumps(m.get("tool_calls") or [])
        out += f"<{m['role']}>{m['content']}{calls if m.get('tool_calls') else ''}</>"
    return encode(out + "<assistant>")


def shape(**kw: Any) -> Shape:
    base = {"system_tokens": 1400, "grow_to_tokens": 0, "turn_tokens": 200, "num_turns": 4, "num_tools": 2}
    return Shape(**{**base, **kw})


def test_turns_only_append_and_add_about_turn_tokens() -> None:
    sessions = make_sessions(encode, render_chat, "t", 3, shape(), tool_time_s=(0.5, 2.0), seed=7)
    for s in sessions:
        assert len(s.prompt_ids) == 4 and s.turn_ends == (2, 4, 6, 8)
        for before, after in zip(s.prompt_ids, s.prompt_ids[1:]):
            assert after[:len(before)] == before       # a cache of the previous turn always applies
        # Each later turn: the scripted answer with a tool call, then the tool's result.
        for turn in range(1, 4):
            added = s.request(turn)[-2:]
            assert added[0]["role"] == "assistant" and added[0]["tool_calls"][0]["type"] == "function"
            assert added[1] == {"role": "tool", "tool_call_id": added[0]["tool_calls"][0]["id"],
                                "content": added[1]["content"]}
            assert 150 <= s.new_tokens(turn) <= 200 + 40, s.new_tokens(turn)
        assert s.new_tokens(0) == len(s.prompt_ids[0])
        # The request is the wire shape: tool-call arguments as JSON text.
        assert isinstance(s.request(3)[2]["tool_calls"][0]["function"]["arguments"], str)
    system_turns = [s.messages[0]["content"] for s in sessions]
    assert len(set(system_turns)) == 3                  # distinct sessions ...
    body = system_turns[0].split("\n\nEnvironment")[0]
    assert all(t.startswith(body) for t in system_turns)  # ... sharing the agent's prompt
    assert len({s.messages[1]["content"] for s in sessions}) == 3   # and each its own task
    assert all(s.tools == tuple(AGENT_TOOLS[:2]) for s in sessions)
    first = len(render_chat(sessions[0].request(0)[:1], list(AGENT_TOOLS[:2])))
    assert 1300 <= first <= 1400                        # system prompt + tools ~ system_tokens


def test_sessions_grow_to_the_target_through_earlier_exchanges() -> None:
    (s,) = make_sessions(encode, render_chat, "g", 1, shape(grow_to_tokens=4000), tool_time_s=(0, 0), seed=1)
    head = len(render_chat(list(s.messages[:2]), list(s.tools)))
    earlier = num_earlier_exchanges(head, shape(grow_to_tokens=4000))
    assert earlier == round((4000 - head - 3 * 200) / 200) > 0
    assert s.turn_ends[0] == 2 + 2 * earlier
    # Within one turn of the target: a turn adds up to turn_tokens + 40 (its words are drawn
    # unseeded, so no run reuses another's cache; 1 in 25 runs came out 209 over).
    assert abs(len(s.prompt_ids[-1]) - 4000) <= 200 + 40
    acc = accounting([s])
    assert acc["earlier_exchanges"] == earlier and acc["turns"] == 4
    assert acc["first_prompt_tokens_mean"] == len(s.prompt_ids[0])
    assert acc["last_prompt_tokens_mean"] == len(s.prompt_ids[-1])
    new = [s.new_tokens(t) for t in (1, 2, 3)]
    assert acc["new_tokens_per_turn_mean"] == sum(new) / 3
    assert (acc["new_tokens_per_turn_min"], acc["new_tokens_per_turn_max"]) == (min(new), max(new))
    assert num_earlier_exchanges(10_000, shape(grow_to_tokens=4000)) == 0   # never negative


def test_tool_times_are_seeded_and_in_range() -> None:
    a = make_sessions(encode, render_chat, "a", 2, shape(), tool_time_s=(0.5, 2.0), seed=3)
    b = make_sessions(encode, render_chat, "b", 2, shape(), tool_time_s=(0.5, 2.0), seed=3)
    assert [s.tool_times_s for s in a] == [s.tool_times_s for s in b]   # every system: the same pauses
    assert a[0].tool_times_s != a[1].tool_times_s
    assert all(0.5 <= t <= 2.0 for s in a for t in s.tool_times_s)
    assert a[0].messages[0]["content"] != b[0].messages[0]["content"]  # but never the same words
    assert accounting(a)["tool_time_s_total"] == pytest.approx(sum(sum(s.tool_times_s[:3]) for s in a), abs=1e-3)


def test_sizes_that_cannot_work_are_refused() -> None:
    with pytest.raises(ValueError, match="tools \\(and template\\) take"):
        make_sessions(encode, render_chat, "x", 1, shape(system_tokens=300, num_tools=8), tool_time_s=(0, 0), seed=0)
    with pytest.raises(ValueError, match="turns"):
        shape(num_turns=1)
    with pytest.raises(ValueError):
        shape(num_tools=len(AGENT_TOOLS) + 1)
    assert _seconds_range("0.5,2") == (0.5, 2.0) and _seconds_range("1") == (1.0, 1.0)
    with pytest.raises(ValueError):
        _seconds_range("2,1")


def test_template_messages_parse_arguments_once() -> None:
    m = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}
    once = template_messages([m])
    assert once[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert template_messages(once) == once
    assert m["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'   # the request is untouched


def rec(system: str, rep: int, session: int, turn: int, ttft_ms: float, **kw: Any) -> TurnRecord:
    base = {"ok": True, "latency_s": ttft_ms / 1e3 + 1.0, "decode_s": 0.5, "completion_tokens": 11,
            "prompt_tokens": 1000 + 100 * turn, "cached_tokens": 900 + 100 * turn if turn else 0}
    return TurnRecord(system, 2, rep, session, turn, 1000 + 100 * turn, 100, ttft_s=ttft_ms / 1e3, **{**base, **kw})


def test_figures_split_cold_and_cached_turns() -> None:
    records = [rec("h", 0, 0, 0, 900.0), rec("h", 0, 1, 0, 1100.0),
               *(rec("h", 0, s, t, 100.0 * t) for s in (0, 1) for t in (1, 2, 3)),
               rec("h", 0, 0, 4, 5.0, ok=False, error="HTTP 503")]
    f = figures(records)
    assert f["cold_ttft_p50_ms"] == pytest.approx(1000.0)
    assert f["cold_ttft_p99_ms"] == pytest.approx(900 + 200 * 0.99)           # linear interpolation
    assert f["cached_ttft_p50_ms"] == pytest.approx(200.0)
    assert f["cached_ttft_p99_ms"] == pytest.approx(300.0)
    assert f["out_tps_p50"] == pytest.approx(10 / 0.5)                         # (tokens - 1) / decode
    assert f["turn_s_p50"] == pytest.approx(1.25)             # cold turns count too
    s = summarize(records)
    assert s["errors"] == 1 and s["error_samples"] == ["HTTP 503"] and s["turns"] == 9
    assert s["cached_token_ratio"] == pytest.approx((1000 + 1100 + 1200) * 2 / ((1100 + 1200 + 1300) * 2))
    assert s["prompt_mismatches"] == 0 and set(s["by_rep"]) == {"0"}
    bad = summarize([rec("m", 0, 0, 1, 50.0, prompt_tokens=999, cached_tokens=None)])
    assert bad["prompt_mismatches"] == 1 and math.isnan(bad["cached_token_ratio"])
    assert math.isnan(figures([])["cached_ttft_p50_ms"])
    assert TurnRecord("x", 1, 0, 0, 0, 10, 10, completion_tokens=1, decode_s=0.1).out_tps is None


def _workload(system: str, cached_ms: list[float]) -> dict[str, Any]:
    return summarize([r for rep, ms in enumerate(cached_ms)
                      for r in (rec(system, rep, 0, 0, 10 * ms), rec(system, rep, 0, 1, ms))])


def test_ratios_are_headroom_over_peer_with_the_spread_over_repetitions() -> None:
    results = {"headroom": {"n1": _workload("headroom", [100.0, 150.0])},
               "mlx_lm_server": {"n1": _workload("mlx_lm_server", [200.0, 100.0])},
               "inprocess": {"n1": _workload("inprocess", [50.0, 75.0])}}
    out, targets, notes = derive(results)
    vs_server = out["n1"]["mlx_lm_server"]["cached_ttft_p50_ms"]
    assert vs_server["by_rep"] == [0.5, 1.5] and (vs_server["min"], vs_server["max"]) == (0.5, 1.5)
    assert vs_server["pooled"] == pytest.approx(125.0 / 150.0)
    assert out["n1"]["inprocess"]["cached_ttft_p50_ms"]["pooled"] == pytest.approx(2.0)
    assert out["n1"]["inprocess"]["out_tps_p50"]["pooled"] == pytest.approx(1.0)
    assert targets == [{"target": "Headroom cached-turn TTFT p50 ÷ mlx_lm.server's at N = 1",
                        "value": pytest.approx(125 / 150), "bound": "<= 1.0", "verdict": "MET"}]
    assert notes == []
    assert spread([100.0, 150.0]) == pytest.approx(0.4) and math.isnan(spread([1.0]))
    assert math.isnan(ratios(results["headroom"]["n1"], summarize([]))["cold_ttft_p50_ms"]["pooled"])
    sessions = make_sessions(encode, render_chat, "r", 1, shape(), tool_time_s=(0, 0), seed=0)
    doc = {"meta": {"model": {"name": "demo"}, "repeats": 2, "tools": 2, "max_tokens": 11, "tool_time_s": [0.5, 2.0]},
           "accounting": {"n1": accounting(sessions)},
           "results": results, "ratios": out, "targets": targets, "notes": ["a note"]}
    text = render_report(doc)
    assert "| headroom | 1 | 4 (0) | 1,250.0 |" in text
    assert "| 1 | cached_ttft_p50_ms | 0.83 (0.50–1.50) | 2.00 (2.00–2.00) |" in text
    assert "at N = 1 = 0.833 <= 1.0: MET" in text and "note: a note" in text


def test_gpu_run_has_an_agents_part() -> None:
    assert "agents" in PARTS
    assert make_parser().parse_args(["agents"]).parts == ["agents"]


def test_every_turn_is_accounted_for_and_sent_as_rendered() -> None:
    sessions = make_sessions(encode, render_chat, "m", 2, shape(num_turns=3), tool_time_s=(0, 0), seed=0)
    done = [TurnRecord("h", 2, 0, 0, 0, 10, 10, ok=True), TurnRecord("h", 2, 0, 1, 0, 10, 10, ok=True)]
    gone = missing("h", sessions, done, 0, 60.0)
    assert sorted((r.session, r.turn) for r in gone) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert all(not r.ok and "60 s" in (r.error or "") for r in gone)
    assert gone[0].expected_prompt_tokens == len(sessions[0].prompt_ids[1])
    body = chat_body(sessions[0], 2, 48, {"model": "default_model"})
    assert body["model"] == "default_model" and body["max_tokens"] == 48 and body["stream"]
    assert body["tools"] == list(AGENT_TOOLS[:2]) and body["messages"] == sessions[0].request(2)
    assert render_chat(body["messages"], body["tools"]) == list(sessions[0].prompt_ids[2])
