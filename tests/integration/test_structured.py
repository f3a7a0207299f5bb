"""Structured output, tool calls and reasoning through the official openai client.

The demo model has random weights: its JSON and its tool calls exist only because the
worker's grammar allows nothing else, so each answer is checked against its schema.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.integration.conftest import Router

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}}, "required": ["tz"],
        "additionalProperties": False}}},  # bounded: an open object lets sampling run on
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(router: Router) -> Iterator[openai.OpenAI]:
    with router.client() as c:
        yield c


def chat(client: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 200)
    return client.chat.completions.create(model="m", messages=kw.pop("messages", MESSAGES), **kw)


def assemble(stream: Any) -> dict[str, Any]:
    """A streamed choice 0 put back together from its deltas."""
    content, reasoning, finish = "", "", None
    calls: dict[int, dict[str, Any]] = {}
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            for tc in c.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert call["id"] is None and call["arguments"] == ""  # id and name first
                    call["id"], call["name"] = tc.id, tc.function.name
                call["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return {"content": content, "reasoning": reasoning, "finish": finish,
            "calls": [calls[i] for i in sorted(calls)]}


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_json_schema(client: openai.OpenAI, temperature: float) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = chat(client, response_format=fmt, temperature=temperature, seed=3)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    streamed = assemble(chat(client, response_format=fmt, temperature=temperature, seed=3,
                             stream=True))
    assert streamed["finish"] == "stop"
    jsonschema.validate(json.loads(streamed["content"]), PERSON)
    assert streamed["content"] == r.choices[0].message.content  # same seed, same tokens


def test_json_schema_on_completions(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = client.completions.create(model="m", prompt="A person:", max_tokens=200,
                                           temperature=0, extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_json_schema_with_n_3(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = chat(client, response_format=fmt, n=3, temperature=1.0, seed=5)
    assert len(r.choices) == 3
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_unenforceable_schema_is_a_400(router: Router) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?=lookahead)"}}}}}
    r = router.http.post("/v1/chat/completions", json={"messages": MESSAGES, "response_format": fmt})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "response_format" and "look-around" in error["message"]


def check_call(call: dict[str, Any], name: str | None = None) -> None:
    assert call["id"].startswith("call_")
    assert name is None or call["name"] == name
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_named_tool_choice(client: openai.OpenAI) -> None:
    r = chat(client, tools=TOOLS, tool_choice=NAMED, temperature=0.8, seed=7)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls and len(choice.message.tool_calls) == 1
    tc = choice.message.tool_calls[0]
    check_call({"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments},
               "get_weather")
    assert not choice.message.content


def test_named_tool_choice_streamed(client: openai.OpenAI) -> None:
    out = assemble(chat(client, tools=TOOLS, tool_choice=NAMED, temperature=0.8, seed=7,
                        stream=True))
    assert out["finish"] == "tool_calls" and len(out["calls"]) == 1
    check_call(out["calls"][0], "get_weather")


def test_required_tool_choice(client: openai.OpenAI) -> None:
    """``required``: one or more calls. The demo model's end token has logit 0, so greedily
    it goes on to a next call until max_tokens cuts one; with parallel calls off the grammar
    ends after the first."""
    r = chat(client, tools=TOOLS, tool_choice="required", temperature=0, parallel_tool_calls=False)
    [call] = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    check_call({"id": call.id, "name": call.function.name, "arguments": call.function.arguments})
    r = chat(client, tools=TOOLS, tool_choice="required", temperature=0)
    *whole, cut = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "length" and len(whole) >= 1
    for tc in whole:
        check_call({"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments})
    assert cut.function.name in SCHEMAS


def test_tool_round_trip_in_history(client: openai.OpenAI) -> None:
    """A call and its result in the history render through the template."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    plain = chat(client, messages=MESSAGES, tools=TOOLS[:1], max_tokens=1)
    r = chat(client, messages=history, tools=TOOLS[:1], max_tokens=1, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    # the call's JSON and the result are in the prompt: more tokens than the question alone
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 20


def test_tool_choice_none_renders_no_tools(client: openai.OpenAI) -> None:
    plain = chat(client, max_tokens=1)
    none = chat(client, tools=TOOLS[1:], tool_choice="none", max_tokens=1)
    auto = chat(client, tools=TOOLS[1:], max_tokens=1)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens


def test_reasoning_content(client: openai.OpenAI) -> None:
    """With thinking on, the prompt opens <think>: what the model writes is reasoning until
    it closes it (this model never does), and stays inline when the request asks."""
    kw: dict[str, Any] = dict(max_tokens=12, temperature=0,
                              extra_body={"chat_template_kwargs": {"enable_thinking": True},
                                          "ignore_eos": True})
    r = chat(client, **kw)
    reasoning = r.choices[0].message.reasoning_content  # type: ignore[attr-defined]
    assert reasoning and not r.choices[0].message.content
    streamed = assemble(chat(client, **kw, stream=True))
    assert streamed["reasoning"] == reasoning and streamed["content"] == ""
    kw["extra_body"] = {**kw["extra_body"], "separate_reasoning": False}
    inline = chat(client, **kw)
    assert inline.choices[0].message.content == reasoning


def test_forced_output_after_an_opened_thought(client: openai.OpenAI) -> None:
    """With thinking on, the prompt opens <think>: a forced call or JSON closes it first, so
    it arrives as the call or the content (not swallowed as reasoning), streamed and not."""
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    r = chat(client, tools=TOOLS, tool_choice=NAMED, temperature=0, extra_body=thinking)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert not getattr(choice.message, "reasoning_content", None)
    (tc,) = choice.message.tool_calls or []
    check_call({"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments},
               "get_weather")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    streamed = assemble(chat(client, response_format=fmt, temperature=0, extra_body=thinking,
                             stream=True))
    assert streamed["finish"] == "stop" and streamed["reasoning"] == ""
    jsonschema.validate(json.loads(streamed["content"]), PERSON)


def test_json_object_is_enforced(client: openai.OpenAI, cache_home: Path) -> None:
    # A logit bias that alone would make the answer start with "}" (not JSON); the
    # json_object grammar must open the object first, and the bias then closes it.
    from tokenizers import Tokenizer

    from worker.demo import demo_folder

    tok = Tokenizer.from_file(str(demo_folder(cache_home / "mlx-headroom") / "tokenizer.json"))
    close = tok.token_to_id("}")
    assert close is not None
    bias = {"logit_bias": {str(close): 100}}
    free = chat(client, temperature=0, max_tokens=4, extra_body=bias)
    assert free.choices[0].message.content.startswith("}")
    for stream in (False, True):
        r = chat(client, temperature=0, max_tokens=64, response_format={"type": "json_object"},
                 extra_body=bias, stream=stream)
        content, finish = ((s := assemble(r))["content"], s["finish"]) if stream else \
            (r.choices[0].message.content, r.choices[0].finish_reason)
        assert finish == "stop" and isinstance(json.loads(content), dict), content
