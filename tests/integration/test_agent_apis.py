"""/v1/messages and /v1/responses on real processes, through the official anthropic and
openai clients: the same request as a chat completion, each API's own shapes and errors.

At temperature 0 the demo model's output is a function of the prompt ids, so "the same
internal request" is checked by the text: each API must produce the chat completion's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.conftest import wait_until
from tests.integration.conftest import Router, start_router
from tests.integration.test_stream_cancel import metric, running

KEY = "sk-test-key"
GREEDY = {"temperature": 0}
SYSTEM_BLOCKS = [{"type": "text", "text": "You are a terse assistant.",
                  "cache_control": {"type": "ephemeral"}},
                 {"type": "text", "text": "Answer in one line."}]
QUESTION = "Name three colours."
CHAT_MESSAGES = [{"role": "system", "content": "You are a terse assistant.\nAnswer in one line."},
                 {"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, cache_home: Path) -> Iterator[Router]:
    r = start_router(tmp_path_factory.mktemp("agent-apis"), cache_home, "--api-key", KEY)
    r.http.headers["x-api-key"] = KEY  # /v1/memory is guarded too
    yield r
    r.stop()


@pytest.fixture(scope="module")
def claude(router: Router) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=router.url, api_key=KEY, max_retries=0, timeout=60.0) as c:
        yield c


@pytest.fixture(scope="module")
def oai(router: Router) -> Iterator[openai.OpenAI]:
    with router.client(api_key=KEY) as c:
        yield c


@pytest.fixture(scope="module")
def chat_answer(oai: openai.OpenAI) -> Any:
    """The chat completion every other API's answer is held against."""
    return oai.chat.completions.create(model="x", messages=CHAT_MESSAGES,  # type: ignore[arg-type]
                                       max_tokens=12, temperature=0)


def sse_events(lines: Iterator[str]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of a whole SSE stream."""
    out, name = [], ""
    for line in lines:
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            out.append((name, json.loads(line.removeprefix("data: "))))
    return out


def post(router: Router, path: str, body: Any, **headers: str) -> httpx.Response:
    return router.http.post(path, json=body, headers={"x-api-key": KEY, **headers})


# -- /v1/messages ----------------------------------------------------------------------


def test_messages_is_the_chat_request(claude: anthropic.Anthropic, chat_answer: Any) -> None:
    message = claude.messages.create(
        model="claude-sonnet-4-5", max_tokens=12, system=SYSTEM_BLOCKS,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": QUESTION}], metadata={"user_id": "u1"},
        thinking={"type": "disabled"}, extra_body={**GREEDY, "top_p": 1, "top_k": 0})
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat_answer.choices[0].message.content  # type: ignore[union-attr]
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        chat_answer.choices[0].finish_reason]
    # Anthropic counts cache reads apart: the two make the whole prompt.
    whole = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    assert whole == chat_answer.usage.prompt_tokens
    assert message.usage.output_tokens == chat_answer.usage.completion_tokens
    counted = claude.messages.count_tokens(model="claude-sonnet-4-5", system=SYSTEM_BLOCKS,  # type: ignore[arg-type]
                                           messages=[{"role": "user", "content": QUESTION}])
    assert counted.input_tokens == whole


def test_messages_stream(router: Router, claude: anthropic.Anthropic, chat_answer: Any) -> None:
    body = {"model": "claude-haiku-4-5", "max_tokens": 12, "system": SYSTEM_BLOCKS, "stream": True,
            "messages": [{"role": "user", "content": QUESTION}], **GREEDY}
    with router.http.stream("POST", "/v1/messages", json=body, headers={"x-api-key": KEY}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"] == "text/event-stream"
        events = sse_events(resp.iter_lines())
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    assert text == chat_answer.choices[0].message.content
    assert events[-2][1]["usage"]["output_tokens"] == chat_answer.usage.completion_tokens
    with claude.messages.stream(model="claude-haiku-4-5", max_tokens=12, system=SYSTEM_BLOCKS,  # type: ignore[arg-type]
                                messages=[{"role": "user", "content": QUESTION}],
                                extra_body=GREEDY) as stream:
        assert "".join(stream.text_stream) == text
        assert stream.get_final_message().content[0].text == text  # type: ignore[union-attr]


def test_stop_sequences(claude: anthropic.Anthropic, chat_answer: Any) -> None:
    full = chat_answer.choices[0].message.content
    stop = full[3:5]
    message = claude.messages.create(model="m", max_tokens=12, system=SYSTEM_BLOCKS,  # type: ignore[arg-type]
                                     messages=[{"role": "user", "content": QUESTION}],
                                     stop_sequences=[stop], extra_body=GREEDY)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == full[:full.index(stop)]  # type: ignore[union-attr]


def test_a_final_assistant_turn_is_continued(router: Router, claude: anthropic.Anthropic,
                                             oai: openai.OpenAI, cache_home: Path) -> None:
    """A prefilled answer: the prompt ends inside the assistant's turn, as Hugging Face's
    continue_final_message renders it, and the answer goes on from there."""
    from transformers import AutoTokenizer

    from worker.demo import demo_folder

    prefill = [{"role": "user", "content": "Give JSON"}, {"role": "assistant", "content": '{"answer": '}]
    hf = AutoTokenizer.from_pretrained(str(demo_folder(cache_home / "mlx-headroom")), local_files_only=True)
    want = len(hf.apply_chat_template(prefill, continue_final_message=True, tokenize=True,
                                      return_dict=False))
    assert claude.messages.count_tokens(model="m", messages=prefill).input_tokens == want  # type: ignore[arg-type]
    message = claude.messages.create(model="m", max_tokens=3, messages=prefill, extra_body=GREEDY)  # type: ignore[arg-type]
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == want
    chat = oai.chat.completions.create(model="m", max_tokens=3, messages=prefill,  # type: ignore[arg-type]
                                       extra_body={**GREEDY, "continue_final_message": True})
    assert chat.usage is not None and chat.usage.prompt_tokens == want
    assert chat.choices[0].message.content == message.content[0].text  # type: ignore[union-attr]
    empty = [prefill[0], {"role": "assistant", "content": ""}]  # no prefill: a new turn
    assert claude.messages.count_tokens(model="m", messages=empty).input_tokens == len(  # type: ignore[arg-type]
        hf.apply_chat_template(empty[:1], add_generation_prompt=True, tokenize=True, return_dict=False))
    refused = post(router, "/v1/chat/completions", {"model": "m", "max_tokens": 1, "messages": prefill[:1],
                                                    "continue_final_message": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "continue_final_message"


def test_max_tokens_missing_is_an_anthropic_400(router: Router) -> None:
    resp = post(router, "/v1/messages", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 400
    assert resp.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                      "message": "max_tokens: field required"}}


def test_never_fits_is_an_anthropic_400_with_the_numbers(router: Router) -> None:
    body = {"model": "m", "max_tokens": 100_000, "messages": [{"role": "user", "content": "hi"}]}
    error = post(router, "/v1/messages", body).json()["error"]
    assert error["type"] == "invalid_request_error" and "100000" in error["message"]


def test_x_api_key_and_bearer_auth(router: Router, claude: anthropic.Anthropic) -> None:
    # Greedy: at temperature 1 the demo model's first token is its end one time in ~2,000.
    hello = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    with anthropic.Anthropic(base_url=router.url, auth_token=KEY, max_retries=0) as bearer:
        answer = bearer.messages.create(**hello, extra_body=GREEDY)  # type: ignore[arg-type]
        assert answer.usage.output_tokens >= 1 and answer._request_id
    assert claude.messages.create(**hello, extra_body=GREEDY).usage.output_tokens >= 1  # type: ignore[arg-type]
    with anthropic.Anthropic(base_url=router.url, api_key="sk-wrong", max_retries=0) as wrong, \
            pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(**hello)  # type: ignore[arg-type]
    assert info.value.status_code == 401 and info.value.request_id  # its request-id header
    assert info.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    resp = router.http.post("/v1/messages/count_tokens", json=hello, headers={"x-api-key": "sk-no"})
    assert resp.status_code == 401 and resp.json()["type"] == "error"


def test_disconnected_messages_stream_frees_its_row(router: Router) -> None:
    before = metric(router, "headroom_cancelled_requests_total", 'where="running"')
    body = {"model": "m", "max_tokens": 3000, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me everything."}]}
    with httpx.Client(base_url=router.url, timeout=30) as client:
        with client.stream("POST", "/v1/messages", json=body, headers={"x-api-key": KEY}) as resp:
            lines = resp.iter_lines()
            deltas = [line for line, _ in zip(lines, range(60)) if "text_delta" in line]
            assert deltas, "no text streamed"
            assert running(router) == 1
    wait_until(lambda: running(router) == 0, 10, "the worker's running count to drop to 0")
    assert metric(router, "headroom_cancelled_requests_total", 'where="running"') == before + 1


# -- /v1/responses ---------------------------------------------------------------------


def test_responses_is_the_chat_request(oai: openai.OpenAI, chat_answer: Any) -> None:
    response = oai.responses.create(model="gpt-5-codex", instructions=CHAT_MESSAGES[0]["content"],
                                    input=QUESTION, max_output_tokens=12, temperature=0, store=False)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat_answer.choices[0].message.content
    assert response.status == ("incomplete" if chat_answer.choices[0].finish_reason == "length"
                               else "completed")
    assert response.usage is not None
    assert response.usage.input_tokens == chat_answer.usage.prompt_tokens
    assert response.usage.output_tokens == chat_answer.usage.completion_tokens


def test_responses_stream(oai: openai.OpenAI, chat_answer: Any) -> None:
    stream = oai.responses.create(
        model="gpt-5-codex", input=[{"role": "developer", "content": CHAT_MESSAGES[0]["content"]},
                                    {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        max_output_tokens=12, temperature=0, stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert text == chat_answer.choices[0].message.content
    assert events[-1].response.output_text == text  # type: ignore[union-attr]


def test_responses_cut_by_max_output_tokens_marks_its_message_incomplete(oai: openai.OpenAI) -> None:
    """OpenAI marks the message item the limit cut ``incomplete``, as the response is."""
    cut = {"model": "m", "input": QUESTION, "max_output_tokens": 3, "temperature": 0,
           "extra_body": {"ignore_eos": True}}
    response = oai.responses.create(**cut)  # type: ignore[call-overload]
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert [(item.type, item.status) for item in response.output] == [("message", "incomplete")]
    events = list(oai.responses.create(**cut, stream=True))  # type: ignore[call-overload]
    done = [e.item for e in events if e.type == "response.output_item.done"]  # type: ignore[union-attr]
    assert [(item.type, item.status) for item in done] == [("message", "incomplete")]
    final = events[-1]
    assert final.type == "response.incomplete"
    assert [item.status for item in final.response.output] == ["incomplete"]  # type: ignore[union-attr]
    assert final.response.output_text == response.output_text  # type: ignore[union-attr]


@pytest.mark.parametrize(("fields", "param"), [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
])
def test_responses_refusals_are_clear_400s(oai: openai.OpenAI, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model="m", input="hi", **fields)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param  # type: ignore[index]


def test_models_list_reads_in_both_clients(claude: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    [served] = list(claude.models.list())
    assert served.id == "demo" and served.type == "model"
    assert [m.id for m in oai.models.list()] == ["demo"]
    # Retrieved by name, as a request's model is resolved: with one model, any name is it
    assert oai.models.retrieve("demo").id == claude.models.retrieve("claude-sonnet-4-5").id == "demo"


# -- tools and structured output (constrained by the worker's grammar: the demo model's
# -- weights are random, so a valid call exists only because nothing else can be sampled) ---

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
CLAUDE_TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER},
                {"name": "get_time", "input_schema": {"type": "object", "properties": {
                    "tz": {"enum": ["utc", "cet"]}}, "required": ["tz"],
                    # Bounded, as WEATHER is: an open object let a sampled call add a key of
                    # unbounded random text and run out of max_tokens (1 run in ~25).
                    "additionalProperties": False}}]
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


def test_messages_forced_tool_use_validates(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(model="m", max_tokens=200, messages=ASK,  # type: ignore[arg-type]
                                     tools=CLAUDE_TOOLS, tool_choice={"type": "tool", "name": "get_weather"})
    assert message.stop_reason == "tool_use"
    [use] = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id  # type: ignore[union-attr]
    jsonschema.validate(use.input, WEATHER)  # type: ignore[union-attr]


def test_messages_tool_use_streams_as_input_json_delta(router: Router) -> None:
    body = {"model": "m", "max_tokens": 200, "messages": ASK, "tools": CLAUDE_TOOLS,
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, "stream": True}
    with router.http.stream("POST", "/v1/messages", json=body, headers={"x-api-key": KEY}) as resp:
        events = sse_events(resp.iter_lines())
    starts = {d["index"]: d["content_block"] for n, d in events if n == "content_block_start"}
    [(index, block)] = [(i, b) for i, b in starts.items() if b["type"] == "tool_use"]
    partial = "".join(d["delta"]["partial_json"] for n, d in events
                      if n == "content_block_delta" and d["index"] == index)
    tool = {t["name"]: t["input_schema"] for t in CLAUDE_TOOLS}[block["name"]]
    jsonschema.validate(json.loads(partial), tool)
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_a_forced_call_cut_by_max_tokens_is_a_cut_call_in_every_api(
        claude: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    """The limit ends the output inside the call: each API returns the call as far as it was
    written (OpenAI's cut arguments, Anthropic's incomplete tool_use block), never the
    template's markup as text. Greedy, so a cut output is a prefix of the whole one, and 12
    tokens short of it is past the call's name (the closing marker, braces, the enum value)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    ask = {"model": "m", "messages": ASK, "tools": tools, "temperature": 0,
           "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    whole = oai.chat.completions.create(**ask, max_tokens=200)  # type: ignore[call-overload]
    assert whole.choices[0].finish_reason == "tool_calls"
    full = whole.choices[0].message.tool_calls[0].function.arguments
    cut = oai.chat.completions.create(**ask, max_tokens=whole.usage.completion_tokens - 12).choices[0]  # type: ignore[call-overload]
    assert cut.finish_reason == "length" and not cut.message.content
    [call] = cut.message.tool_calls
    assert call.function.name == "get_weather" and full.startswith(call.function.arguments) \
        and call.function.arguments != full

    ask = {"model": "m", "messages": ASK, "tools": CLAUDE_TOOLS, "extra_body": GREEDY,
           "tool_choice": {"type": "tool", "name": "get_weather"}}
    n = claude.messages.create(**ask, max_tokens=200).usage.output_tokens  # type: ignore[arg-type]
    message = claude.messages.create(**ask, max_tokens=n - 12)  # type: ignore[arg-type]
    assert message.stop_reason == "max_tokens"
    assert [(b.type, b.name) for b in message.content] == [("tool_use", "get_weather")]  # type: ignore[union-attr]
    with claude.messages.stream(**ask, max_tokens=n - 12) as stream:  # type: ignore[arg-type]
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["tool_use"] and streamed.stop_reason == "max_tokens"


def test_a_cut_call_replayed_as_it_came_is_taken(oai: openai.OpenAI) -> None:
    """An agent sends back the cut call it was given (arguments that are not JSON): the
    template renders the text, as OpenAI takes it, rather than a 400 on every later turn."""
    cut = '{"city": "Os'
    chat = oai.chat.completions.create(model="m", max_tokens=2, extra_body=GREEDY, messages=[
        *ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": cut}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "cut short"}])
    response = oai.responses.create(model="m", max_output_tokens=2, temperature=0, input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": cut},
        {"type": "function_call_output", "call_id": "call_1", "output": "cut short"}])
    assert chat.usage is not None and response.usage is not None
    assert chat.usage.prompt_tokens == response.usage.input_tokens  # the same chat, rendered


def test_messages_tool_result_turn(claude: anthropic.Anthropic) -> None:
    history = [*ASK,
               {"role": "assistant", "content": [
                   {"type": "text", "text": "Checking."},
                   {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                    "input": {"city": "Oslo", "unit": "c"}}]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": "toolu_1", "content": "-3 C, snow"}]}]
    message = claude.messages.create(model="m", max_tokens=8, messages=history,  # type: ignore[arg-type]
                                     tools=CLAUDE_TOOLS, extra_body=GREEDY)
    assert message.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = claude.messages.count_tokens(model="m", messages=history, tools=CLAUDE_TOOLS)  # type: ignore[arg-type]
    assert counted.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


def test_messages_structured_output(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(model="m", max_tokens=100, messages=ASK,  # type: ignore[arg-type]
                                     output_config={"format": {"type": "json_schema", "schema": PERSON}})
    jsonschema.validate(json.loads(message.content[0].text), PERSON)  # type: ignore[union-attr]


RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER,
                    "description": "Weather in a city", "strict": True}]


def test_responses_forced_function_call_validates(oai: openai.OpenAI) -> None:
    response = oai.responses.create(model="m", input="Weather in Oslo?", tools=RESPONSES_TOOLS,  # type: ignore[arg-type]
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=200)
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.arguments), WEATHER)  # type: ignore[union-attr]
    stream = oai.responses.create(model="m", input="Weather in Oslo?", tools=RESPONSES_TOOLS,  # type: ignore[arg-type]
                                  tool_choice="required", parallel_tool_calls=False,
                                  max_output_tokens=200, stream=True)
    events = list(stream)
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")  # type: ignore[union-attr]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments == done.arguments  # type: ignore[union-attr]
    jsonschema.validate(json.loads(arguments), WEATHER)
    assert events[-1].type == "response.completed"


def test_responses_function_call_output_turn(oai: openai.OpenAI) -> None:
    response = oai.responses.create(model="m", tools=RESPONSES_TOOLS, max_output_tokens=8,  # type: ignore[arg-type]
                                    temperature=0, input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Oslo", "unit": "c"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "-3 C, snow"}])
    assert response.status in ("completed", "incomplete") and response.usage is not None
    assert response.usage.input_tokens > 0


def test_responses_text_format_json_schema(oai: openai.OpenAI) -> None:
    response = oai.responses.create(model="m", input="A person, please.", max_output_tokens=100,
                                    text={"format": {"type": "json_schema", "name": "person",  # type: ignore[typeddict-item]
                                                     "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), PERSON)


# -- what the agents send --------------------------------------------------------------

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_a_claude_code_request_is_served(router: Router) -> None:
    body = json.loads((FIXTURES / "claude_code_messages.json").read_text())
    body["max_tokens"] = 8  # Claude Code asks for 32000; the demo model's context is 4096
    resp = post(router, "/v1/messages/count_tokens", body)
    assert resp.status_code == 200, resp.text
    with router.http.stream("POST", "/v1/messages?beta=true", json=body,
                            headers={"x-api-key": KEY, "anthropic-version": "2023-06-01",
                                     "anthropic-beta": "claude-code-20250219"}) as stream:
        assert stream.status_code == 200, stream.read()
        events = sse_events(stream.iter_lines())
    usage = events[0][1]["message"]["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == resp.json()["input_tokens"]
    assert [name for name, _ in events][-1] == "message_stop"


def test_a_codex_request_is_served(oai: openai.OpenAI) -> None:
    body = json.loads((FIXTURES / "codex_responses.json").read_text())
    events = list(oai.responses.create(**{**body, "max_output_tokens": 8}))
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.usage.input_tokens > 500  # type: ignore[union-attr]
