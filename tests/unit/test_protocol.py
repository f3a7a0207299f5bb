"""Tests for common/protocol.py: round trips, malformed frames, and the public surface."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import common.errors as errors_module
from common import protocol
from common.errors import HeadroomError, ProtocolError
from common.protocol import (
    MAX_FRAME_BYTES, MESSAGE_TYPES, PROTOCOL_VERSION, Cancel, ExitCode, FinishReason, Generate,
    Heartbeat, Hello, Reject, RejectReason, SamplingParams, Limit, Shutdown, Status, TokenRow, Tokens, Trim,
    decode,
    encode,
)

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# One full example of every message type, every field set away from its default.
EXAMPLES: list[Any] = [
    Hello(incarnation=7, pid=123, package_version="0.1.0", protocol_version=PROTOCOL_VERSION,
          model_id="demo", fingerprint="abc123", context_length=4096,
          tokenizer_path="/tmp/tok", eos_token_ids=[0, 2], admission=True,
          cost_model={"kv_bytes_per_token": 1024, "prefill_a_bytes": 1.5, "nested": {"x": [1]}}),
    Generate(incarnation=7, request_id="r1", prompt_ids=[1, 2, 3], max_tokens=16,
             sampling=SamplingParams(
                 temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
                 repetition_context_size=64, presence_penalty=0.5, presence_context_size=30,
                 frequency_penalty=-0.5, frequency_context_size=40, logit_bias=[[5, 100.0]],
                 seed=2**64 - 1, ignore_eos=True, num_logprobs=3, grammar='{"grammars": []}',
                 prompt_logprobs=2),
             reservation_bytes=1 << 20),
    Cancel(incarnation=7, request_id="r1"),
    Tokens(incarnation=7, step=9, outputs=[TokenRow("r1", [5, 6], None), TokenRow("r2", [7], "stop"),
                                           TokenRow("r3", [8], None, [[-0.5, [8, 9], [-0.5, -1.5]]]),
                                           TokenRow("r4", [], None, None, [[-2.5, [3], [-0.5], 7]])]),
    Reject(incarnation=7, request_id="r1", reason=RejectReason.NOT_NOW.value, message="later",
           needed_bytes=10, max_request_tokens=100),
    Status(incarnation=7, report=protocol.MemoryReport(budget_bytes=1 << 30, running=2, device="cpu",
                                                        scale_history=[[0.5, 1.2, "step"]])),
    Heartbeat(incarnation=7, step=3, has_work=True),
    Shutdown(incarnation=7, reason="bye"),
    Trim(incarnation=7),
    Limit(incarnation=7, limit_bytes=1 << 30),
]

DESIGN_MESSAGE_TYPES = {"hello", "generate", "cancel", "tokens", "reject", "status",
                        "heartbeat", "shutdown", "trim", "limit"}
DESIGN_ERROR_STATUSES = {
    "invalid_request": 400, "context_length_exceeded": 400, "insufficient_memory": 400,
    "unauthorized": 401, "payload_too_large": 413, "queue_full": 429, "no_worker": 503,
    "queue_timeout": 503, "worker_lost": 503, "request_quarantined": 503,
}


def body_of(msg: Any) -> dict[str, Any]:
    return msgpack.unpackb(encode(msg), raw=False)


def pack(body: Any) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def decode_is_safe(frame: bytes) -> None:
    """The one contract of decode: a message or a ProtocolError, never anything else."""
    try:
        msg = decode(frame)
    except ProtocolError:
        return
    assert type(msg) in MESSAGE_TYPES.values()


# -- round trips ---------------------------------------------------------------------


def test_examples_cover_every_message_type() -> None:
    assert {type(m) for m in EXAMPLES} == set(MESSAGE_TYPES.values())


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.type)
def test_round_trip(msg: Any) -> None:
    assert decode(encode(msg)) == msg


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.type)
def test_frame_carries_version_type_and_incarnation(msg: Any) -> None:
    body = body_of(msg)
    assert body["v"] == PROTOCOL_VERSION
    assert body["type"] == msg.type
    assert body["incarnation"] == msg.incarnation


@pytest.mark.parametrize("frame_type", [bytearray, memoryview])
def test_decode_accepts_buffer_types(frame_type: type) -> None:
    msg = EXAMPLES[1]
    assert decode(frame_type(encode(msg))) == msg


def test_defaults_survive_round_trip() -> None:
    msg = Generate(incarnation=1, request_id="r", prompt_ids=[1], max_tokens=1)
    out = decode(encode(msg))
    assert out == msg
    assert out.sampling.seed is None and out.reservation_bytes == 0


# Values msgpack carries without changing them (lists, not tuples; str keys; no NaN).
INT64 = st.integers(-(2**63), 2**63 - 1)
UINT64 = st.integers(0, 2**64 - 1)
scalars = st.one_of(st.none(), st.booleans(), INT64, st.floats(allow_nan=False),
                    st.text(max_size=12), st.binary(max_size=12))
any_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12,
)
ids = st.lists(st.integers(0, 2**32), max_size=50)
text = st.text(max_size=20)

message_strategies = st.one_of(
    st.builds(Hello, incarnation=INT64, pid=INT64, package_version=text,
              protocol_version=INT64, model_id=text, fingerprint=text, context_length=INT64,
              tokenizer_path=text, eos_token_ids=ids, admission=st.booleans(),
              cost_model=st.dictionaries(st.text(max_size=8), any_values, max_size=5)),
    st.builds(Generate, incarnation=INT64, request_id=text, prompt_ids=ids, max_tokens=INT64,
              sampling=st.builds(
                  SamplingParams, temperature=st.floats(allow_nan=False) | INT64,
                  top_p=st.floats(allow_nan=False), top_k=INT64, seed=st.none() | UINT64,
                  logit_bias=st.lists(st.tuples(st.integers(0, 2**20), st.floats(-100, 100))
                                      .map(list), max_size=4),
                  ignore_eos=st.booleans(), num_logprobs=st.none() | st.integers(0, 20),
                  grammar=st.none() | text),
              reservation_bytes=INT64),
    st.builds(Cancel, incarnation=INT64, request_id=text),
    st.builds(Tokens, incarnation=INT64, step=INT64,
              outputs=st.lists(st.tuples(text, ids, st.sampled_from([None, *FinishReason]))
                               .map(lambda row: TokenRow(row[0], row[1], row[2] and str(row[2]))),
                               max_size=8)),
    st.builds(Reject, incarnation=INT64, request_id=text,
              reason=st.sampled_from([str(r) for r in RejectReason]) | text,
              message=text, needed_bytes=INT64, max_request_tokens=INT64),
    st.builds(Status, incarnation=INT64, report=st.builds(
        protocol.MemoryReport, device=text, limit_bytes=INT64, budget_bytes=INT64,
        mlx_limit_bytes=st.none() | INT64, running=INT64, worst_step_s=st.floats(allow_nan=False),
        scale=st.floats(allow_nan=False), warmup_s=st.none() | st.floats(allow_nan=False),
        scale_history=st.lists(st.tuples(st.floats(allow_nan=False), st.floats(allow_nan=False), text)
                               .map(list), max_size=3),
        cost_model=st.dictionaries(st.text(max_size=8), any_values, max_size=5),
        prompt_cache=st.dictionaries(st.text(max_size=8), any_values, max_size=5))),
    st.builds(Heartbeat, incarnation=INT64, step=INT64, has_work=st.booleans()),
    st.builds(Shutdown, incarnation=INT64, reason=text),
)


@FAST
@given(msg=message_strategies)
def test_round_trip_generated(msg: Any) -> None:
    assert decode(encode(msg)) == msg


# -- decode never raises anything but ProtocolError ----------------------------------


@FAST
@given(frame=st.binary(max_size=256))
def test_arbitrary_bytes_raise_only_protocol_error(frame: bytes) -> None:
    decode_is_safe(frame)


# Any msgpack object, including maps with non-str keys and values of every kind.
hashable_scalars = st.one_of(st.none(), st.booleans(), INT64, st.floats(),
                             st.text(max_size=8), st.binary(max_size=8))
msgpack_objects = st.recursive(
    hashable_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=8), INT64), inner, max_size=4),
    ),
    max_leaves=16,
)


@FAST
@given(obj=msgpack_objects)
def test_arbitrary_msgpack_objects_raise_only_protocol_error(obj: Any) -> None:
    decode_is_safe(pack(obj))


field_names = sorted({f.name for cls in MESSAGE_TYPES.values() for f in dataclasses.fields(cls)})


@FAST
@given(
    version=st.one_of(st.just(PROTOCOL_VERSION), msgpack_objects),
    type_=st.one_of(st.sampled_from(sorted(MESSAGE_TYPES)), msgpack_objects),
    fields=st.dictionaries(st.sampled_from(field_names), msgpack_objects, max_size=10),
)
def test_message_shaped_maps_raise_only_protocol_error(version: Any, type_: Any,
                                                       fields: dict[str, Any]) -> None:
    decode_is_safe(pack({"v": version, "type": type_, **fields}))


@FAST
@given(msg=message_strategies, data=st.data())
def test_corrupted_fields_raise_only_protocol_error(msg: Any, data: st.DataObject) -> None:
    body = body_of(msg)
    key = data.draw(st.sampled_from(sorted(body)))
    body[key] = data.draw(msgpack_objects)
    decode_is_safe(pack(body))


@pytest.mark.parametrize("bad_type", [[1], ["hello"], {"a": 1}, {}])
def test_unhashable_type_field_is_a_protocol_error(bad_type: Any) -> None:
    with pytest.raises(ProtocolError):
        decode(pack({"v": PROTOCOL_VERSION, "type": bad_type, "incarnation": 1}))


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.type)
def test_truncated_frames(msg: Any) -> None:
    frame = encode(msg)
    for cut in range(len(frame)):
        with pytest.raises(ProtocolError):
            decode(frame[:cut])


def test_trailing_garbage_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        decode(encode(EXAMPLES[2]) + b"\x00")


def test_oversized_frame() -> None:
    frame = b"\xc0" * (MAX_FRAME_BYTES + 1)
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(frame)


def nested(depth: int) -> Any:
    value: Any = 0
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def test_nesting_is_bounded_before_anything_walks_it() -> None:
    ok = protocol.Status(incarnation=1, report=protocol.MemoryReport(
        loop={"a": nested(protocol.MAX_FREE_DEPTH - 1)}))
    assert decode(encode(ok)) == ok
    deep = {"v": protocol.PROTOCOL_VERSION, "type": "status", "incarnation": 1,
            "report": {"loop": {"a": nested(200)}}}
    with pytest.raises(ProtocolError, match="wrong type"):
        decode(msgpack.packb(deep))
    with pytest.raises(ProtocolError, match="undecodable"):  # msgpack's own limit (1024)
        decode(b"\x91" * 100_000 + b"\xc0")


def test_a_memory_report_field_of_the_wrong_type_is_refused() -> None:
    # Typed on arrival: the router reads these fields as numbers (admission, the budget,
    # the stall clock), so a report that is not one is dropped whole, never half-read.
    for field_name, value in (("limit_bytes", "lots"), ("max_running_requests", 1.5),
                              ("scale_history", [[1.0, {"why": "x"}, "step"]]), ("loop", [1])):
        frame = msgpack.packb({"v": protocol.PROTOCOL_VERSION, "type": "status", "incarnation": 1,
                               "report": {field_name: value}})
        with pytest.raises(ProtocolError, match=f"status.report.{field_name} has the wrong type"):
            decode(frame)


def test_every_memory_report_field_is_documented() -> None:
    # What /v1/memory shows per worker is the report as sent: a field the worker adds
    # must be named in the README's endpoint table, as clients rely on those names.
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `GET /v1/memory`"))
    documented = set(re.findall(r"`([a-z_]+)`", row))
    fields = {f.name for f in dataclasses.fields(protocol.MemoryReport)}
    assert fields - documented == set()


@pytest.mark.parametrize("frame", ["text", None, 123, [b"x"]])
def test_non_bytes_frame(frame: Any) -> None:
    with pytest.raises(ProtocolError):
        decode(frame)


@pytest.mark.parametrize("obj", [1, "hello", [1, 2], None, b"bytes"])
def test_frame_that_is_not_a_map(obj: Any) -> None:
    with pytest.raises(ProtocolError, match="not a map"):
        decode(pack(obj))


def test_non_string_map_keys_are_a_protocol_error() -> None:
    body = body_of(EXAMPLES[2])
    with pytest.raises(ProtocolError):
        decode(pack({**body, 1: "x"}))


# -- version, type, fields -----------------------------------------------------------


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1, -1, "1", None, [1]])
def test_wrong_version(version: Any) -> None:
    body = body_of(EXAMPLES[2])
    body["v"] = version
    with pytest.raises(ProtocolError, match="version"):
        decode(pack(body))


def test_missing_version() -> None:
    body = body_of(EXAMPLES[2])
    del body["v"]
    with pytest.raises(ProtocolError, match="version"):
        decode(pack(body))


@pytest.mark.parametrize("version", [True, float(PROTOCOL_VERSION)])
def test_version_must_be_the_integer(version: Any) -> None:
    """A bool or a float that compares equal to 1 is not protocol version 1."""
    body = body_of(EXAMPLES[2])
    body["v"] = version
    with pytest.raises(ProtocolError, match="version"):
        decode(pack(body))


@pytest.mark.parametrize("type_", ["nope", "", "Hello", None, 1, b"hello"])
def test_unknown_type(type_: Any) -> None:
    body = body_of(EXAMPLES[2])
    body["type"] = type_
    with pytest.raises(ProtocolError, match="unknown message type"):
        decode(pack(body))


def test_missing_type() -> None:
    body = body_of(EXAMPLES[2])
    del body["type"]
    with pytest.raises(ProtocolError):
        decode(pack(body))


def required_fields() -> list[tuple[Any, str]]:
    cases = []
    for msg in EXAMPLES:
        for f in dataclasses.fields(msg):
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                cases.append((msg, f.name))
    return cases


@pytest.mark.parametrize(("msg", "name"), required_fields(),
                         ids=lambda x: x if isinstance(x, str) else x.type)
def test_missing_required_field(msg: Any, name: str) -> None:
    body = body_of(msg)
    del body[name]
    with pytest.raises(ProtocolError, match=name):
        decode(pack(body))


def test_missing_optional_fields_take_defaults() -> None:
    out = decode(pack({"v": PROTOCOL_VERSION, "type": "heartbeat", "incarnation": 3}))
    assert out == Heartbeat(incarnation=3, step=0, has_work=False)


def wrong_values(hint: Any) -> list[Any]:
    """Values of the wrong type for a field's annotation."""
    origin = typing.get_origin(hint)
    optional = type(None) in typing.get_args(hint)
    base = [a for a in typing.get_args(hint) if a is not type(None)][0] if optional else hint
    none = [] if optional else [None]
    if base is int:
        return ["1", True, 1.5, [1], *none]
    if base is float:
        return ["1.0", True, [1.0], *none]
    if base is bool:
        return [1, 0, "true", *none]
    if base is str:
        return [1, b"bytes", ["a"], True, *none]
    if typing.get_origin(base) is list:
        (arg,) = typing.get_args(base)
        inner = {int: ["1", True, 1.5, None, [1]]}.get(arg, [1, "x", None])
        return ["123", {"a": 1}, *none] + [[1, bad] for bad in inner]
    if origin is dict or typing.get_origin(base) is dict or dataclasses.is_dataclass(base):
        return [[1], "x", 1, *none]
    raise AssertionError(f"no wrong values for {hint!r}")


def wrong_field_cases() -> list[tuple[Any, str, Any]]:
    cases = []
    for msg in EXAMPLES:
        hints = typing.get_type_hints(type(msg))
        for f in dataclasses.fields(msg):
            if hints[f.name] is Any:
                continue
            for bad in wrong_values(hints[f.name]):
                cases.append((msg, f.name, bad))
    return cases


@pytest.mark.parametrize(("msg", "name", "bad"), wrong_field_cases(),
                         ids=lambda x: x.type if hasattr(x, "type") else repr(x))
def test_wrong_field_type(msg: Any, name: str, bad: Any) -> None:
    body = body_of(msg)
    body[name] = bad
    with pytest.raises(ProtocolError, match=name):
        decode(pack(body))


SAMPLING_HINTS = typing.get_type_hints(SamplingParams)


@pytest.mark.parametrize(("name", "bad"), [
    (f.name, bad) for f in dataclasses.fields(SamplingParams)
    for bad in wrong_values(SAMPLING_HINTS[f.name])
    if not (f.name == "logit_bias" and bad == [1, 1])  # an int is a valid inner float
], ids=repr)
def test_wrong_sampling_field_type(name: str, bad: Any) -> None:
    body = body_of(EXAMPLES[1])
    body["sampling"][name] = bad
    with pytest.raises(ProtocolError, match=f"sampling.{name}"):
        decode(pack(body))


@pytest.mark.parametrize("bad", [["1"], [True], [1, "2"], [1, False], [1.0]])
def test_prompt_ids_must_be_ints(bad: list[Any]) -> None:
    body = body_of(EXAMPLES[1])
    body["prompt_ids"] = bad
    with pytest.raises(ProtocolError, match="prompt_ids"):
        decode(pack(body))


TOKENS = next(m for m in EXAMPLES if isinstance(m, Tokens))


@pytest.mark.parametrize("bad", [
    "r1",                                    # not a list of rows
    ["r1", [5], None],                       # a row that is not a list
    [["r1", [5]]],                           # too short
    [["r1", [5], None, [], [], "extra"]],    # too long
    [["r1", [5], None, [], "pl"]],           # prompt logprobs not a list
    [["r1", [], None, None, [[-0.5, [1], [-0.5]]]]],       # a prompt logprobs entry without its rank
    [["r1", [], None, None, [[-0.5, [1], [-0.5], 1.5]]]],  # a rank that is not an int
    [["r1", [], None, None, [[-0.5, [1, 2], [-0.5], 1]]]],  # top ids and top logprobs differ
    [[1, [5], None]],                        # request id not a string
    [["r1", [5, "6"], None]],                # a token id not an int
    [["r1", [5], 3]],                        # finish reason not a string or nil
    [["r1", [5], None, "lp"]],               # logprobs not a list
    [["r1", [5], None, [[]]]],               # a logprobs entry that is empty
    [["r1", [5], None, [[-0.5, [1, 2], [-0.5]]]]],   # top ids and top logprobs differ in length
    [["r1", [5], None, [[-0.5, ["1"], [-0.5]]]]],    # a top id not an int
    [["r1", [5], None, [[True, [1], [-0.5]]]]],      # a logprob that is a bool
    [["r1", [5, 6], None, [[-0.5, [1], [-0.5]]]]],   # not one entry per token
])
def test_token_rows_are_checked_field_by_field(bad: Any) -> None:
    body = body_of(TOKENS)
    body["outputs"] = bad
    with pytest.raises(ProtocolError, match="outputs"):
        decode(pack(body))


def test_token_rows_are_positional_on_the_wire() -> None:
    """One array per row (no field names: a frame carries a row per running request), the
    logprobs item only when there are logprobs."""
    rows = body_of(TOKENS)["outputs"]
    assert rows[0] == ["r1", [5, 6], None] and len(rows[2]) == 4
    assert decode(pack(body_of(TOKENS))).outputs[2].logprobs == [[-0.5, [8, 9], [-0.5, -1.5]]]
    # A prompt's logprobs ride in a row of their own, after a nil logprobs item.
    assert rows[3] == ["r4", [], None, None, [[-2.5, [3], [-0.5], 7]]]
    assert decode(pack(body_of(TOKENS))).outputs[3].prompt_logprobs == [[-2.5, [3], [-0.5], 7]]


def test_incarnation_as_str_is_refused() -> None:
    body = body_of(EXAMPLES[2])
    body["incarnation"] = "7"
    with pytest.raises(ProtocolError, match="incarnation"):
        decode(pack(body))


def test_seed_may_be_none() -> None:
    body = body_of(EXAMPLES[1])
    body["sampling"]["seed"] = None
    assert decode(pack(body)).sampling.seed is None


def test_float_fields_accept_ints() -> None:
    body = body_of(EXAMPLES[1])
    body["sampling"]["temperature"] = 1
    assert decode(pack(body)).sampling.temperature == 1


@pytest.mark.parametrize("bad", [[1, 2], "x", {"temperature": "hot"}, {"logit_bias": {"5": 1}},
                                 {"seed": 1.5}])
def test_bad_sampling_payload_is_a_protocol_error(bad: Any) -> None:
    body = body_of(EXAMPLES[1])
    body["sampling"] = bad
    with pytest.raises(ProtocolError, match="sampling"):
        decode(pack(body))


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.type)
def test_unknown_extra_fields_are_tolerated(msg: Any) -> None:
    body = body_of(msg)
    body["from_the_future"] = {"a": [1, 2]}
    body["another"] = None
    assert decode(pack(body)) == msg


# -- public surface ------------------------------------------------------------------


def test_message_types_equal_design() -> None:
    assert set(MESSAGE_TYPES) == DESIGN_MESSAGE_TYPES
    for name, cls in MESSAGE_TYPES.items():
        assert cls.type == name


def test_every_message_carries_an_int_incarnation() -> None:
    for cls in MESSAGE_TYPES.values():
        assert typing.get_type_hints(cls)["incarnation"] is int


def test_messages_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        EXAMPLES[2].request_id = "other"  # type: ignore[misc]


def test_all_names_exist() -> None:
    for name in protocol.__all__:
        assert hasattr(protocol, name), name
    for name in errors_module.__all__:
        assert hasattr(errors_module, name), name


def error_classes() -> dict[str, type[HeadroomError]]:
    out: dict[str, type[HeadroomError]] = {}
    for name in errors_module.__all__:
        cls = getattr(errors_module, name)
        if isinstance(cls, type) and issubclass(cls, HeadroomError):
            out[cls.code] = cls
    return out


def test_error_codes_include_design() -> None:
    assert set(DESIGN_ERROR_STATUSES) <= set(error_classes())


@pytest.mark.parametrize(("code", "status"), sorted(DESIGN_ERROR_STATUSES.items()))
def test_error_status(code: str, status: int) -> None:
    cls = error_classes()[code]
    assert cls.status == status
    err = cls("boom", param="p")
    body = err.to_body()["error"]
    assert body == {"message": "boom", "type": cls.type, "param": "p", "code": code}
    if status in (429, 503):
        assert isinstance(cls.retry_after_s, int) and cls.retry_after_s > 0
    else:
        assert cls.retry_after_s is None


def test_error_extras_reach_the_body() -> None:
    err = errors_module.InsufficientMemory("too big", param="max_tokens", needed_bytes=5,
                                           max_request_tokens=9)
    body = err.to_body()["error"]
    assert body["needed_bytes"] == 5 and body["max_request_tokens"] == 9
    assert err.extra == {"needed_bytes": 5, "max_request_tokens": 9}


def test_errors_co_inherit_builtins() -> None:
    assert issubclass(errors_module.QueueTimeout, TimeoutError)
    assert issubclass(errors_module.BadRequest, ValueError)
    assert issubclass(errors_module.ContextLengthExceeded, errors_module.BadRequest)
    assert issubclass(errors_module.InsufficientMemory, errors_module.BadRequest)
    for cls in (errors_module.NoWorker, errors_module.QueueTimeout, errors_module.WorkerLost,
                errors_module.RequestQuarantined):
        assert issubclass(cls, errors_module.Unavailable)


def test_exit_codes() -> None:
    assert ExitCode.PERMANENT == {ExitCode.CONFIG_ERROR, ExitCode.LOAD_ERROR,
                                  ExitCode.NO_MEMORY, ExitCode.PROTOCOL_MISMATCH}
    assert ExitCode.OK not in ExitCode.PERMANENT
    assert ExitCode.UNTRUSTED_STATE not in ExitCode.PERMANENT
