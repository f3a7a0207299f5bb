"""The engine inputs that keep a distributed group's ranks in lockstep, and their frames.

Pure (no MLX): what rank 0 records (add, cancel, the next prefill chunk, the next scoring
chunk of a prompt whose logprobs were asked for, cancel all), how
it travels between ranks (one msgpack frame per step), and how a follower replays it on
its engine. ``worker/distributed.py`` carries the frames over ``mx.distributed``.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgpack

from common.protocol import SamplingParams

log = logging.getLogger(__name__)

# Largest frame a step's inputs may take (prompts of many new rows at once).
MAX_INPUTS_BYTES = 64 << 20


class LockstepError(RuntimeError):
    """A frame between ranks was not what rank 0 sends: the group cannot stay in step."""


@dataclass(frozen=True, slots=True)
class Add:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    boundaries: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Cancel:
    request_id: str


@dataclass(frozen=True, slots=True)
class Chunk:
    """The prefill chunk size for the next step (the gate and pacer decide it on rank 0)."""

    tokens: int


@dataclass(frozen=True, slots=True)
class ScoreChunk:
    """The scoring chunk for the next steps (0: none; the gate and pacer decide it on rank 0):
    every rank's scoring forwards must be the same collectives."""

    tokens: int


@dataclass(frozen=True, slots=True)
class CancelAll:
    """After a failed step: nothing of the running rows is kept."""


Op = Add | Cancel | Chunk | ScoreChunk | CancelAll


@dataclass(frozen=True, slots=True)
class StepInputs:
    """What every rank applies, in order, and then whether it steps or leaves the group."""

    ops: list[Op] = field(default_factory=list)
    step: bool = True
    stop: bool = False


@dataclass(frozen=True, slots=True)
class EngineShape:
    """The engine's constructor arguments: followers must batch exactly as rank 0 does."""

    eos_token_ids: list[int]
    prefill_step_size: int
    prefill_batch_size: int
    max_batch_size: int


# -- the frames (pure) -------------------------------------------------------------------

def encode_inputs(inputs: StepInputs) -> bytes:
    ops: list[list[Any]] = []
    for op in inputs.ops:
        if isinstance(op, Add):
            ops.append(["add", op.request_id, op.prompt_ids, op.max_tokens,
                        dataclasses.asdict(op.sampling), op.boundaries])
        elif isinstance(op, Cancel):
            ops.append(["cancel", op.request_id])
        elif isinstance(op, Chunk):
            ops.append(["chunk", op.tokens])
        elif isinstance(op, ScoreChunk):
            ops.append(["score", op.tokens])
        else:
            ops.append(["cancel_all"])
    return msgpack.packb({"ops": ops, "step": inputs.step, "stop": inputs.stop}, use_bin_type=True)


def decode_inputs(frame: bytes) -> StepInputs:
    try:
        body = msgpack.unpackb(frame, raw=False, strict_map_key=True)
        if not isinstance(body, dict) or not isinstance(body.get("ops"), list):
            raise LockstepError("not a step-inputs map")
        ops = [_decode_op(op) for op in body["ops"]]
        step, stop = body.get("step"), body.get("stop")
        if not isinstance(step, bool) or not isinstance(stop, bool):
            raise LockstepError("step and stop must be booleans")
    except LockstepError:
        raise
    except Exception as exc:  # msgpack, or a field of the wrong shape
        raise LockstepError(f"undecodable step inputs: {type(exc).__name__}: {exc}") from None
    return StepInputs(ops=ops, step=step, stop=stop)


def _decode_op(op: Any) -> Op:
    if not isinstance(op, list) or not op or not isinstance(op[0], str):
        raise LockstepError(f"bad op {op!r:.80}")
    kind, args = op[0], op[1:]
    if kind == "add" and len(args) == 5:
        request_id, prompt_ids, max_tokens, sampling, boundaries = args
        if not (isinstance(request_id, str) and isinstance(max_tokens, int)
                and isinstance(prompt_ids, list) and all(isinstance(t, int) for t in prompt_ids)
                and isinstance(boundaries, list) and isinstance(sampling, dict)):
            raise LockstepError(f"bad add op for {request_id!r:.40}")
        return Add(request_id, prompt_ids, max_tokens, SamplingParams(**sampling), boundaries)
    if kind == "cancel" and len(args) == 1 and isinstance(args[0], str):
        return Cancel(args[0])
    if kind == "chunk" and len(args) == 1 and isinstance(args[0], int) and args[0] > 0:
        return Chunk(args[0])
    if kind == "score" and len(args) == 1 and isinstance(args[0], int) and args[0] >= 0:
        return ScoreChunk(args[0])
    if kind == "cancel_all" and not args:
        return CancelAll()
    raise LockstepError(f"bad op {op!r:.80}")


def encode_shape(shape: EngineShape) -> bytes:
    return msgpack.packb(dataclasses.asdict(shape), use_bin_type=True)


def decode_shape(frame: bytes) -> EngineShape:
    try:
        return EngineShape(**msgpack.unpackb(frame, raw=False, strict_map_key=True))
    except Exception as exc:
        raise LockstepError(f"undecodable engine shape: {type(exc).__name__}: {exc}") from None


def with_seed(sampling: SamplingParams, draw: Any = secrets.randbits) -> SamplingParams:
    """A sampled row without a seed gets one, so every rank draws the same tokens."""
    if sampling.temperature <= 0 or sampling.seed is not None:
        return sampling
    return dataclasses.replace(sampling, seed=draw(63))


class Target(Protocol):
    """The part of ``Engine`` the ops drive."""

    def add(self, request_id: str, prompt_ids: list[int], *, max_tokens: int,
            sampling: SamplingParams = ..., hit: Any = None,
            boundaries: list[int] | None = None) -> None: ...
    def cancel(self, request_id: str) -> bool: ...
    def set_prefill_step(self, tokens: int) -> None: ...
    def set_score_step(self, tokens: int) -> None: ...
    def cancel_all(self) -> list[str]: ...


def apply(ops: Sequence[Op], engine: Target) -> None:
    """Replay rank 0's engine inputs on a follower's engine, in rank 0's order."""
    for op in ops:
        if isinstance(op, Add):
            engine.add(op.request_id, op.prompt_ids, max_tokens=op.max_tokens,
                       sampling=op.sampling, boundaries=op.boundaries or None)
        elif isinstance(op, Cancel):
            engine.cancel(op.request_id)
        elif isinstance(op, Chunk):
            engine.set_prefill_step(op.tokens)
        elif isinstance(op, ScoreChunk):
            engine.set_score_step(op.tokens)
        else:
            engine.cancel_all()


def dropped_alone(failed: set[str], ops: Sequence[Op]) -> set[str]:
    """The rows a follower's engine ended for their own failure (``worker/containment.py``)
    that rank 0's next inputs do not end too: there the ranks' batches part, and the next
    collective would wait for ever, so the follower must leave the group instead."""
    if any(isinstance(op, CancelAll) for op in ops):
        return set()
    return failed - {op.request_id for op in ops if isinstance(op, Cancel)}
