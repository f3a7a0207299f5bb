"""Tests for router/chat/schema.py: every validation rule raises BadRequest naming its param."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import BadRequest
from common.protocol import SamplingParams
from router.chat.schema import MAX_STOPS, NEUTRAL, parse_chat, parse_completion
from router.job import ROOM_LEFT, Sampling

DEFAULT_MAX = 512
USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "x", "messages": USER, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "x", "prompt": "hi", **fields}


def refused(parse: Any, body: Any) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        parse(body, DEFAULT_MAX)
    err = info.value
    assert err.status == 400 and err.code == "invalid_request"
    return err


BOTH = pytest.mark.parametrize(("parse", "make"), [(parse_chat, chat), (parse_completion, completion)],
                               ids=["chat", "completion"])


# -- body and prompt -----------------------------------------------------------------


@pytest.mark.parametrize("body", [None, [], "text", 1, True, [{"prompt": "x"}]])
@pytest.mark.parametrize("parse", [parse_chat, parse_completion])
def test_body_must_be_an_object(parse: Any, body: Any) -> None:
    assert refused(parse, body).param is None


def test_completion_defaults() -> None:
    parsed = parse_completion({"prompt": "hello"}, DEFAULT_MAX)
    assert parsed.kind == "completion"
    assert parsed.prompts == ["hello"] and parsed.messages is None
    assert parsed.sampling == Sampling(max_tokens=DEFAULT_MAX, params=SamplingParams(temperature=1.0))
    assert parsed.n == 1 and parsed.num_choices == 1
    assert parsed.stream is False and parsed.include_usage is False
    assert parsed.stop == [] and parsed.model == ""


def test_chat_defaults() -> None:
    parsed = parse_chat({"messages": USER}, 7)
    assert parsed.kind == "chat"
    assert parsed.messages == [{"role": "user", "content": "hi"}]
    assert parsed.sampling.max_tokens == 7
    assert parsed.prompts is None


def test_model_is_echoed() -> None:
    assert parse_chat(chat(model="gpt-4o"), DEFAULT_MAX).model == "gpt-4o"


@BOTH
@pytest.mark.parametrize("model", [1, ["a"], {"a": 1}, True])
def test_model_must_be_a_string(parse: Any, make: Any, model: Any) -> None:
    assert refused(parse, make(model=model)).param == "model"


@pytest.mark.parametrize(("prompt", "prompts"), [
    ("abc", ["abc"]),
    ([1, 2, 3], [[1, 2, 3]]),
    (["abc"], ["abc"]),
    ([[4, 5]], [[4, 5]]),
    (["a", "b"], ["a", "b"]),
    ([[1], "b", [2, 3]], [[1], "b", [2, 3]]),
])
def test_completion_prompt_forms(prompt: Any, prompts: list[Any]) -> None:
    parsed = parse_completion({"prompt": prompt}, DEFAULT_MAX, 3)
    assert parsed.prompts == prompts
    assert parse_completion({"prompt": prompt, "n": 3}, DEFAULT_MAX, 3).num_choices == 3 * len(prompts)


@pytest.mark.parametrize("prompt", [
    None, 1, 1.5, True, {"a": 1}, "", [], [""], [1, "a"], [True], [1, True], [1.5], [[]],
    ["a", ""], [[1], []], [None], ["a"] * 65,
])
def test_completion_prompt_types(prompt: Any) -> None:
    body = {"prompt": prompt} if prompt is not None else {}
    assert refused(parse_completion, body).param == "prompt"


@pytest.mark.parametrize("messages", [None, [], "hi", {"role": "user"}, 1])
def test_messages_must_be_a_non_empty_list(messages: Any) -> None:
    body = {"messages": messages} if messages is not None else {}
    assert refused(parse_chat, body).param == "messages"


@pytest.mark.parametrize("message", ["hi", 1, None, ["user", "hi"]])
def test_message_must_be_an_object(message: Any) -> None:
    assert refused(parse_chat, {"messages": [USER[0], message]}).param == "messages[1]"


@pytest.mark.parametrize("role", [None, "robot", "User", 1, ""])
def test_unknown_role(role: Any) -> None:
    message = {"content": "x"} if role is None else {"role": role, "content": "x"}
    assert refused(parse_chat, {"messages": [message]}).param == "messages[0].role"


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool"])
def test_known_roles(role: str) -> None:
    parsed = parse_chat({"messages": [{"role": role, "content": "x"}]}, DEFAULT_MAX)
    assert parsed.messages is not None
    assert parsed.messages[0]["role"] == ("system" if role == "developer" else role)


def test_text_content_parts_are_joined() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    parsed = parse_chat({"messages": [{"role": "user", "content": parts}]}, DEFAULT_MAX)
    assert parsed.messages == [{"role": "user", "content": "ab"}]


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "http://x"}},
    {"type": "text"},
    {"type": "text", "text": 1},
    {"text": "a"},
    "a",
    None,
])
def test_non_text_content_parts(part: Any) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "ok"}, part]}]}
    assert refused(parse_chat, body).param == "messages[0].content"


@pytest.mark.parametrize("content", [None, 1, {"text": "a"}, True])
def test_bad_content(content: Any) -> None:
    body = {"messages": [{"role": "user", "content": content}]}
    assert refused(parse_chat, body).param == "messages[0].content"


def test_assistant_content_may_be_null() -> None:
    body = {"messages": [USER[0], {"role": "assistant", "content": None}]}
    assert parse_chat(body, DEFAULT_MAX).messages == [USER[0], {"role": "assistant", "content": ""}]


def test_message_name_kept() -> None:
    body = {"messages": [{"role": "user", "content": "x", "name": "bob", "extra": 1}]}
    assert parse_chat(body, DEFAULT_MAX).messages == [{"role": "user", "content": "x", "name": "bob"}]


# -- sampling ------------------------------------------------------------------------


@BOTH
@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [0, -1, True, False, "10", 1.5, 10.0, [10]])
def test_max_tokens_must_be_a_positive_int(parse: Any, make: Any, name: str, value: Any) -> None:
    assert refused(parse, make(**{name: value})).param == name


@BOTH
@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_accepted(parse: Any, make: Any, name: str) -> None:
    assert parse(make(**{name: 9}), DEFAULT_MAX).sampling.max_tokens == 9
    assert parse(make(**{name: None}), DEFAULT_MAX).sampling.max_tokens == DEFAULT_MAX
    # Without a fixed default it is the room left, known once the prompt is tokenized
    assert parse(make(**{name: None}), None).sampling.max_tokens == ROOM_LEFT


@pytest.mark.parametrize("value", [-0.1, 2.01, "1", True, float("nan"), float("inf"), [1]])
@BOTH
def test_temperature_range(parse: Any, make: Any, value: Any) -> None:
    assert refused(parse, make(temperature=value)).param == "temperature"


@BOTH
@pytest.mark.parametrize("value", [0, 0.0, 1, 2, 2.0])
def test_temperature_accepted(parse: Any, make: Any, value: Any) -> None:
    sampling = parse(make(temperature=value), DEFAULT_MAX).sampling
    assert sampling.params.temperature == value and isinstance(sampling.params.temperature, float)


@pytest.mark.parametrize("value", [-0.5, 1.01, "0.9", False, float("nan")])
@BOTH
def test_top_p_range(parse: Any, make: Any, value: Any) -> None:
    assert refused(parse, make(top_p=value)).param == "top_p"


@BOTH
@pytest.mark.parametrize("value", [0.01, 0.5, 1, 1.0, None])
def test_top_p_accepted(parse: Any, make: Any, value: Any) -> None:
    assert parse(make(top_p=value), DEFAULT_MAX).sampling.params.top_p == (1.0 if value is None else value)


@BOTH
@pytest.mark.parametrize("value", ["1", 1.5, True, 2**64, -(2**63) - 1])
def test_seed_must_be_an_int(parse: Any, make: Any, value: Any) -> None:
    assert refused(parse, make(seed=value)).param == "seed"


@BOTH
@pytest.mark.parametrize("value", [0, 42, -1, 2**64 - 1, -(2**63)])
def test_seed_keeps_all_64_bits(parse: Any, make: Any, value: int) -> None:
    seed = parse(make(seed=value), DEFAULT_MAX).sampling.params.seed
    assert seed == value % 2**64


@BOTH
@pytest.mark.parametrize("n", [0, 5, "1", 1.0, True, -1])
def test_n_within_max_n(parse: Any, make: Any, n: Any) -> None:
    with pytest.raises(BadRequest) as info:
        parse(make(n=n), DEFAULT_MAX, 4)
    assert info.value.param == "n" and "--max-n" in info.value.message


@BOTH
@pytest.mark.parametrize("n", [None, 1, 4])
def test_n_accepted(parse: Any, make: Any, n: Any) -> None:
    assert parse(make(n=n), DEFAULT_MAX, 4).n == (n or 1)


@BOTH
def test_n_above_1_refused_by_default(parse: Any, make: Any) -> None:
    assert refused(parse, make(n=2)).param == "n"


# -- stop, stream --------------------------------------------------------------------


@BOTH
@pytest.mark.parametrize(("stop", "expected"), [
    (None, []), ("x", ["x"]), ([], []), (["a", "b"], ["a", "b"]), (["1", "2", "3", "4"], ["1", "2", "3", "4"]),
])
def test_stop_accepted(parse: Any, make: Any, stop: Any, expected: list[str]) -> None:
    assert parse(make(stop=stop), DEFAULT_MAX).stop == expected


@BOTH
@pytest.mark.parametrize("stop", ["", [""], ["a", ""], ["a"] * (MAX_STOPS + 1), [1], 1, {"a": 1}, [None]])
def test_stop_refused(parse: Any, make: Any, stop: Any) -> None:
    assert refused(parse, make(stop=stop)).param == "stop"


@BOTH
@pytest.mark.parametrize("stream", ["true", 1, 0, [True]])
def test_stream_must_be_a_bool(parse: Any, make: Any, stream: Any) -> None:
    assert refused(parse, make(stream=stream)).param == "stream"


@BOTH
def test_stream_and_usage(parse: Any, make: Any) -> None:
    parsed = parse(make(stream=True, stream_options={"include_usage": True}), DEFAULT_MAX)
    assert parsed.stream is True and parsed.include_usage is True
    parsed = parse(make(stream=True, stream_options={}), DEFAULT_MAX)
    assert parsed.include_usage is False
    assert parse(make(stream=None, stream_options=None), DEFAULT_MAX).stream is False
    assert parse(make(stream=False, stream_options=None), DEFAULT_MAX).stream is False


@BOTH
@pytest.mark.parametrize("stream", [None, False])
def test_stream_options_need_stream(parse: Any, make: Any, stream: Any) -> None:
    err = refused(parse, make(stream=stream, stream_options={"include_usage": True}))
    assert err.param == "stream_options"


@BOTH
@pytest.mark.parametrize("options", ["x", [1], True, 1])
def test_stream_options_must_be_an_object(parse: Any, make: Any, options: Any) -> None:
    assert refused(parse, make(stream=True, stream_options=options)).param == "stream_options"


@BOTH
@pytest.mark.parametrize("value", ["yes", 1, [True]])
def test_include_usage_must_be_a_bool(parse: Any, make: Any, value: Any) -> None:
    err = refused(parse, make(stream=True, stream_options={"include_usage": value}))
    assert err.param == "stream_options.include_usage"


@BOTH
@pytest.mark.parametrize("value", ["yes", 1])
def test_ignore_eos_must_be_a_bool(parse: Any, make: Any, value: Any) -> None:
    assert refused(parse, make(ignore_eos=value)).param == "ignore_eos"


# -- known-but-unsupported parameters ------------------------------------------------

NEUTRAL_VALUES = {
    "echo": [None, False], "best_of": [None, 1], "suffix": [None, ""],
    "functions": [None, []], "function_call": [None, "none", "auto"],
    "modalities": [None, ["text"]],
    "audio": [None], "prediction": [None],
}
NON_NEUTRAL_VALUES = {
    "echo": [True], "best_of": [2], "suffix": ["end"],
    "functions": [[{"name": "f"}]], "function_call": [{"name": "f"}],
    "modalities": [["text", "audio"]],
    "audio": [{"voice": "alloy"}], "prediction": [{"type": "content", "content": "x"}],
}


def test_tables_cover_every_known_parameter() -> None:
    assert set(NEUTRAL_VALUES) == set(NEUTRAL) == set(NON_NEUTRAL_VALUES)


@BOTH
@pytest.mark.parametrize(("name", "value"),
                         [(k, v) for k, vs in NEUTRAL_VALUES.items() for v in vs])
def test_neutral_values_accepted(parse: Any, make: Any, name: str, value: Any) -> None:
    parse(make(**{name: value}), DEFAULT_MAX)


# What an endpoint takes although the other refuses it: completions echo their prompt.
TAKEN = {(parse_completion, "echo")}


@pytest.mark.parametrize(("parse", "make", "name", "value"),
                         [(parse, make, k, v) for parse, make in ((parse_chat, chat), (parse_completion, completion))
                          for k, vs in NON_NEUTRAL_VALUES.items() for v in vs if (parse, k) not in TAKEN])
def test_non_neutral_values_refused(parse: Any, make: Any, name: str, value: Any) -> None:
    err = refused(parse, make(**{name: value}))
    assert err.param == name and name in err.message


@BOTH
def test_unknown_parameters_ignored(parse: Any, make: Any) -> None:
    parse(make(user="u1", metadata={"a": "b"}, store=False, vendor_extra=[1, 2]), DEFAULT_MAX)


# -- fuzz ----------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
keys = st.sampled_from(["model", "prompt", "messages", "max_tokens", "max_completion_tokens",
                        "temperature", "top_p", "seed", "n", "stop", "stream", "stream_options",
                        "ignore_eos", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                        "frequency_penalty", "logit_bias", "logprobs", "top_logprobs",
                        "repetition_context_size", *NEUTRAL])


@settings(max_examples=200, deadline=None)
@given(body=st.dictionaries(keys, json_values, max_size=6) | json_values)
@pytest.mark.parametrize("parse", [parse_chat, parse_completion])
def test_arbitrary_json_raises_only_bad_request(parse: Any, body: Any) -> None:
    try:
        parse(body, DEFAULT_MAX)
    except BadRequest:
        pass


# -- tools, tool choice, response format ---------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "d",
                                            "parameters": {"type": "object"}}}


def test_tools_and_choice() -> None:
    parsed = parse_chat(chat(tools=[WEATHER]), DEFAULT_MAX)
    assert [t.name for t in parsed.tools] == ["get_weather"] and parsed.tool_choice.mode == "auto"
    named = {"type": "function", "function": {"name": "get_weather"}}
    parsed = parse_chat(chat(tools=[WEATHER], tool_choice=named), DEFAULT_MAX)
    assert (parsed.tool_choice.mode, parsed.tool_choice.name) == ("function", "get_weather")
    assert parse_chat(chat(tools=[WEATHER], tool_choice="required"), DEFAULT_MAX).tool_choice.is_forced
    assert parse_chat(chat(), DEFAULT_MAX).tool_choice.mode == "none"


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": "x"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}}, "response_format"),
    ({"chat_template_kwargs": []}, "chat_template_kwargs"),
    ({"separate_reasoning": "no"}, "separate_reasoning"),
])
def test_bad_tool_fields(fields: dict[str, Any], param: str) -> None:
    assert refused(parse_chat, chat(**fields)).param == param


@pytest.mark.parametrize(("value", "kind"), [
    (None, None), ({"type": "text"}, None), ({"type": "json_object"}, "json_object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                             "strict": True}}, "json_schema"),
])
def test_response_format(value: Any, kind: str | None) -> None:
    rf = parse_chat(chat(response_format=value), DEFAULT_MAX).response_format
    assert (rf.kind if rf else None) == kind


def test_assistant_tool_calls_and_tool_messages_in_history() -> None:
    messages = [USER[0],
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    parsed = parse_chat({"messages": messages}, DEFAULT_MAX)
    assert parsed.messages is not None
    assert parsed.messages[1]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                               "arguments": {"city": "Paris"}}
    assert parsed.messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_tool_call_arguments_that_are_not_json_stay_text() -> None:
    """A call cut by max_tokens, replayed as it came (OpenAI takes it)."""
    cut = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": "o'}}]}
    parsed = parse_chat({"messages": [USER[0], cut]}, 8)
    assert parsed.messages is not None
    assert parsed.messages[1]["tool_calls"][0]["function"]["arguments"] == '{"a": "o'
    bad = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}
    assert refused(parse_chat, {"messages": [USER[0], bad]}).param.startswith("messages[1].tool_calls")


@pytest.mark.parametrize("role", [[], {}, ["user"], {"a": 1}])
def test_an_unhashable_role_is_a_400_not_a_crash(role: Any) -> None:
    """Found by the schemathesis run: ``[] in frozenset`` raises TypeError."""
    with pytest.raises(BadRequest) as info:
        parse_chat({"messages": [{"role": role, "content": "hi"}]}, 8)
    assert info.value.param == "messages[0].role"


# -- echo and prompt logprobs (scoring) ------------------------------------------------

def test_a_completion_echoes_and_scores_its_prompt_for_its_logprobs() -> None:
    p = parse_completion(completion(echo=True, logprobs=3, max_tokens=1), DEFAULT_MAX)
    assert p.echo and p.sampling.params.num_logprobs == 3
    assert p.sampling.params.prompt_logprobs == 3   # the worker scores the prompt
    assert p.prompt_logprobs is None                 # vLLM's own field was not asked for


def test_echo_without_logprobs_scores_nothing() -> None:
    p = parse_completion(completion(echo=True, max_tokens=0), DEFAULT_MAX)
    assert p.echo and p.sampling.max_tokens == 0 and p.sampling.params.prompt_logprobs is None


@pytest.mark.parametrize(("fields", "scored"), [
    ({"prompt_logprobs": 4}, 4), ({"prompt_logprobs": 0, "echo": True, "logprobs": 2}, 2),
    ({"prompt_logprobs": 5, "echo": True, "logprobs": 1}, 5), ({"prompt_logprobs": 1, "logprobs": 5}, 1),
])
def test_the_prompt_is_scored_for_the_larger_ask(fields: dict[str, Any], scored: int) -> None:
    p = parse_completion(completion(**fields), DEFAULT_MAX)
    assert p.sampling.params.prompt_logprobs == scored
    assert p.prompt_logprobs == fields["prompt_logprobs"]


def test_chat_takes_prompt_logprobs() -> None:
    p = parse_chat(chat(prompt_logprobs=2, max_tokens=1), DEFAULT_MAX)
    assert p.prompt_logprobs == 2 and p.sampling.params.prompt_logprobs == 2


@pytest.mark.parametrize(("parse", "body", "param"), [
    (parse_completion, completion(max_tokens=0), "max_tokens"),              # no tokens only with echo
    (parse_completion, completion(echo=True, max_tokens=-1), "max_tokens"),
    (parse_completion, completion(echo="yes"), "echo"),
    (parse_completion, completion(prompt_logprobs=21), "prompt_logprobs"),
    (parse_completion, completion(prompt_logprobs=-1), "prompt_logprobs"),
    (parse_completion, completion(prompt_logprobs=2, stream=True), "prompt_logprobs"),  # as vLLM
    (parse_chat, chat(prompt_logprobs=2, stream=True), "prompt_logprobs"),
    (parse_chat, chat(echo=True), "echo"),                                 # chat never echoes
])
def test_bad_scoring_parameters_are_refused_by_name(parse: Any, body: dict[str, Any], param: str) -> None:
    assert refused(parse, body).param == param
