"""Tests for bench/apis.py: the per-wave arithmetic and the stream readers of each API."""

from __future__ import annotations

import math

from bench.apis import APIS, summarize
from bench.metrics import RequestResult


def result(ttft_s: float, tokens: int = 10) -> RequestResult:
    return RequestResult(ok=True, ttft_s=ttft_s, completion_tokens=tokens, latency_s=1.0)


def test_figures_are_medians_of_per_wave_comparisons_with_chat() -> None:
    runs = {
        "chat": [([result(0.10)], 1.0), ([result(0.30)], 2.0), ([result(0.20)], 1.0)],
        "messages": [([result(0.11)], 1.0), ([result(0.32)], 2.0), ([result(0.21)], 1.25)],
        "responses": [([result(0.10)], 1.0), ([result(0.30)], 2.0),
                      ([RequestResult(error="HTTP 500")], 1.0)],
    }
    out = summarize(runs)
    assert out["chat"]["added_ttft_ms"] == 0 and out["chat"]["tokens_per_s_ratio"] == 1
    assert math.isclose(out["messages"]["added_ttft_ms"], 10.0)   # median of 10, 20, 10 ms
    assert math.isclose(out["messages"]["tokens_per_s_ratio"], 1.0)  # median of 1, 1, 0.8
    assert out["responses"]["errors"] == 1 and out["responses"]["error_samples"] == ["HTTP 500"]
    assert math.isclose(out["responses"]["tokens_per_s_ratio"], 1.0)  # 1, 1, 0
    assert math.isclose(out["chat"]["tokens_per_s"], 30 / 4.0)


def test_each_api_reads_its_own_stream_shapes() -> None:
    chat, messages, responses = APIS
    assert chat.text({"choices": [{"delta": {"content": "hi"}}]}) == "hi"
    assert chat.usage({"choices": [], "usage": {"completion_tokens": 5}}) == 5
    assert messages.text({"type": "content_block_delta", "delta": {"type": "text_delta", "text": "hi"}}) == "hi"
    assert messages.usage({"type": "message_delta", "usage": {"output_tokens": 5}}) == 5
    assert messages.ends({"type": "message_stop"}) and not messages.ends({"type": "ping"})
    assert responses.text({"type": "response.output_text.delta", "delta": "hi"}) == "hi"
    final = {"type": "response.incomplete", "response": {"usage": {"output_tokens": 5}}}
    assert responses.usage(final) == 5 and responses.ends(final)
    for api in APIS:
        body = api.body("a prompt", 7)
        assert body["stream"] is True and body["ignore_eos"] is True and 7 in body.values()
