"""Tests for worker/lockstep.py: the frames between a distributed group's ranks, and the
replay of rank 0's engine inputs on a follower's engine (in rank 0's order)."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest

from common.protocol import SamplingParams
from worker.lockstep import (
    Add, Cancel, CancelAll, Chunk, EngineShape, LockstepError, ScoreChunk, StepInputs, apply, decode_inputs,
    decode_shape, encode_inputs, encode_shape, with_seed,
)

SAMPLED = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, logit_bias=[[3, -1.5]], seed=11,
                         num_logprobs=2, grammar='{"grammars": []}', ignore_eos=True, prompt_logprobs=3)


def test_step_inputs_round_trip() -> None:
    inputs = StepInputs(ops=[Add("a", [1, 2, 3], 8, SamplingParams()),
                             Add("b", [4], 2, SAMPLED, [1]), Chunk(64), ScoreChunk(48), ScoreChunk(0),
                             Cancel("a"), CancelAll()],
                        step=True)
    assert decode_inputs(encode_inputs(inputs)) == inputs


def test_stop_without_step_round_trips() -> None:
    inputs = StepInputs(ops=[], step=False, stop=True)
    assert decode_inputs(encode_inputs(inputs)) == inputs


@pytest.mark.parametrize("body", [
    b"\xc1",                                              # not msgpack
    msgpack.packb([1, 2]),                                # not a map
    msgpack.packb({"ops": [], "step": 1, "stop": False}),  # step not a bool
    msgpack.packb({"ops": [["add", "a", [1], 2]], "step": True, "stop": False}),  # short add
    msgpack.packb({"ops": [["add", "a", ["x"], 2, {}, []]], "step": True, "stop": False}),
    msgpack.packb({"ops": [["add", "a", [1], 2, {"nope": 1}, []]], "step": True, "stop": False}),
    msgpack.packb({"ops": [["chunk", 0]], "step": True, "stop": False}),
    msgpack.packb({"ops": [["score", -1]], "step": True, "stop": False}),
    msgpack.packb({"ops": [["launch"]], "step": True, "stop": False}),
])
def test_bad_frames_raise_lockstep_error(body: bytes) -> None:
    with pytest.raises(LockstepError):
        decode_inputs(body)


def test_engine_shape_round_trips_and_rejects_garbage() -> None:
    shape = EngineShape([2, 0], 512, 8, 32)
    assert decode_shape(encode_shape(shape)) == shape
    with pytest.raises(LockstepError):
        decode_shape(msgpack.packb({"eos_token_ids": [2]}))


def test_with_seed_gives_sampled_unseeded_rows_a_seed_only() -> None:
    unseeded = SamplingParams(temperature=1.0)
    seeded = with_seed(unseeded, draw=lambda bits: 42)
    assert seeded == dataclasses.replace(unseeded, seed=42)
    assert with_seed(SamplingParams(), draw=lambda bits: 42) == SamplingParams()  # greedy
    assert with_seed(SAMPLED, draw=lambda bits: 42) == SAMPLED                    # has one


class FakeEngine:
    """Records the calls a follower's Engine would get (apply is all it drives)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def add(self, request_id: str, prompt_ids: list[int], *, max_tokens: int,
            sampling: SamplingParams = SamplingParams(), hit: Any = None,
            boundaries: list[int] | None = None) -> None:
        self.calls.append(("add", request_id, prompt_ids, max_tokens, sampling, boundaries))

    def cancel(self, request_id: str) -> bool:
        self.calls.append(("cancel", request_id))
        return True

    def set_prefill_step(self, tokens: int) -> None:
        self.calls.append(("chunk", tokens))

    def set_score_step(self, tokens: int) -> None:
        self.calls.append(("score", tokens))

    def cancel_all(self) -> list[str]:
        self.calls.append(("cancel_all",))
        return []


def test_apply_replays_in_rank_zeros_order() -> None:
    engine = FakeEngine()
    frame = encode_inputs(StepInputs(ops=[Chunk(16), Add("a", [1, 2], 4, SAMPLED, [1]), ScoreChunk(32),
                                          Cancel("a"), Add("b", [3], 1, SamplingParams()), CancelAll()]))
    apply(decode_inputs(frame).ops, engine)
    assert engine.calls == [("chunk", 16), ("add", "a", [1, 2], 4, SAMPLED, [1]), ("score", 32),
                            ("cancel", "a"), ("add", "b", [3], 1, SamplingParams(), None), ("cancel_all",)]


def test_a_row_a_follower_dropped_alone_is_named_and_one_rank_0_dropped_too_is_not() -> None:
    """A follower's own row failure (its grammar, its sampler) ends the row there; if rank 0
    does not end it too in its next inputs, the ranks' batches part: the follower leaves."""
    from worker.lockstep import dropped_alone

    assert dropped_alone({"r1", "r2"}, [Cancel("r1"), Chunk(64)]) == {"r2"}
    assert dropped_alone({"r1"}, [Cancel("r1")]) == set()
    assert dropped_alone({"r1"}, [CancelAll()]) == set()
    assert dropped_alone(set(), []) == set()
