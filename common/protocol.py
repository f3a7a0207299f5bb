"""What is on the wire between mlx-router and mlx-worker.

Every frame is one msgpack map: ``{"v": PROTOCOL_VERSION, "type": <name>, ...fields}``.
Every message carries the worker's ``incarnation``, so anything from (or for) an old
incarnation can be recognised and dropped. This is the only module that imports msgpack.

``decode`` never raises anything but ``ProtocolError``: a malformed, truncated, oversized
or unknown frame, or one of another protocol version, is a ``ProtocolError`` that the
caller counts and drops. Neither process may die of a bad frame.
"""

from __future__ import annotations

import dataclasses
import operator
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

import msgpack

from common.errors import ProtocolError

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_FRAME_BYTES",
    "MESSAGE_TYPES",
    "FinishReason",
    "RejectReason",
    "Hello",
    "SamplingParams",
    "Generate",
    "Cancel",
    "Tokens",
    "TokenRow",
    "Reject",
    "MemoryReport",
    "Status",
    "Heartbeat",
    "Shutdown",
    "Trim",
    "Limit",
    "Message",
    "encode",
    "decode",
    "peek_hello",
    "ExitCode",
]

PROTOCOL_VERSION = 2
# A prompt of 1M token ids is ~5 MB of msgpack; anything much larger is garbage or abuse.
MAX_FRAME_BYTES = 64 * 1024 * 1024
# Free-form maps (a worker's status report, its cost model) are checked for depth, not
# shape: real ones are a few levels deep.
MAX_FREE_DEPTH = 16


class ExitCode:
    """Worker exit codes: a protocol with whoever supervises it (router, launchd)."""

    OK = 0
    CONFIG_ERROR = 2        # bad flags or config file: will fail again, never restart
    LOAD_ERROR = 3          # model failed to load: will fail again, never restart in a loop
    NO_MEMORY = 4           # cannot serve even a minimal request: will fail again
    UNTRUSTED_STATE = 5     # a caught memory error left state we cannot trust: restart
    PROTOCOL_MISMATCH = 6   # the router speaks another protocol version: never restart
    ENGINE_ERROR = 7        # a step raised something other than a memory error: a bug; restart

    # Exits that say "the same start will fail the same way".
    PERMANENT = frozenset({CONFIG_ERROR, LOAD_ERROR, NO_MEMORY, PROTOCOL_MISMATCH})


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"          # a caught memory error failed the step: retryable
    EVICTED = "evicted"      # memory was taken by another process: retryable


class RejectReason(StrEnum):
    NEVER_FITS = "never_fits"
    NOT_NOW = "not_now"
    BAD_REQUEST = "bad_request"
    BAD_GRAMMAR = "bad_grammar"          # this worker's llguidance cannot build the grammar
    REQUEST_FAILED = "request_failed"    # the row's own grammar or sampler failed mid-run


BOUNDARIES_ALL, BOUNDARIES_FIRST, BOUNDARIES_NONE = "all", "first", "none"


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    """Worker → router, once after load: who it is and the cost model it admits by."""

    type: ClassVar[str] = "hello"
    incarnation: int
    pid: int
    package_version: str
    protocol_version: int = PROTOCOL_VERSION
    model_id: str
    fingerprint: str
    context_length: int
    tokenizer_path: str
    eos_token_ids: list[int]
    admission: bool
    cost_model: dict[str, Any] = field(default_factory=dict)
    # Which message boundaries (``Generate.boundaries``) the worker uses, so the router
    # renders no prefix for nothing: "all" (a prompt cache of whole sequences, served only
    # at exact prefixes), "first" (KV blocks reused to the token: only a cold prompt's
    # first, the system prompt's end, which other conversations share), "none" (no cache).
    boundaries: str = BOUNDARIES_ALL


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How one row samples; every default is the neutral value (greedy, no processors).

    ``seed`` None means unseeded; otherwise any value in [0, 2**64). ``logit_bias`` is
    ``[[token_id, bias], ...]`` (msgpack map keys must be strings). ``num_logprobs`` None
    sends no logprobs; 0 sends the sampled token's own, k > 0 also the k most likely.
    ``grammar`` is an llguidance grammar (JSON text) the row's tokens must follow.
    ``prompt_logprobs`` None scores nothing of the prompt; k ≥ 0 sends, before any token,
    each prompt token's own logprob (all but the first, which has none) with its rank and
    the k most likely, from the model's own distribution; the row then takes no prefix-cache
    reuse, and ``Generate.max_tokens`` may be 0 (the scores are all it asks for).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    logit_bias: list[list[float]] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    num_logprobs: int | None = None
    grammar: str | None = None
    prompt_logprobs: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Generate:
    """Router → worker: run one request (one row of the batch)."""

    type: ClassVar[str] = "generate"
    incarnation: int
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    reservation_bytes: int = 0
    # Token offsets where a chat message ends (system, tools, each turn), ascending and
    # inside the prompt: the worker may keep the prompt's KV there for the next turn.
    boundaries: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class Cancel:
    """Router → worker: forget a request (client gone, stop string matched)."""

    type: ClassVar[str] = "cancel"
    incarnation: int
    request_id: str


@dataclass(frozen=True, slots=True)
class TokenRow:
    """One request's output in one step. On the wire it is positional, an array
    ``[request_id, token_ids, finish_reason, logprobs, prompt_logprobs]`` without the
    trailing ones the request asked for none of (one such row per running request and
    step: names would double the frame at 32 rows). ``logprobs``: one ``[logprob, top_ids,
    top_logprobs]`` per new token. ``prompt_logprobs``: once, in a row of its own before the
    first token, one ``[logprob, top_ids, top_logprobs, rank]`` per prompt token after the
    first (``SamplingParams.prompt_logprobs``)."""

    positional: ClassVar[bool] = True
    request_id: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[list[Any]] | None = None
    prompt_logprobs: list[list[Any]] | None = None

    def well_formed(self) -> bool:
        """What the field types cannot say: one logprobs entry per token, each
        ``[logprob, top_ids, top_logprobs]`` with as many ids as logprobs; each prompt
        logprobs entry the same and an integer rank."""
        return (self.logprobs is None or len(self.logprobs) == len(self.token_ids)
                and all(len(entry) == 3 and _is_scored(entry) for entry in self.logprobs)) and (
            self.prompt_logprobs is None or all(len(entry) == 4 and _is_scored(entry) and type(entry[3]) is int
                                                for entry in self.prompt_logprobs))


def _is_scored(entry: list[Any]) -> bool:
    """``[logprob, top_ids, top_logprobs, ...]`` with as many ids as logprobs."""
    return (_is_number(entry[0]) and type(entry[1]) is list and type(entry[2]) is list
            and len(entry[1]) == len(entry[2]) and all(type(i) is int for i in entry[1])
            and all(_is_number(x) for x in entry[2]))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True, kw_only=True)
class Tokens:
    """Worker → router, one per engine step: a row per request with new output.
    ``cached_tokens`` names, in the message that carries a request's first output, how many
    of its prompt tokens came from the prefix cache (absent: none)."""

    type: ClassVar[str] = "tokens"
    incarnation: int
    step: int
    outputs: list[TokenRow]
    cached_tokens: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class Reject:
    """Worker → router: the request was not taken (``not_now`` means re-queue), or, with
    ``request_failed``, it was and its own work failed (its tokens so far stand)."""

    type: ClassVar[str] = "reject"
    incarnation: int
    request_id: str
    reason: str
    message: str = ""
    needed_bytes: int = 0
    max_request_tokens: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryReport:
    """A worker's live memory report: DESIGN's per-worker /v1/memory fields, every one
    type-checked on arrival. The defaults are what the router assumed before any report
    (one running request at most, nothing known); a worker always sends every field.
    The nested groups (``cost_model``, ``calibration``, ``loop``, ``prompt_cache``) are
    free-form maps: the router shows them and reads ``cost_model`` through ``CostModel``."""

    device: str = ""
    device_name: str = ""
    limit_bytes: int = 0
    budget_bytes: int = 0
    active_bytes: int = 0
    cache_bytes: int = 0
    peak_bytes: int = 0
    headroom_bytes: int = 0
    reserved_bytes: int = 0
    weights_bytes: int = 0
    baseline_bytes: int = 0
    runtime_transient_bytes: int = 0
    mlx_limit_bytes: int | None = None     # read back from MLX; None where it has none
    system_available_bytes: int = 0
    kv_bytes_per_token: int = 0
    safe_prefill_chunk: int = 0
    max_running_requests: int = 1
    context_length: int = 0
    max_request_tokens: int = 0
    running: int = 0
    bad_frames: int = 0
    worst_step_s: float = 0.0
    worst_measured_over_predicted: float = 0.0
    scale: float = 1.0
    scale_history: list[list[float | str]] = field(default_factory=list)  # [seconds ago, scale, why]
    pressure_changes: int = 0
    warmup_s: float | None = None
    reported_at: float = 0.0
    cost_model: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)
    loop: dict[str, Any] = field(default_factory=dict)
    prompt_cache: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape of /v1/memory (a shallow copy: the nested maps are shared)."""
        return _payload_to_map(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class Status:
    """Worker → router: the live memory report, at most every 250 ms and on every change."""

    type: ClassVar[str] = "status"
    incarnation: int
    report: MemoryReport


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    """Both ways. From the worker, ``step`` must advance while work is waiting."""

    type: ClassVar[str] = "heartbeat"
    incarnation: int
    step: int = 0
    has_work: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Shutdown:
    """Router → worker: finish up and exit. Worker → router: I am exiting, and why."""

    type: ClassVar[str] = "shutdown"
    incarnation: int
    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Trim:
    """Router → worker: drop what memory you can give back without harm now (evictable
    memory: prompt caches, MLX's buffer cache), because another model needs room. A worker
    with nothing to drop does nothing; either way it sends a fresh Status."""

    type: ClassVar[str] = "trim"
    incarnation: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Limit:
    """Router → worker: your share of the host budget is now ``limit_bytes`` (the router
    only raises a running worker's share; a lower one is given at spawn)."""

    type: ClassVar[str] = "limit"
    incarnation: int
    limit_bytes: int


Message = Hello | Generate | Cancel | Tokens | Reject | Status | Heartbeat | Shutdown | Trim | Limit
MESSAGE_TYPES: dict[str, type] = {
    cls.type: cls for cls in (Hello, Generate, Cancel, Tokens, Reject, Status, Heartbeat, Shutdown,
                              Trim, Limit)
}


def encode(msg: Message) -> bytes:
    """One msgpack map per message; field order is irrelevant to the reader."""
    body: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": msg.type}
    for name, _, check, _ in _plan(type(msg)):
        value = getattr(msg, name)
        if dataclasses.is_dataclass(value):
            value = _payload_to_map(value)
        elif isinstance(check, _Rows):  # by the field's declared type, not by what it holds
            value = [_payload_to_row(row) for row in value]
        body[name] = value
    return msgpack.packb(body, use_bin_type=True)


def _payload_to_map(payload: Any) -> dict[str, Any]:
    return {f.name: getattr(payload, f.name) for f in dataclasses.fields(payload)}


def _payload_to_row(payload: Any) -> list[Any]:
    """A positional payload's fields in order, trailing optional ones left out when None."""
    get, required = _row_shape(type(payload))
    row = list(get(payload))
    while len(row) > required and row[-1] is None:
        row.pop()
    return row


_ROW_SHAPES: dict[type, tuple[Callable[[Any], tuple[Any, ...]], int]] = {}


def _row_shape(cls: type) -> tuple[Callable[[Any], tuple[Any, ...]], int]:
    """A positional payload's fields as one getter, and how many leading ones have no default."""
    shape = _ROW_SHAPES.get(cls)
    if shape is None:
        fields = dataclasses.fields(cls)
        shape = (operator.attrgetter(*(f.name for f in fields)), sum(map(_required, fields)))
        _ROW_SHAPES[cls] = shape
    return shape


def decode(frame: bytes) -> Message:
    """Parse and type-check one frame; raise ``ProtocolError`` on anything else."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame is {type(frame).__name__}, not bytes")
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        body = msgpack.unpackb(
            frame, raw=False, strict_map_key=True
        )
    except Exception as exc:  # msgpack raises a zoo of types for bad input
        raise ProtocolError(f"undecodable frame: {type(exc).__name__}") from None
    if not isinstance(body, dict):
        raise ProtocolError("frame is not a map")
    version = body.pop("v", None)
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r}, expected {PROTOCOL_VERSION}")
    kind = body.pop("type", None)
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError("unknown message type")
    return _build(cls, body, cls.type)


def _build(cls: Any, body: dict[str, Any], where: str) -> Any:
    """A message or payload dataclass from its map, every field type-checked."""
    kwargs: dict[str, Any] = {}
    for name, nested, check, required in _plan(cls):
        if name in body:
            value = body.pop(name)
            if nested is not None:
                if not isinstance(value, dict):
                    raise ProtocolError(f"{where}.{name} is not a map")
                value = _build(nested, dict(value), f"{where}.{name}")
            elif isinstance(check, _Rows):
                value = check.build(value, f"{where}.{name}")
            elif not check(value):
                raise ProtocolError(f"{where}.{name} has the wrong type")
            kwargs[name] = value
        elif required:
            raise ProtocolError(f"{where} lacks {name}")
    # Unknown extra fields are tolerated: a newer peer of the same version may add some.
    return cls(**kwargs)


_Check = Callable[[Any], bool]


class _Rows:
    """A list of positional payloads (``TokenRow``): each an array of its fields in order,
    the trailing ones with defaults optional, every item type-checked."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)
        self.checks = [_checker(hints[f.name]) for f in fields]
        self.least = _row_shape(cls)[1]
        self.well_formed = hasattr(cls, "well_formed")  # what field types cannot say

    def build(self, value: Any, where: str) -> list[Any]:
        if not isinstance(value, list):
            raise ProtocolError(f"{where} is not a list")
        cls, checks, least, most = self.cls, self.checks, self.least, len(self.checks)
        rows = []
        for row in value:  # one per running request and step: kept to plain loops
            if type(row) is not list or not least <= len(row) <= most:
                raise ProtocolError(f"{where} has a malformed row")
            for check, item in zip(checks, row):
                if not check(item):
                    raise ProtocolError(f"{where} has a malformed row")
            built = cls(*row)
            if self.well_formed and not built.well_formed():
                raise ProtocolError(f"{where} has a malformed row")
            rows.append(built)
        return rows


_PLANS: dict[type, list[tuple[str, Any, Any, bool]]] = {}


def _plan(cls: type) -> list[tuple[str, Any, Any, bool]]:
    plan = _PLANS.get(cls)
    if plan is None:
        hints = typing.get_type_hints(cls)
        plan = [(f.name, hints[f.name] if dataclasses.is_dataclass(hints[f.name]) else None,
                 _rows_of(hints[f.name]) or _checker(hints[f.name]), _required(f))
                for f in dataclasses.fields(cls)]
        _PLANS[cls] = plan
    return plan


def _required(f: dataclasses.Field[Any]) -> bool:
    """A field with no default: a frame must carry it."""
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _rows_of(hint: Any) -> _Rows | None:
    """The builder for ``list[P]`` where P is a positional payload, else None."""
    if typing.get_origin(hint) is list:
        (arg,) = typing.get_args(hint) or (Any,)
        if dataclasses.is_dataclass(arg) and getattr(arg, "positional", False):
            return _Rows(arg)
    return None


def _checker(hint: Any) -> _Check:
    """The check of ``hint``'s shape, built once per hint."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [_checker(arg) for arg in typing.get_args(hint)]
        return lambda v: any(check(v) for check in options)
    if hint is Any:
        return lambda v: True
    if hint is type(None):
        return lambda v: v is None
    if hint is bool:
        return lambda v: isinstance(v, bool)
    if hint is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if hint is float:
        return _is_number
    if hint is str:
        return lambda v: isinstance(v, str)
    if origin is list:
        (arg,) = typing.get_args(hint) or (Any,)
        if arg is int:  # token id lists are the hot path: one pass, no recursion
            return lambda v: isinstance(v, list) and all(type(x) is int for x in v)
        item = _checker(arg)
        return lambda v: isinstance(v, list) and all(item(x) for x in v)
    if origin is dict:
        _, item_hint = typing.get_args(hint) or (str, Any)
        if item_hint is Any:  # free-form (a status report, a cost model): bounded in depth only
            return lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v) \
                and _shallow(v, MAX_FREE_DEPTH)
        value_check = _checker(item_hint)
        return lambda v: isinstance(v, dict) and all(isinstance(k, str) and value_check(x)
                                                     for k, x in v.items())
    return lambda v: False


def _shallow(value: Any, depth: int) -> bool:
    """No deeper than ``depth`` levels of lists and maps (msgpack's own decoder stops at
    1024, deep enough to make the router's JSON encoder or a recursive walk fail later)."""
    level = [value]
    for _ in range(depth + 1):
        level = [v for x in level if isinstance(x, (list, dict))
                 for v in (x.values() if isinstance(x, dict) else x)]
        if not level:
            return True
    return False


def peek_hello(frame: bytes) -> dict[str, Any] | None:
    """Leniently read a hello of *another* protocol version, to show it as refused.

    Returns the few fields an operator needs (version, pid, package version), or None.
    Never raises.
    """
    try:
        body = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception:
        return None
    if not isinstance(body, dict) or body.get("type") != "hello":
        return None
    fields = ("v", "pid", "package_version", "incarnation", "model_id")
    return {k: body.get(k) for k in fields if isinstance(body.get(k), (int, str))}
